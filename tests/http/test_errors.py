"""``gateway.http.errors``: one handler picks every error's envelope, by path and by Anthropic's header, in process
with Litestar's test client (no gateway process: the rule is the app's, the routes here only raise)."""

from __future__ import annotations

import pytest
from litestar import Litestar, get, post
from litestar.testing import TestClient

from meshgate.gateway.http import errors
from meshgate.protocols import anthropic, ollama, openai
from meshgate.protocols.model import InvalidRequest, Overloaded


@pytest.mark.parametrize(
    ("path", "headers", "codec"),
    [
        ("/api/chat", {}, ollama),
        ("/api/tags", {"anthropic-version": "2023-06-01"}, ollama),  # Ollama's paths are Ollama's whoever asks
        ("/v1/messages", {}, anthropic),
        ("/v1/messages/count_tokens", {}, anthropic),
        ("/v1/models", {"anthropic-version": "2023-06-01"}, anthropic),
        ("/v1/models", {}, openai),
        ("/v1/chat/completions", {}, openai),
        ("/instances", {}, openai),
        ("/keys", {}, openai),
    ],
)
def test_the_envelope_follows_the_path_then_the_header(path, headers, codec) -> None:
    assert errors.codec_for(path, headers) is codec


@get(["/api/raise", "/v1/raise", "/v1/messages/raise"], sync_to_thread=False)
def raising(kind: str = "invalid") -> None:
    if kind == "busy":
        raise Overloaded("the queue is full", retry_after=3)
    if kind == "bug":
        raise KeyError("x")
    raise InvalidRequest("messages: expected an array", param="messages")


@post("/v1/typed", sync_to_thread=False)
def typed(data: dict[str, int]) -> None:
    return None


@pytest.fixture
def client():
    app = Litestar(route_handlers=[raising, typed], exception_handlers={Exception: errors.render}, debug=False)
    with TestClient(app) as test_client:
        yield test_client


def test_each_protocol_gets_its_own_shape(client) -> None:
    reply = client.get("/api/raise")
    assert reply.status_code == 400 and reply.json() == {"error": "messages: expected an array"}
    reply = client.get("/v1/messages/raise")
    assert reply.status_code == 400 and reply.json()["type"] == "error", reply.json()
    assert reply.json()["error"]["type"] == "invalid_request_error"
    reply = client.get("/v1/raise")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages", reply.json()


def test_retry_after_and_unexpected_errors(client) -> None:
    reply = client.get("/v1/raise", params={"kind": "busy"})
    assert reply.status_code in (429, 503) and reply.headers["retry-after"] == "3", (reply.status_code, reply.headers)
    reply = client.get("/api/raise", params={"kind": "bug"})
    assert reply.status_code == 500 and reply.json() == {"error": "internal error: KeyError"}


def test_litestar_own_errors_wear_the_protocol_envelope(client) -> None:
    reply = client.get("/api/nowhere")
    assert reply.status_code == 404 and reply.json() == {"error": "no such endpoint: GET /api/nowhere"}
    reply = client.get("/v1/nowhere", headers={"anthropic-version": "2023-06-01"})
    assert reply.status_code == 404 and reply.json()["error"]["type"] == "not_found_error", reply.json()
    reply = client.delete("/v1/raise")
    assert reply.status_code == 405 and "error" in reply.json()
    reply = client.post("/v1/typed", content=b'{"a": "not a number"}', headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error", reply.json()
