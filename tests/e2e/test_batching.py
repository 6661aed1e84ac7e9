"""Continuous batching through a real gateway and the real Gemma 3 270M: eight streams at once, from the three
official SDKs, each get the text they get alone (greedy), in batched steps; a cancelled stream frees its slot.

The gateway runs its runner with eight slots (``MESHGATE_PARALLEL=8``), so all eight requests share decode
steps; the runner's ``/health`` shows how many sequences one step carried.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.conftest import MODEL, Server

TOKENS = 12  # enough for eight distinct texts and a dozen shared decode steps
TOPICS = ["the sea", "a mountain", "bread", "the moon", "a violin", "winter", "a red bicycle", "the library"]


SECRET = {"MESHGATE_CLUSTER_SECRET": "batching-test-secret"}  # so these tests may read the runners' /health


@pytest.fixture(scope="module")
def server(data_dir):
    s = Server(data_dir, "--n-ctx", "1024", env={"MESHGATE_PARALLEL": "8", **SECRET})
    yield s
    s.stop()


def _openai(server: Server, topic: str) -> str:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL,
        stream=True,
        max_tokens=TOKENS,
        temperature=0,
        messages=[{"role": "user", "content": f"Write about {topic}."}],
    )
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish in ("stop", "length")
    return "".join(parts)


def _anthropic(server: Server, topic: str) -> str:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with client.messages.stream(
        model=MODEL,
        max_tokens=TOKENS,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": f"Write about {topic}."}],
    ) as stream:
        text = "".join(stream.text_stream)
        assert stream.get_final_message().stop_reason in ("end_turn", "max_tokens")
    return text


def _ollama(server: Server, topic: str) -> str:
    client = ollama.Client(host=server.url)
    parts, done = [], False
    for part in client.chat(
        model=MODEL,
        stream=True,
        options={"num_predict": TOKENS, "temperature": 0},
        messages=[{"role": "user", "content": f"Write about {topic}."}],
    ):
        parts.append(part.message.content)
        done = done or part.done
    assert done
    return "".join(parts)


CLIENTS = [_openai, _anthropic, _ollama]


def _runner_health(server: Server) -> dict:
    instance = next(i for i in httpx.get(f"{server.url}/instances").json() if i["model"] == MODEL)
    url = next(r["url"] for r in instance["runners"].values() if r.get("url"))
    return httpx.get(f"{url}/health", headers={"x-meshgate-secret": SECRET["MESHGATE_CLUSTER_SECRET"]}).json()


def test_eight_concurrent_streams_get_their_own_text(server):
    calls = [(CLIENTS[i % 3], topic) for i, topic in enumerate(TOPICS)]
    alone = [call(server, topic) for call, topic in calls]
    assert len(set(alone)) == len(alone), "the prompts should give distinct texts"
    widest = _runner_health(server)["widest_batch"]
    assert widest == 1, "one request at a time never shares a step"

    start = threading.Barrier(len(calls))

    def run(call_topic):
        call, topic = call_topic
        start.wait()
        return call(server, topic)

    with ThreadPoolExecutor(len(calls)) as pool:
        together = list(pool.map(run, calls))
    assert together == alone  # greedy text does not depend on load; no stream got another's tokens
    health = _runner_health(server)
    assert health["decode_group"] == 8  # all eight decode in one call, on ggml's reference matmuls
    assert health["widest_batch"] >= 4  # and they really shared decode steps


def test_a_cancelled_stream_frees_its_slot(data_dir):
    s = Server(data_dir, "--n-ctx", "1024", env={"MESHGATE_PARALLEL": "2", "MESHGATE_MAX_QUEUE": "4", **SECRET})
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        long = {
            "model": MODEL,
            "stream": True,
            "max_tokens": 800,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Count from one to one thousand."}],
        }
        streams = [client.chat.completions.create(**long) for _ in range(2)]
        for stream in streams:
            next(iter(stream))  # both are generating: both slots are taken
        assert _runner_health(s)["active_sequences"] == 2
        streams[0].close()
        deadline = time.monotonic() + 10
        while _runner_health(s)["active_sequences"] != 1:
            assert time.monotonic() < deadline, "the cancelled stream kept its slot"
            time.sleep(0.05)
        began = time.monotonic()
        short = client.chat.completions.create(
            model=MODEL, max_tokens=4, temperature=0, messages=[{"role": "user", "content": "Hi"}]
        )
        assert short.choices[0].finish_reason in ("stop", "length")
        assert time.monotonic() - began < 20
        assert _runner_health(s)["active_sequences"] == 1  # the other long stream is still going
        streams[1].close()
    finally:
        s.stop()


def test_a_follow_up_turn_reuses_the_cached_history(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    history = [
        {"role": "system", "content": "You are a careful assistant. " * 40},
        {"role": "user", "content": "Name a colour."},
    ]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    before = _runner_health(server)["reused_tokens"]
    history += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And another one?"},
    ]
    client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    reused = _runner_health(server)["reused_tokens"] - before
    assert reused >= first.usage.prompt_tokens - 1  # the whole first prompt came from the slot's cache


def test_a_long_prefill_sends_keep_alives(real_server):
    """A prompt that takes the runner seconds to prefill keeps its stream alive: a ``ping`` every 2 s (the
    keep-alive setting) until the first token, where it used to stay silent (Claude Code gives up on a stream
    silent for 300 s, proxies often after 60 s)."""
    prompt = "A slow river bends past seven old mills at dawn. " * 140  # ~1,550 tokens, not cached by other tests
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "temperature": 0,  # greedy: a sampled first token may end the turn, and no content block would come
        "stream": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    pings, started, first = 0, None, None
    with httpx.stream("POST", f"{real_server.url}/v1/messages", json=body, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "event: message_start":
                started = time.monotonic()
            elif line == "event: ping" and first is None:
                pings += 1
            elif line.startswith("event: content_block") and first is None:
                first = time.monotonic()
    assert started is not None and first is not None
    silent = first - started
    print(f"\nprefill of ~1,550 tokens: {silent:.1f} s silent, {pings} pings")
    assert pings >= int(silent // 2) - 1, f"{pings} pings in {silent:.1f} s of prefill"
    assert silent < 3 or pings >= 1, f"no ping in {silent:.1f} s of prefill"
