"""The bounded, fair queue and the context checks through a real gateway, with the scripted backend.

The gateway runs one request at a time per instance (``MESHGATE_PARALLEL=1``) and lets six wait
(``MESHGATE_MAX_QUEUE=6``); ``sleep <s>`` holds the slot that long. The scripted model's context is 1,024 tokens
and it counts one token per word, so a 2,000-word prompt cannot fit, and a 200 would echo it back: a refusal
shows the request never reached generation.
"""

from __future__ import annotations

import asyncio
import json
import time

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.conftest import Server

MAX_QUEUE = 6
ANTHROPIC = {"anthropic-version": "2023-06-01"}


@pytest.fixture(scope="module")
def server(data_dir):
    s = Server(
        data_dir,
        "--plugin",
        "tests.scripted_plugin",
        env={"MESHGATE_PARALLEL": "1", "MESHGATE_MAX_QUEUE": str(MAX_QUEUE), "MESHGATE_KEEPALIVE": "0.2"},
    )
    r = httpx.post(f"{s.url}/v1/chat/completions", json=_chat("hello"), timeout=30)
    assert r.status_code == 200, r.text
    yield s
    s.stop()


def _chat(text: str, **extra) -> dict:
    return {"model": "scripted", "messages": [{"role": "user", "content": text}], **extra}


ADMIN = {"authorization": "Bearer A"}  # ignored by the keyless gateway; an admin key of ``keyed``


def _instance(server) -> str:
    return next(i["id"] for i in httpx.get(f"{server.url}/instances", headers=ADMIN).json() if i["model"] == "scripted")


def _queue(server) -> dict:
    return httpx.get(f"{server.url}/instances/{_instance(server)}", headers=ADMIN).json()["queue"]


async def _until(server, **expected) -> dict:
    """Poll the instance's queue until it shows ``expected`` (5 s at most)."""
    deadline = time.monotonic() + 5
    while True:
        queue = await asyncio.to_thread(_queue, server)
        if all(queue[k] == v for k, v in expected.items()) or time.monotonic() > deadline:
            return queue
        await asyncio.sleep(0.05)


async def test_overflow_is_refused_at_once_in_each_protocol(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        # the slot is held 5 s: the queue stays full while four refusals are asked, however busy the box is
        running = asyncio.create_task(http.post("/v1/chat/completions", json=_chat("sleep 5")))
        await _until(server, active=1)
        waiting = [
            asyncio.create_task(http.post("/v1/chat/completions", json=_chat("hello"))) for _ in range(MAX_QUEUE)
        ]
        queue = await _until(server, queued=MAX_QUEUE)
        assert queue == {
            "active": 1,
            "queued": MAX_QUEUE,
            "parallel": 1,
            "max_queue": MAX_QUEUE,
            "batch_active": 0,  # the batch class's own (none here: every request is interactive)
            "batch_queued": 0,
        }
        listed = next(i for i in (await http.get("/instances")).json() if i["model"] == "scripted")
        assert listed["queue"]["queued"] == MAX_QUEUE, "the instances list shows the queue too"

        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as oai:
            await openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="k", max_retries=0).chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": "hello"}]
            )
        assert oai.value.status_code == 429 and int(oai.value.response.headers["retry-after"]) >= 1
        assert oai.value.body["code"] == "overloaded" and oai.value.body["message"]

        with pytest.raises(anthropic.OverloadedError) as ant:
            await anthropic.AsyncAnthropic(base_url=server.url, api_key="k", max_retries=0).messages.create(
                model="scripted", max_tokens=10, messages=[{"role": "user", "content": "hello"}]
            )
        assert ant.value.status_code == 529 and ant.value.body["error"]["type"] == "overloaded_error"
        assert int(ant.value.response.headers["retry-after"]) >= 1

        with pytest.raises(ollama.ResponseError) as oll:
            await ollama.AsyncClient(host=server.url).chat(
                model="scripted", messages=[{"role": "user", "content": "hello"}]
            )
        assert oll.value.status_code == 503
        assert oll.value.error == "server busy, please try again.  maximum pending requests exceeded"
        raw = await http.post("/api/generate", json={"model": "scripted", "prompt": "hello", "stream": True})
        assert raw.status_code == 503 and int(raw.headers["retry-after"]) >= 1, "streaming too: a status, at once"
        assert raw.json() == {"error": "server busy, please try again.  maximum pending requests exceeded"}
        assert time.monotonic() - started < 2, "refused at once, not after waiting"

        assert (await running).status_code == 200
        replies = await asyncio.gather(*waiting)
        assert [r.status_code for r in replies] == [200] * MAX_QUEUE, "the queued ones were all served"
        assert (await _until(server, queued=0, active=0)) == {
            "active": 0,
            "queued": 0,
            "parallel": 1,
            "max_queue": MAX_QUEUE,
            "batch_active": 0,
            "batch_queued": 0,
        }


