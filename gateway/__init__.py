"""The server and the control plane, in rooms by role. May import everything below it; nothing imports it.

    cli/        the ``meshgate`` command: serve, node, ps, place, keys, bench (``python -m meshgate.gateway.cli``)
    http/       the process: app, runtime (what a gateway and a node agent share), routes, error envelopes, /ui
    batches/    batch jobs (OpenAI files + batches, Anthropic message batches): lines claimed once, run by a worker
    models/     Ollama model administration: show, ps, copy, delete, create, pull, keep-alive
    serving/    one request: defaults, context fit, dispatch to a replica, admission, streams, resume
    auth/       API keys (stored hashed) and the one guard every route passes
    cluster/    the control plane: state store, planner, instances, deployments, autoscaler, routing, node agent
    telemetry/  metrics, the request log and its records

Each room imports only rooms below it in this list (``auth`` and ``serving`` are siblings that import neither);
the import contracts in ``pyproject.toml`` keep it so.
"""
