"""``GET /metrics`` on a real gateway (issue 17, part 1): the official clients of each protocol drive the real
model, then the exposition is parsed with ``prometheus_client``'s own parser and its counts are checked against
what the clients were told; with keys, ``/metrics`` needs an admin key."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MODEL, Server

BOOT = "boot-admin-key"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, **headers: str) -> Samples:
    answer = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def test_requests_of_every_protocol_are_counted_with_their_tokens(real_server, oai, ant, oll):
    chat = [{"role": "user", "content": "Say hi."}]
    before = scrape(real_server.url)
    plain = oai.chat.completions.create(model=MODEL, max_tokens=4, messages=chat, temperature=0)
    streamed = list(
        oai.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=chat,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    message = ant.messages.create(model=MODEL, max_tokens=4, messages=chat, extra_body={"temperature": 0})
    ollama_chat = oll.chat(model=MODEL, messages=chat, options={"num_predict": 4, "temperature": 0})
    unknown = httpx.post(
        f"{real_server.url}/api/chat", json={"model": "no-such-model", "messages": chat, "stream": False}, timeout=30
    )
    assert unknown.status_code == 404
    after = scrape(real_server.url)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    ok = {"model": MODEL, "status": "200"}
    assert delta("meshgate_requests_total", protocol="openai", endpoint="/v1/chat/completions", **ok) == 2
    assert delta("meshgate_requests_total", protocol="anthropic", endpoint="/v1/messages", **ok) == 1
    assert delta("meshgate_requests_total", protocol="ollama", endpoint="/api/chat", **ok) == 1
    assert delta("meshgate_requests_total", protocol="ollama", model="other", status="404") == 1
    assert delta("meshgate_request_duration_seconds_count", protocol="openai", model=MODEL) == 2
    assert delta("meshgate_time_to_first_token_seconds_count", protocol="openai", model=MODEL) == 2
    assert delta("meshgate_time_to_first_token_seconds_count", protocol="anthropic", model=MODEL) == 1
    assert delta("meshgate_time_to_first_token_seconds_count", protocol="ollama", model=MODEL) == 1
    assert delta("meshgate_instance_requests_total", model=MODEL) == 4

    usage = streamed[-1].usage
    assert plain.usage is not None and usage is not None
    generated = (
        plain.usage.completion_tokens + usage.completion_tokens + message.usage.output_tokens + ollama_chat.eval_count
    )
    prompt = plain.usage.prompt_tokens + usage.prompt_tokens + ollama_chat.prompt_eval_count
    prompt += message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert delta("meshgate_generated_tokens_total", model=MODEL) == generated > 0
    assert delta("meshgate_prompt_tokens_total", model=MODEL) == prompt > 0
    gaps = generated - 4  # each of the four streams: its tokens less one
    assert delta("meshgate_inter_token_latency_seconds_count", model=MODEL) == gaps

    instances = [dict(ls) for (n, ls), v in after.items() if n == "meshgate_instance_info" and v == 1]
    mine = [i for i in instances if i["model"] == MODEL and i["state"] == "ready"]
    assert mine and mine[0]["backend"] and mine[0]["strategy"]
    assert total(after, "meshgate_instances", state="ready") >= 1
    assert total(after, "meshgate_active_sequences", instance=mine[0]["instance"]) == 0
    assert total(after, "meshgate_node_memory_bytes", kind="used") > 0
    assert total(after, "meshgate_node_cores") >= 1


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    home = tmp_path_factory.mktemp("metrics-keys")
    server = Server(home, "--plugin", "tests.scripted_plugin", "--api-key", BOOT)
    yield server
    server.stop()


def test_with_keys_metrics_needs_an_admin_key(keyed):
    admin = {"authorization": f"Bearer {BOOT}"}
    made = httpx.post(f"{keyed.url}/keys", json={"name": "app", "scope": "inference"}, headers=admin, timeout=30)
    assert made.status_code == 201, made.text
    inference = made.json()["key"]
    assert httpx.get(f"{keyed.url}/metrics", timeout=30).status_code == 401
    refused = httpx.get(f"{keyed.url}/metrics", headers={"authorization": f"Bearer {inference}"}, timeout=30)
    assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
    served = scrape(keyed.url, **admin)
    assert total(served, "meshgate_requests_total", endpoint="/metrics", status="401") == 1
    assert total(served, "meshgate_requests_total", endpoint="/metrics", status="403") == 1


def test_a_dead_runner_counts_as_a_replacement_and_a_restart(data_dir):
    server = Server(data_dir, "--n-ctx", "2048")
    try:
        deadline = time.monotonic() + 120
        while not server.children() and time.monotonic() < deadline:  # load it (a loaded machine may refuse once)
            body = {"model": MODEL, "prompt": "", "stream": False}
            httpx.post(f"{server.url}/api/generate", json=body, timeout=120)
            time.sleep(0.2)
        pid = server.children()[0]
        assert total(scrape(server.url), "meshgate_replacements_total", model=MODEL) == 0
        os.kill(pid, signal.SIGKILL)
        reply = httpx.post(f"{server.url}/api/embed", json={"model": MODEL, "input": "a cat"}, timeout=120)
        assert reply.status_code == 200, reply.text
        after = scrape(server.url)
    finally:
        server.stop()
    assert total(after, "meshgate_replacements_total", model=MODEL) >= 1
    assert total(after, "meshgate_runner_restarts_total", model=MODEL) >= 1