@pytest.fixture
def keyed(data_dir):
    """The same gateway with two keys, A and B (callers are told apart by their validated key)."""
    s = Server(
        data_dir,
        "--plugin",
        "tests.scripted_plugin",
        "--api-key",
        "A",
        "--api-key",
        "B",
        env={"MESHGATE_PARALLEL": "1", "MESHGATE_MAX_QUEUE": str(MAX_QUEUE), "MESHGATE_KEEPALIVE": "0.2"},
    )
    r = httpx.post(
        f"{s.url}/v1/chat/completions", json=_chat("hello"), headers={"authorization": "Bearer A"}, timeout=30
    )
    assert r.status_code == 200, r.text
    yield s
    s.stop()


async def test_round_robin_across_api_keys(keyed):
    """Key A queues five requests, then key B one: B is served after one of A's queued ones, not after all."""
    server = keyed
    done: list[str] = []

    async def ask(http: httpx.AsyncClient, key: str, name: str, text: str = "sleep 0.2") -> None:
        r = await http.post("/v1/chat/completions", json=_chat(text), headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        done.append(name)

    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        tasks = [asyncio.create_task(ask(http, "A", "a-running", "sleep 1"))]
        await _until(server, active=1)
        tasks += [asyncio.create_task(ask(http, "A", f"a{n}")) for n in range(5)]
        await _until(server, queued=5)
        tasks.append(asyncio.create_task(ask(http, "B", "b")))
        await _until(server, queued=6)
        await asyncio.gather(*tasks)
    assert done[0] == "a-running"
    assert done.index("b") == 2, f"B went second in the queue, after one of A's: {done}"


async def test_costly_counts_take_turns_across_api_keys(keyed):
    """Key A sends five prompts too long for the context whose counting costs the runner a second each; key B
    then one short request with a tool (always counted). B is counted after at most one of A's, not after all
    five, and A's prompts are still refused as too long."""
    done: list[str] = []
    huge = " ".join(["slowcount"] + ["word"] * 2000)
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}

    async def ask(http: httpx.AsyncClient, key: str, name: str, body: dict, status: int) -> None:
        r = await http.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})
        assert r.status_code == status, r.text
        done.append(name)

    async with httpx.AsyncClient(base_url=keyed.url, timeout=30) as http:
        tasks = [asyncio.create_task(ask(http, "A", f"a{n}", _chat(huge), 400)) for n in range(5)]
        await asyncio.sleep(0.3)  # A's counts have begun
        tasks.append(asyncio.create_task(ask(http, "B", "b", _chat("hello", tools=[tool]), 200)))
        await asyncio.gather(*tasks)
    assert done.index("b") <= 2, f"B waited for more than two of A's counts: {done}"


async def test_a_streaming_client_that_leaves_while_queued_leaves_the_queue(server):
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        running = asyncio.create_task(http.post("/v1/chat/completions", json=_chat("sleep 3")))
        await _until(server, active=1)
        async with http.stream("POST", "/v1/chat/completions", json=_chat("hello", stream=True)) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            keepalive = await asyncio.wait_for(anext(lines), 2)
            assert keepalive.startswith(":"), "a waiting stream gets SSE comments, not content"
            assert (await _until(server, queued=1))["queued"] == 1
        queue = await _until(server, queued=0)
        assert queue["queued"] == 0 and not running.done(), "it left the queue while the first still runs"
        assert (await running).status_code == 200


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", _chat("hello")),
        ("/v1/messages", {"model": "scripted", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}),
        ("/api/generate", {"model": "scripted", "prompt": "hello", "stream": False}),
    ],
)
async def test_a_non_streaming_client_that_leaves_while_queued_leaves_the_queue(server, path, body):
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        running = asyncio.create_task(http.post("/v1/chat/completions", json=_chat("sleep 3")))
        await _until(server, active=1)
        waiting = asyncio.create_task(http.post(path, json=body, headers=ANTHROPIC))
        assert (await _until(server, queued=1))["queued"] == 1
        waiting.cancel()  # the client gives up: its connection closes
        with pytest.raises(asyncio.CancelledError):
            await waiting
        queue = await _until(server, queued=0)
        assert queue["queued"] == 0 and not running.done(), "it left the queue while the first still runs"
        assert (await running).status_code == 200


