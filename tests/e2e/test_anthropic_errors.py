"""Anthropic's error envelope and types for each status (ANT-42..49), from a real server, through the SDK."""

from __future__ import annotations

import anthropic
import pytest

from tests.conftest import Server


@pytest.fixture(scope="module")
def server(data_dir):
    s = Server(
        data_dir,
        "--plugin",
        "tests.scripted_plugin",
        env={"MESHGATE_DISABLED_PLUGINS": "llama_cpp", "MESHGATE_MAX_BODY_BYTES": "4096"},
    )
    yield s
    s.stop()


def ask(server, text: str, key: str = "k", **extra):
    client = anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)
    return client.messages.create(
        model="scripted", max_tokens=16, messages=[{"role": "user", "content": text}], **extra
    )


@pytest.mark.parametrize(
    ("text", "error", "status", "kind"),
    [
        ("unprocessable", anthropic.UnprocessableEntityError, 422, "invalid_request_error"),
        ("crash", anthropic.InternalServerError, 500, "api_error"),
        ("failfirst", anthropic.APIStatusError, 529, "overloaded_error"),
        ("x" * 10_000, anthropic.APIStatusError, 413, "request_too_large"),
    ],
)
def test_ant_45_46_status_and_type(server, text, error, status, kind):
    with pytest.raises(error) as exc:
        ask(server, text)
    assert exc.value.status_code == status
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == kind
    assert exc.value.request_id and exc.value.request_id.startswith("req_"), "ANT-47: request-id header"


def test_ant_45_429_rate_limit_error(data_dir):
    limited = Server(
        data_dir,
        "--plugin",
        "tests.scripted_plugin",
        env={"MESHGATE_DISABLED_PLUGINS": "llama_cpp", "MESHGATE_RATE_LIMIT": "5"},
    )
    try:
        with pytest.raises(anthropic.RateLimitError) as exc:
            for _ in range(6):
                ask(limited, "hello", key="limited")
        assert exc.value.body["error"]["type"] == "rate_limit_error"
        assert int(exc.value.response.headers["retry-after"]) >= 1
    finally:
        limited.stop()


def test_ant_42_error_event_mid_stream(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="other", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as exc:
        with client.messages.stream(
            model="scripted", max_tokens=16, messages=[{"role": "user", "content": "fail"}]
        ) as stream:
            list(stream)
    assert exc.value.status_code == 200 and exc.value.body["error"]["type"] == "overloaded_error"
