"""OpenAI's error envelope for every status the SDK maps (OAI-57..64), from a real server."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import Server


@pytest.fixture(scope="module")
def server(data_dir):
    s = Server(
        data_dir,
        "--plugin",
        "tests.scripted_plugin",
        "--api-key",
        "sesame",
        env={"MESHGATE_MAX_BODY_BYTES": "4096", "MESHGATE_DISABLED_PLUGINS": "llama_cpp"},
    )
    yield s
    s.stop()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)


def chat(client, text: str, **extra):
    return client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": text}], **extra)


def test_oai_57_58_envelope_and_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="scripted", messages=[], extra_body={"n": 2})
    body = exc.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"


def test_oai_59_401_without_the_key(server):
    with pytest.raises(openai.AuthenticationError) as exc:
        chat(openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0), "hello")
    assert exc.value.body["type"] == "authentication_error" and "API key" in exc.value.body["message"]


def test_oai_59_404_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert exc.value.status_code == 404
    assert exc.value.body == {
        "message": "The model `nope` does not exist or you do not have access to it.",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }


def test_oai_59_413_body_too_large(client):
    with pytest.raises(openai.APIStatusError) as exc:
        chat(client, "x" * 10_000)
    assert exc.value.status_code == 413 and "larger than 4,096 bytes" in exc.value.body["message"]


def test_oai_59_422_unprocessable(client):
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        chat(client, "unprocessable")
    assert exc.value.body["message"] == "this schema cannot be enforced"


def test_oai_59_500_internal_error(client):
    with pytest.raises(openai.InternalServerError) as exc:
        chat(client, "crash")
    assert exc.value.status_code == 500 and exc.value.body["type"] == "api_error"


def test_oai_59_503_no_capacity(client):
    with pytest.raises(openai.InternalServerError) as exc:
        chat(client, "failfirst")
    assert exc.value.status_code == 503 and "no node has room" in exc.value.body["message"]


def test_oai_62_mid_stream_error_frame(client):
    with pytest.raises(openai.APIError) as exc:
        list(chat(client, "fail", stream=True))
    assert exc.value.message == "runner lost"


def test_oai_64_request_id(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("nope")
    assert exc.value.request_id and exc.value.request_id.startswith("req_")
    assert chat(client, "hello")._request_id.startswith("req_")


def test_oai_59_61_429_rate_limit_with_retry_after(data_dir):
    s = Server(
        data_dir,
        "--plugin",
        "tests.scripted_plugin",
        env={"MESHGATE_RATE_LIMIT": "3", "MESHGATE_DISABLED_PLUGINS": "llama_cpp"},
    )
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="k1", max_retries=0)
        with pytest.raises(openai.RateLimitError) as exc:
            for _ in range(4):  # 3 in any 60 s (a sliding window): the 4th is refused
                chat(client, "hello")
        assert 1 <= int(exc.value.response.headers["retry-after"]) <= 60
        assert exc.value.body["type"] == "rate_limit_error"
        other = openai.OpenAI(base_url=f"{s.url}/v1", api_key="k2", max_retries=0)
        with pytest.raises(openai.RateLimitError):  # no keys configured: counted by address, whatever is sent
            chat(other, "hello")
        assert httpx.get(f"{s.url}/v1/models", headers={"authorization": "Bearer k1"}).status_code == 200
    finally:
        s.stop()
