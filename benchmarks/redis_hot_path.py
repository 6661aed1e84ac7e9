"""Redis round trips on the request hot path, with the cluster state in a real Redis.

    .venv/bin/python benchmarks/redis_hot_path.py [--requests 500]

Starts redis-server, a node agent and a gateway (scripted instant backend), places one instance, then counts
Redis commands (``INFO commandstats``) while the gateway sits idle and while it serves chat requests; prints the
commands per request net of the background loops (heartbeats, reconcile). Target: none beyond a cached view.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster.redis_server import RedisServer  # noqa: E402
from tests.conftest import Server  # noqa: E402


def commands(url: str) -> int:
    stats = redis.Redis.from_url(url).info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_info",))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--idle", type=float, default=3.0)
    args = parser.parse_args()
    data_dir = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
    with tempfile.TemporaryDirectory() as tmp, RedisServer(Path(tmp)) as server:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "meshgate.gateway.cli",
                "node",
                "--redis",
                server.url,
                "--name",
                "n1",
                "--data-dir",
                str(data_dir),
                "--plugin",
                "tests.scripted_plugin",
                "--log-level",
                "warning",
            ],
            env=env,
            cwd=ROOT,
        )
        gateway = Server(data_dir, "--redis", server.url, "--plugin", "tests.scripted_plugin")
        try:
            body = {"model": "scripted", "messages": [{"role": "user", "content": "hello"}]}
            with httpx.Client(base_url=gateway.url, timeout=60) as http:
                deadline = time.monotonic() + 60
                while http.post("/v1/chat/completions", json=body).status_code != 200:
                    if time.monotonic() > deadline:
                        raise RuntimeError("instance never became ready")
                    time.sleep(0.2)
                for _ in range(50):
                    http.post("/v1/chat/completions", json=body).raise_for_status()
                before, started = commands(server.url), time.monotonic()
                time.sleep(args.idle)
                idle_rate = (commands(server.url) - before) / (time.monotonic() - started)
                before, started = commands(server.url), time.monotonic()
                for _ in range(args.requests):
                    http.post("/v1/chat/completions", json=body).raise_for_status()
                elapsed = time.monotonic() - started
                during = commands(server.url) - before
        finally:
            gateway.stop()
            agent.terminate()
            agent.wait()
    net = during - idle_rate * elapsed
    print(f"Redis commands, whole cluster (1 agent + 1 gateway), {args.requests} chat requests in {elapsed:.2f} s")
    print(f"  background (heartbeats, reconcile, probes) : {idle_rate:7.1f} commands/s")
    print(f"  during the requests                        : {during:7d} commands")
    print(f"  per request, net of background             : {net / args.requests:7.3f}   (target: 0)")


if __name__ == "__main__":
    main()
