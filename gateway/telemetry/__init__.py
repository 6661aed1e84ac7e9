"""Telemetry: Prometheus metrics (``/metrics`` on the gateway and on each node agent) and the request log.

``record`` (the per-request facts, in a context variable), ``middleware`` (request id, log line, counting),
``metrics`` (the gateway's families), ``node_metrics`` (an agent's), ``instruments`` (cheap counters and
histograms exported through ``prometheus_client``), ``logs`` (text or JSON output), ``route`` (``GET /metrics``).
This package imports nothing at import time, so ``gateway.serving`` can import ``record`` and ``observe`` alone.
"""
