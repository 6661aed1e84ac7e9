"""Configuration reaching a real server: extra GGUF paths by name, and API keys."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.conftest import Server


@pytest.fixture(scope="module")
def server(data_dir, packaged_gguf):
    s = Server(data_dir, "--model", f"mygemma:q4={packaged_gguf}", "--api-key", "sesame", "--n-ctx", "512")
    yield s
    s.stop()


def test_configured_gguf_is_listed_and_served(server):
    assert httpx.get(f"{server.url}/api/tags").status_code == 401, "keys are set: listings need one too"
    tags = httpx.get(f"{server.url}/api/tags", headers={"authorization": "Bearer sesame"}).json()["models"]
    mine = next(m for m in tags if m["name"] == "mygemma:q4")
    assert mine["details"]["family"] == "gemma3" and mine["details"]["quantization_level"] == "Q4_K_M"
    assert len(mine["digest"]) == 64
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sesame", max_retries=0)
    reply = client.completions.create(model="mygemma:q4", prompt="The sky is", max_tokens=4)
    assert reply.choices[0].text and reply.usage.completion_tokens == 4


def test_api_keys_are_enforced_per_protocol(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError) as exc:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="mygemma:q4", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert exc.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server.url}/api/generate", json={"model": "mygemma:q4", "prompt": "hi"})
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    ok = httpx.post(
        f"{server.url}/v1/messages",
        headers={"x-api-key": "sesame", "anthropic-version": "2023-06-01"},
        json={"model": "mygemma:q4", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] <= 2