def test_context_refused_per_protocol_before_generation(server):
    """2,000 words against a 1,024-token context: each protocol's own refusal, never an echo."""
    long = " ".join(["w"] * 2000)
    r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat(long))
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert error["message"] == (
        "This model's maximum context length is 1024 tokens. However, your messages "
        "resulted in 2000 tokens. Please reduce the length of the messages."
    )

    r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat("a few words", max_tokens=1022))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "This model's maximum context length is 1024 tokens. However, you requested 1025 tokens (3 in the messages, "
        "1022 in the completion). Please reduce the length of the messages or completion."
    )
    r = httpx.post(f"{server.url}/v1/chat/completions", json=_chat("a few words", max_tokens=1021))
    assert r.status_code == 200, "3 + 1021 tokens fit exactly"

    r = httpx.post(f"{server.url}/v1/messages", headers=ANTHROPIC, json=_chat(long, max_tokens=32000))
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "prompt is too long: 2000 tokens > 1023 maximum"},
    }
    r = httpx.post(f"{server.url}/v1/messages", headers=ANTHROPIC, json=_chat("hello", max_tokens=32000))
    assert r.status_code == 200, "Anthropic: only the prompt is checked; the output is capped by the room left"

    r = httpx.post(f"{server.url}/api/generate", json={"model": "scripted", "prompt": long, "stream": False})
    assert (r.status_code, r.json()) == (400, {"error": "the input length exceeds the context length"})


def test_ollama_chat_drops_the_oldest_turns_unless_told_not_to(server):
    history = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": " ".join(["u"] * 600)},
        {"role": "assistant", "content": " ".join(["a"] * 600)},
        {"role": "user", "content": "how long"},
    ]
    reply = ollama.Client(host=server.url).chat(model="scripted", messages=history)
    assert reply.message.content == "3 messages, 604 words", "system, the assistant turn and the question remain"

    r = httpx.post(
        f"{server.url}/api/chat", json={"model": "scripted", "messages": history, "stream": False, "truncate": False}
    )
    assert (r.status_code, r.json()) == (400, {"error": "the input length exceeds the context length"})
    alone = [{"role": "user", "content": " ".join(["w"] * 2000)}]
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=server.url).chat(model="scripted", messages=alone)
    assert refused.value.status_code == 400


async def test_an_ollama_stream_waiting_for_a_slot_gets_bytes_and_parses(server):
    """Issue 37, 13: a streamed Ollama request that waits in the queue sent nothing at all until its turn (an idle
    proxy drops it). It now gets a space per keep-alive (never a blank line, OLL-30), and ollama-python, which
    ``json.loads`` every line, reads the whole answer."""
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        running = asyncio.create_task(http.post("/v1/chat/completions", json=_chat("sleep 2")))
        await _until(server, active=1)
        body = {"model": "scripted", "messages": [{"role": "user", "content": "hello"}], "stream": True}
        async with http.stream("POST", "/api/chat", json=body) as waiting:
            assert waiting.status_code == 200
            chunks = waiting.aiter_raw()
            first = await asyncio.wait_for(anext(chunks), 1.5)  # keep-alives every 0.2 s, the slot free in 2 s
            assert first.strip() == b"" and b"\n" not in first and first, first
            rest = b"".join([chunk async for chunk in chunks])
        lines = (first + rest).splitlines()
        assert all(line.strip() for line in lines) and json.loads(lines[-1])["done"] is True
        assert (await running).status_code == 200
        await _until(server, active=0)
        running = asyncio.create_task(http.post("/v1/chat/completions", json=_chat("sleep 1")))
        await _until(server, active=1)
        parts = [
            part["message"]["content"]
            async for part in await ollama.AsyncClient(host=server.url).chat(
                model="scripted", messages=[{"role": "user", "content": "hello"}], stream=True
            )
        ]
        assert "".join(parts) == "Hello, world"
        assert (await running).status_code == 200
