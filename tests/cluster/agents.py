"""Redis, ``meshgate node`` agents and one gateway, all linked: the stage the backends' cluster tests play on."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.cluster.redis_server import RedisServer
from tests.cluster.test_cluster_e2e import FAST, Agent, wait_for
from tests.conftest import Server


@contextmanager
def linked_cluster(
    tmp_path_factory: pytest.TempPathFactory,
    data_dir: Path,
    name: str,
    *,
    n_ctx: int,
    env: dict[str, str],
    nodes: dict[str, dict[str, str]],
    memory: str | None = None,
    show_logs: bool = False,
) -> Iterator[tuple[Server, dict[str, Agent]]]:
    """A gateway and one agent per ``nodes`` entry (its extra environment), up once every pair has measured its
    link; ``env`` goes to all of them. Everything is stopped on the way out (agents' log tails printed with
    ``show_logs``)."""
    logs = tmp_path_factory.mktemp(f"{name}-logs")
    extra = {"memory": memory} if memory else {}
    with RedisServer(tmp_path_factory.mktemp(f"{name}-redis")) as redis:
        agents = {
            node: Agent(redis.url, node, data_dir, logs, n_ctx=n_ctx, env={**env, **own}, **extra)
            for node, own in nodes.items()
        }
        gateway = Server(data_dir, "--redis", redis.url, "--n-ctx", str(n_ctx), env={**FAST, **env})
        try:
            pairs = len(nodes) * (len(nodes) - 1)
            wait_for(lambda: len(httpx.get(f"{gateway.url}/cluster").json()["links"]) >= pairs, 60, "linked nodes")
            yield gateway, agents
        finally:
            gateway.stop()
            for agent in agents.values():
                agent.stop()
            for agent in agents.values() if show_logs else ():
                print(f"--- agent {agent.name} log tail\n{agent.log.read_text(errors='replace')[-3000:]}")
