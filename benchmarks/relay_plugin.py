"""A scripted runner process behind the real runner client: for measuring what the gateway spends relaying tokens.

Loaded into a gateway with ``--plugin benchmarks.relay_plugin``, it serves model ``relay`` through backend
``relay``, whose ``launch`` starts ``python -m benchmarks.relay_plugin`` (a raw ASGI app under uvicorn, as the
real runners are) and whose ``connect`` talks to it with ``backends.runner.client.RunnerClient``, the client every
real runner is read with. So the gateway process does exactly its relaying work and no generating.

The runner plays back ``max_tokens`` text deltas (200 if unset) of a few bytes each, framed as a real runner
frames them: ``Usage``, the deltas, ``Usage``, ``Finished``. The prompt (the last message's text, or the raw
prompt) may carry ``burst=K`` (K events per HTTP body chunk, as a batched runner writes what it has ready; 1 by
default) and ``interval=S`` (seconds between chunks; 0 by default, so chunks go out back to back).

For benchmarks only: never a default plugin.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import msgspec

from meshgate.backends.base import Backend, Capabilities, ModelCard, ModelSource, Peers
from meshgate.backends.placement import Candidate, ModelSpec, Shard, ShardCosts
from meshgate.backends.runner.client import RunnerClient
from meshgate.backends.runner.process import RunnerProcess
from meshgate.backends.runner.server import READY_LINE, exit_when_parent_goes
from meshgate.plugins.hookspecs import hookimpl
from meshgate.protocols.model import (
    Embeddings,
    EmbedRequest,
    Event,
    Finished,
    Request,
    TextDelta,
    UnsupportedFeature,
    Usage,
)

CARD = ModelCard(
    name="relay:latest",
    path="",
    format="relay",
    family="relay",
    parameter_size="0",
    size=1,
    digest="2" * 64,
    created=1_700_000_000.0,
    context_length=8192,
)
WORDS = (" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ".")
_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(Request)


def script(request: Request) -> tuple[list[bytes], int, float]:
    """The NDJSON lines to send for ``request``, and its ``burst`` and ``interval``."""
    text = request.messages[-1].text if request.messages else (request.raw_prompt or "")
    options = dict(word.split("=", 1) for word in text.split() if "=" in word)
    burst = max(1, int(options.get("burst", 1)))
    interval = max(0.0, float(options.get("interval", 0)))
    tokens = request.max_tokens if isinstance(request.max_tokens, int) else 200
    events: list[Event] = [Usage(prompt_tokens=8)]
    events += [TextDelta(text=WORDS[i % len(WORDS)]) for i in range(tokens)]
    events += [Usage(prompt_tokens=8, completion_tokens=tokens), Finished(reason="length")]
    return [_encoder.encode(e) + b"\n" for e in events], burst, interval


async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    """``POST /generate`` plays the script; ``GET /health`` answers ``{}``; everything else 404."""
    if scope["type"] == "lifespan":
        while (message := await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] != "/generate":
        status = 200 if scope["path"] == "/health" else 404
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]}
        )
        await send({"type": "http.response.body", "body": b"{}"})
        return
    lines, burst, interval = script(_request_decoder.decode(body))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-ndjson")]})
    for start in range(0, len(lines), burst):
        if start and interval:
            await asyncio.sleep(interval)
        await send({"type": "http.response.body", "body": b"".join(lines[start : start + burst]), "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


class RelayRunner:
    def __init__(self, client: RunnerClient) -> None:
        self.client = client

    def generate(self, request: Request) -> AsyncIterator[Event]:
        return self.client.generate(request)

    async def count_tokens(self, request: Request) -> int:
        return 8

    async def embed(self, request: EmbedRequest) -> Embeddings:
        raise UnsupportedFeature("the relay runner does not embed")


class Launched:
    def __init__(self, process: RunnerProcess, host: str) -> None:
        self.process = process
        self.pid: int | None = process.pid
        self.url: str | None = f"http://{host}:{process.port}"

    @property
    def alive(self) -> bool:
        return self.process.alive

    async def stop(self) -> None:
        await self.process.stop()


class RelayBackend(Backend):  # inherits the defaults (context, describe)
    name = "relay"

    def __init__(self, http) -> None:
        self.http = http

    def supports(self, card: ModelCard) -> bool:
        return card.format == "relay"

    def capabilities(self, card: ModelCard) -> Capabilities:
        return Capabilities(raw_prompt=True)

    def strategies(self, card: ModelCard) -> frozenset[str]:
        return frozenset({"single"})

    def spec(self, card: ModelCard) -> ModelSpec:
        return ModelSpec(
            name=card.name,
            n_layers=1,
            hidden_size=8,
            n_heads=1,
            n_kv_heads=1,
            head_dim=8,
            context_length=card.context_length,
            layer_bytes=1 << 20,
        )

    def costs(self, card: ModelCard) -> ShardCosts:
        return ShardCosts()

    async def launch(self, card: ModelCard, placement: Candidate, shard: Shard, *, host: str, peers: Peers) -> Launched:
        argv = [sys.executable, "-m", "benchmarks.relay_plugin", "--host", host]
        return Launched(await RunnerProcess.start(argv, name=card.name, ready_timeout=30.0), host)

    def connect(self, card: ModelCard, placement: Candidate, urls: Mapping[str, str]) -> RelayRunner:
        return RelayRunner(RunnerClient(next(iter(urls.values())), self.http))


class RelaySource:
    name = "relay"

    def models(self) -> Sequence[ModelCard]:
        return [CARD]


@hookimpl
def meshgate_register_backends(register: Callable[[Backend], None], settings, http) -> None:
    register(RelayBackend(http))


@hookimpl
def meshgate_register_model_sources(register: Callable[[ModelSource], None], settings) -> None:
    register(RelaySource())


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, 0))
    sock.listen(64)
    threading.Thread(target=exit_when_parent_goes, name="parent-watch", daemon=True).start()
    print(f"{READY_LINE} port={sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
