"""The shout backend: a model served by its own runner process, on meshgate's runner seam.

``ShoutBackend.launch`` (in the node agent) starts ``python -m meshgate_subprocess.runner`` with
``meshgate.RunnerProcess``, which waits for the runner's ready line and hands it the cluster secret through its
environment; ``ShoutBackend.connect`` (in the gateway) returns a ``meshgate.RunnerClient`` of that runner, which
presents the secret on every call and already is a ``meshgate.Runner`` (``generate``, ``count_tokens``,
``embed``). Closing its stream closes the connection, and the runner cancels the generation.

Imports ``meshgate`` only.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import meshgate

CARD = meshgate.ModelCard(
    name="shout:latest",
    path="",
    format="shout",
    family="shout",
    parameter_size="0",
    size=0,
    context_length=4096,
    source="meshgate-subprocess",
)


class ShoutProcess:
    """A ``meshgate.Launched``: the node agent's handle on one started runner process."""

    def __init__(self, process: meshgate.RunnerProcess, host: str) -> None:
        self.process = process
        self.pid: int | None = process.pid
        self.url: str | None = f"http://{f'[{host}]' if ':' in host else host}:{process.port}"

    @property
    def alive(self) -> bool:
        return self.process.alive

    async def stop(self) -> None:
        await self.process.stop()


class ShoutBackend(meshgate.Backend):
    """Serves ``shout`` models, one runner process per placed model."""

    name = "shout"

    def __init__(self, http: Any, *, python: str | None = None, ready_timeout: float = 30.0) -> None:
        self.http = http  # the gateway's shared httpx.AsyncClient: every meshgate.RunnerClient reuses its connections
        self.python = python or sys.executable  # this package must be importable by that interpreter
        self.ready_timeout = ready_timeout

    def supports(self, card: meshgate.ModelCard) -> bool:
        return card.format == "shout"

    def capabilities(self, card: meshgate.ModelCard) -> meshgate.Capabilities:
        return meshgate.Capabilities()  # no tools, images, schemas or embeddings: the gateway refuses those

    def strategies(self, card: meshgate.ModelCard) -> frozenset[meshgate.Strategy]:
        return frozenset({"single"})  # one process on one node; no pipeline split

    def spec(self, card: meshgate.ModelCard) -> meshgate.ModelSpec:
        return meshgate.ModelSpec(
            name=card.name,
            n_layers=1,
            hidden_size=8,
            n_heads=1,
            n_kv_heads=1,
            head_dim=8,
            context_length=card.context_length,
            layer_bytes=1 << 20,
        )

    def costs(self, card: meshgate.ModelCard) -> meshgate.ShardCosts:
        return meshgate.ShardCosts(base_bytes=40 << 20)  # a Python process with uvicorn, about 40 MiB resident

    async def launch(
        self,
        card: meshgate.ModelCard,
        placement: meshgate.Candidate,
        shard: meshgate.Shard,
        *,
        host: str,
        peers: meshgate.Peers,
    ) -> ShoutProcess:
        argv = [self.python, "-m", "meshgate_subprocess.runner", "--host", host, "--port", "0"]
        process = await meshgate.RunnerProcess.start(argv, name=card.name, ready_timeout=self.ready_timeout)
        return ShoutProcess(process, host)

    def connect(
        self, card: meshgate.ModelCard, placement: meshgate.Candidate, urls: Mapping[str, str]
    ) -> meshgate.RunnerClient:
        return meshgate.RunnerClient(urls[placement.shards[0].node_id], self.http)  # "single": one shard, one runner


class ShoutSource:
    name = "shout"

    def models(self) -> list[meshgate.ModelCard]:
        return [CARD]


@meshgate.hookimpl
def meshgate_register_backends(register, settings, http) -> None:
    register(ShoutBackend(http))


@meshgate.hookimpl
def meshgate_register_model_sources(register, settings) -> None:
    register(ShoutSource())
