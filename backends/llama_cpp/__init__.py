"""llama.cpp through llama-cpp-python: GGUF models, each served by a runner process.

``LlamaCppBackend`` is the gateway-side half: it starts ``python -m backends.llama_cpp.runner`` for a model and
hands back a ``LlamaCppRunner`` that speaks the internal streaming protocol to it. llama-cpp-python itself is
only ever imported inside the runner process, so a crash in the runtime cannot take the gateway down.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import httpx

from backends.base import Capabilities, ModelCard
from backends.runner.client import RunnerClient
from backends.runner.process import RunnerProcess
from protocols.model import Event, Request

__all__ = ["LlamaCppBackend", "LlamaCppRunner"]


class LlamaCppRunner:
    """A running llama.cpp runner process for one model."""

    def __init__(self, card: ModelCard, process: RunnerProcess, client: RunnerClient) -> None:
        self.card = card
        self.process = process
        self.client = client

    @property
    def alive(self) -> bool:
        return self.process.alive

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        async for event in self.client.generate(request):
            yield event

    async def close(self) -> None:
        await self.process.stop()


class LlamaCppBackend:
    """Serves GGUF models with llama-cpp-python in runner processes."""

    name = "llama_cpp"

    def __init__(self, http: httpx.AsyncClient, *, python: str | None = None, n_ctx: int = 4096,
                 threads: int | None = None, host: str = "127.0.0.1", ready_timeout: float = 120.0) -> None:
        self.http = http
        self.python = python or sys.executable
        self.n_ctx = n_ctx
        self.threads = threads
        self.host = host
        self.ready_timeout = ready_timeout

    def supports(self, card: ModelCard) -> bool:
        return card.format == "gguf"

    def capabilities(self, card: ModelCard) -> Capabilities:
        return Capabilities(tools=False, vision=False, json_schema=True, raw_prompt=True)

    async def start(self, card: ModelCard) -> LlamaCppRunner:
        argv = [self.python, "-m", "backends.llama_cpp.runner", "--model", card.path, "--host", self.host,
                "--n-ctx", str(min(self.n_ctx, card.context_length or self.n_ctx))]
        if self.threads:
            argv += ["--threads", str(self.threads)]
        process = await RunnerProcess.start(argv, name=card.name, ready_timeout=self.ready_timeout)
        return LlamaCppRunner(card, process, RunnerClient(f"http://{self.host}:{process.port}", self.http))
