"""MLX (mlx-lm) in runner processes, tensor-sharded over MLX's ring backend. Groundwork for step 7: the engine,
the runner, the rank launcher and the lockstep protocol between ranks; the gateway-side backend, agent launch
and pipeline sharding are not written yet. Imports protocols and backends.runner; mlx only in the runner."""
