"""Keys with scopes, kept hashed; limits per key that cannot be dodged (issue 15, items 4 and 5).

A real gateway with the scripted backend and a bootstrap admin key; keys are made with ``meshgate keys``, the
command line a user runs, and used through the official SDKs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import anthropic
import httpx
import openai
import pytest

from tests.conftest import ROOT, Server

BOOT = "boot-admin-key"


@pytest.fixture(scope="module")
def server(data_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("keys")
    (home / "models").mkdir()
    (home / "models" / "gemma-3-270m-q4_k_m.gguf").symlink_to(data_dir / "models" / "gemma-3-270m-q4_k_m.gguf")
    s = Server(home, "--plugin", "tests.scripted_plugin", "--api-key", BOOT)  # lists gemma3:270m, never loads it
    s.home = home
    yield s
    s.stop()


def keys(server, *args: str, key: str = BOOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MESHGATE_API_KEYS", None)
    return subprocess.run(
        [sys.executable, "-m", "meshgate.gateway.cli", "keys", "--url", server.url, "--api-key", key, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=60,
    )


def make(server, name: str, *args: str) -> str:
    done = keys(server, "create", name, *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def chat(server, key: str, **headers):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, default_headers=headers)
    return client.chat.completions.create(
        model="scripted", max_tokens=8, messages=[{"role": "user", "content": "hello"}]
    )


def test_keys_are_stored_hashed_and_listed_without_secrets(server):
    key = make(server, "alice", "--model", "scripted", "--rpm", "50")
    assert key.startswith("mg_")
    stored = (server.home / "keys.json").read_text()
    assert key not in stored and '"digest"' in stored
    listed = keys(server, "list")
    assert listed.returncode == 0 and "alice" in listed.stdout and key not in listed.stdout
    assert "digest" not in httpx.get(f"{server.url}/keys", headers={"authorization": f"Bearer {BOOT}"}).text
    assert chat(server, key).choices[0].message.content == "Hello, world"


def test_a_keys_model_list_holds_for_show_and_ps(server):
    """Issue 37, 13: ``/api/show`` answered for any model whatever the key's list; ``/api/ps`` listed them all."""
    key = make(server, "grace", "--model", "scripted")
    auth = {"authorization": f"Bearer {key}"}
    assert chat(server, key).choices[0].message.content == "Hello, world"  # scripted is loaded now
    assert httpx.post(f"{server.url}/api/show", json={"model": "scripted"}, headers=auth).status_code == 200
    other = httpx.post(f"{server.url}/api/show", json={"model": "scripted-big"}, headers=auth)
    assert other.status_code == 404 and "not found" in other.json()["error"]
    boot = {"authorization": f"Bearer {BOOT}"}
    assert httpx.post(f"{server.url}/api/show", json={"model": "scripted-big"}, headers=boot).status_code == 200
    chat_big = httpx.post(
        f"{server.url}/api/generate",
        json={"model": "scripted-big", "prompt": "hello", "stream": False},
        headers=boot,
        timeout=60,
    )
    assert chat_big.status_code == 200, chat_big.text
    seen = {m["name"] for m in httpx.get(f"{server.url}/api/ps", headers=auth).json()["models"]}
    everything = {m["name"] for m in httpx.get(f"{server.url}/api/ps", headers=boot).json()["models"]}
    assert seen == {"scripted"} < everything, (seen, everything)


def test_token_counts_are_rate_limited_too(server):
    """Issue 37, 13: ``count_tokens`` runs the model's tokenizer on the runner and was not counted at all."""
    key = make(server, "heidi", "--rpm", "2")
    client = anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)
    count = {"model": "scripted", "messages": [{"role": "user", "content": "hello there"}]}
    assert client.messages.count_tokens(**count).input_tokens > 0
    assert client.messages.count_tokens(**count).input_tokens > 0
    with pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.count_tokens(**count)
    assert "rate limit" in str(refused.value)


def test_without_a_key_only_the_probes_answer(server):
    assert httpx.get(f"{server.url}/api/version").status_code == 200
    assert httpx.get(f"{server.url}/").status_code == 200
    for path in ("/api/tags", "/v1/models", "/schema/openapi.json", "/cluster", "/instances", "/keys", "/events"):
        assert httpx.get(f"{server.url}{path}").status_code == 401, path
    # no 404-versus-401 oracle: whether a model exists is not told to a caller without a key
    for model in ("scripted", "no-such-model"):
        assert httpx.get(f"{server.url}/instances/previews", params={"model": model}).status_code == 401


