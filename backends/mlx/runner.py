"""The MLX runner process: ``python -m backends.mlx.runner --model DIR`` (run with the MLX venv's python).

One process: loads the model and serves it over the internal streaming protocol (``backends.runner.server``).
Distributed (``MLX_RANK`` and ``MLX_HOSTFILE`` set, as ``backends.mlx.launch`` does): every rank joins the ring
group and loads its shard; rank 0 serves HTTP, the others follow it (``MlxEngine.follow``) until it shuts down.
"""

from __future__ import annotations

import argparse
import os
import sys

from backends.mlx.engine import MlxEngine
from backends.runner.server import FAILED_LINE, serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="meshgate-mlx-runner")
    parser.add_argument("--model", required=True, help="directory of an mlx-lm model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--sharding", default="tensor", choices=["tensor"])
    args = parser.parse_args(argv)
    group = None
    try:
        if os.environ.get("MLX_HOSTFILE"):
            import mlx.core as mx

            group = mx.distributed.init(strict=True, backend="ring")
        engine = MlxEngine(args.model, group=group, mode=args.sharding, n_ctx=args.n_ctx)
    except Exception as exc:  # tell the supervisor why, then exit: nothing is served
        print(f"{FAILED_LINE} {exc}", flush=True)
        sys.exit(1)
    if engine.rank != 0:
        engine.follow()
        return
    serve(engine, args.host, args.port)


if __name__ == "__main__":
    main()
