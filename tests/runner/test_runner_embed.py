"""The runner's ``POST /embed`` and the gateway's ``RunnerClient.embed``: results and errors cross the hop intact.

In-process (``httpx.ASGITransport``): an embedding answer is one JSON body, so nothing here depends on streaming.
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from meshgate.backends.runner.client import RunnerClient
from meshgate.backends.runner.server import RunnerApp
from meshgate.protocols.model import (
    BackendProtocolError,
    BackendUnavailable,
    Embeddings,
    EmbedRequest,
    GatewayError,
    InvalidRequest,
    UnsupportedFeature,
)
from tests.conftest import free_port

REQUEST = EmbedRequest(model="m", inputs=("a cat", (2, 3)), dimensions=2, truncate=False)


class Engine:
    def __init__(self, result: Embeddings | Exception) -> None:
        self.result = result
        self.seen: list[EmbedRequest] = []

    def generate(self, request, cancel):  # pragma: no cover - not used here
        raise NotImplementedError

    def health(self) -> dict[str, object]:
        return {"status": "ok"}

    def embed(self, request: EmbedRequest, cancel) -> Embeddings:
        self.seen.append(request)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


class GenerateOnly:
    def generate(self, request, cancel):  # pragma: no cover - not used here
        raise NotImplementedError

    def health(self) -> dict[str, object]:
        return {"status": "ok"}


def embed_through(app) -> Embeddings:
    async def go() -> Embeddings:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as http:
            return await RunnerClient("http://runner", http).embed(REQUEST)

    return asyncio.run(go())


def test_embeddings_cross_the_runner_hop():
    result = Embeddings(vectors=((0.6, 0.8), (1.0, 0.0)), prompt_tokens=5, load_ns=7)
    engine = Engine(result)
    assert embed_through(RunnerApp(engine)) == result
    assert engine.seen == [REQUEST]


@pytest.mark.parametrize(
    ("raised", "expected", "param"),
    [
        (InvalidRequest("dimensions too large", param="dimensions"), InvalidRequest, "dimensions"),
        (ValueError("tokenizer said no"), InvalidRequest, None),
        (RuntimeError("llama_decode returned -1"), GatewayError, None),
    ],
)
def test_engine_errors_become_the_same_gateway_error(raised, expected, param):
    with pytest.raises(expected) as exc:
        embed_through(RunnerApp(Engine(raised)))
    assert type(exc.value) is expected and exc.value.param == param
    assert str(raised) in exc.value.message


def test_an_engine_without_embed_is_unsupported():
    with pytest.raises(UnsupportedFeature):
        embed_through(RunnerApp(GenerateOnly()))


def test_a_runner_that_answers_garbage_is_a_protocol_error():
    async def garbage(scope, receive, send):
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"Internal Server Error"})

    with pytest.raises(BackendProtocolError, match="runner answered 500"):
        embed_through(garbage)


def test_an_unreachable_runner_is_unavailable():
    async def go() -> None:
        async with httpx.AsyncClient() as http:
            await RunnerClient(f"http://127.0.0.1:{free_port()}", http).embed(REQUEST)

    with pytest.raises(BackendUnavailable):
        asyncio.run(go())


def test_a_client_that_goes_away_cancels_the_embedding():
    class Blocking(Engine):
        def embed(self, request: EmbedRequest, cancel) -> Embeddings:
            self.seen.append(request)
            self.cancelled = cancel.wait(5)
            raise GatewayError("cancelled")

    engine = Blocking(Embeddings())
    body = msgspec.json.encode(REQUEST)
    messages = [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else await asyncio.sleep(3600)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/embed", "method": "POST"}
    asyncio.run(asyncio.wait_for(RunnerApp(engine)(scope, receive, send), 10))
    assert engine.seen == [REQUEST] and engine.cancelled