def test_an_inference_key_cannot_administer(server):
    key = make(server, "bob")
    auth = {"authorization": f"Bearer {key}"}
    assert httpx.get(f"{server.url}/api/tags", headers=auth).status_code == 200
    denied = httpx.get(f"{server.url}/instances", headers=auth)
    assert denied.status_code == 403 and "admin" in denied.json()["error"]["message"]
    for method, path, body in (
        ("DELETE", "/api/delete", {"model": "scripted"}),
        ("POST", "/api/copy", {"source": "scripted", "destination": "mine"}),
        ("POST", "/api/create", {"model": "x", "from": "scripted"}),
        ("POST", "/api/pull", {"model": "scripted"}),
        ("POST", "/keys", {"name": "escalate", "scope": "admin"}),
    ):
        r = httpx.request(method, f"{server.url}{path}", headers=auth, json=body)
        assert r.status_code == 403, (path, r.text)
    assert httpx.delete(f"{server.url}/instances/x", headers=auth).status_code == 403
    with pytest.raises(anthropic.PermissionDeniedError):
        anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0).get("/cluster", cast_to=object)
    admin = make(server, "ops", "--scope", "admin")
    assert httpx.get(f"{server.url}/instances", headers={"x-api-key": admin}).status_code == 200


def test_a_key_sees_and_uses_only_its_models(server):
    key = make(server, "narrow", "--model", "gemma3:270m")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    assert [m.id for m in client.models.list()] == ["gemma3:270m"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="scripted", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    r = httpx.post(
        f"{server.url}/api/generate",
        headers={"authorization": f"Bearer {key}"},
        json={"model": "scripted", "prompt": "hi", "stream": False},
    )
    assert r.status_code == 404 and "scripted" in r.json()["error"]


def test_rate_limits_count_every_generation_endpoint_per_validated_key(server):
    key = make(server, "carol", "--rpm", "4")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    chat(server, key)
    client.responses.create(model="scripted", input="hello", max_output_tokens=8)  # /v1/responses counts too
    # a made-up Authorization next to the valid x-api-key does not open a fresh bucket
    for n in range(2):
        r = httpx.post(
            f"{server.url}/v1/messages",
            headers={"x-api-key": key, "authorization": f"Basic random{n}", "anthropic-version": "2023-06-01"},
            json={"model": "scripted", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200, r.text
    with pytest.raises(openai.RateLimitError) as exc:
        client.responses.create(model="scripted", input="hello", max_output_tokens=8)
    assert 1 <= int(exc.value.response.headers["retry-after"]) <= 60
    assert chat(server, make(server, "dave")).choices[0].message.content == "Hello, world", "another key is apart"


def test_a_token_budget_is_spent_by_usage(server):
    key = make(server, "erin", "--tpm", "5")
    chat(server, key)  # the first fits the empty budget; its prompt and output spend more than 5 tokens
    for _ in range(20):  # the usage is counted in the background as the answer ends
        try:
            chat(server, key)
        except openai.RateLimitError as exc:
            assert "token limit" in exc.message
            break
    else:
        pytest.fail("the token budget was never reached")


def test_revoked_keys_stop_at_once_and_bad_keys_never_work(server):
    key = make(server, "frank")
    key_id = next(
        k["id"]
        for k in json.loads(httpx.get(f"{server.url}/keys", headers={"authorization": f"Bearer {BOOT}"}).text)["keys"]
        if k["name"] == "frank"
    )
    assert chat(server, key)
    assert keys(server, "revoke", key_id).returncode == 0
    with pytest.raises(openai.AuthenticationError):
        chat(server, key)
    for wrong in (key[:-1] + ("A" if key[-1] != "A" else "B"), "mg_" + key_id + "_x", BOOT + "x", "mg__"):
        r = httpx.get(f"{server.url}/v1/models", headers={"authorization": f"Bearer {wrong}"})
        assert r.status_code == 401, wrong
    assert keys(server, "list", key="wrong").returncode == 1
