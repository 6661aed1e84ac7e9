"""Hold under hostile clients: a bounded load-and-abuse run against a real gateway and the real model.

200 concurrent clients (one ``httpx.AsyncClient`` each, so 200 connections) share a fixed, shuffled list of 652
requests across the three protocols:

* 150 valid small ones (OpenAI chat and completions, Anthropic messages, Ollama generate and chat; streaming and
  not; 2 or 3 output tokens so the two-core test box finishes),
* 462 invalid ones (malformed JSON, wrong types, an unknown model, absurd ``max_tokens``, bad roles, JSON nested
  990 deep, and 12 prompts of ~1 MB against a 1,024-token context),
* 40 streams the client abandons after the first chunk (the connection closes mid-stream).

The gateway lets ``MESHGATE_MAX_QUEUE`` (64) requests wait and refuses the rest at once as overloaded (429, 529
or 503 in each protocol's words, with ``retry-after``); a client honours that and tries again until a deadline, so
every valid request must end in a 200 with a well-formed answer. Every invalid one must end in its exact 4xx in
its protocol's error envelope, never a 5xx; overload answers are counted apart. Afterwards the runner is the same
process, alive; the gateway is alive with an empty queue; and its resident memory is back within 10% of what it
was after warm-up (one request of each kind, one after another). The figures print on one line (``pytest -s``).

The clients drop idle connections after 3 s: uvicorn closes them after 5 s and httpx would reuse one for 5 s, so
a retry ~5 s after an answer races the close and fails as ``ReadError('')`` before the gateway sees it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL, Server

CLIENTS = 200
COUNTS = {"valid": 15, "invalid": 25, "abandon": 10}  # of each kind below: 150 valid, 450 invalid, 40 abandoned
HUGE = 4  # of each ~1 MB prompt (each costs the runner ~2 s of tokenizing): 12 more invalid
RETRY_DEADLINE = 420  # seconds from the start of the load: a request still refused as overloaded then fails
CLIENT_KEEPALIVE = 3.0  # seconds; below uvicorn's 5 s keep-alive timeout (see above)
MEMORY_SLACK = 0.10
ANTHROPIC_HEADERS = {"anthropic-version": "2023-06-01"}
Check = Callable[[httpx.Response], None]


@pytest.fixture(scope="module")
def server(data_dir: Path) -> Iterator[Server]:
    s = Server(data_dir, "--n-ctx", "1024")
    yield s
    s.stop()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


# ------------------------------------------------------------------------------------- answers, per protocol


def sse_data(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def check_openai_chat(r: httpx.Response) -> None:
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length") and body["usage"]["completion_tokens"] <= 4


def check_openai_chat_stream(r: httpx.Response) -> None:
    data = sse_data(r.text)
    assert data and data[-1] == "[DONE]", r.text[-300:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks and all(c.get("object") == "chat.completion.chunk" and "error" not in c for c in chunks)
    assert any(choice.get("finish_reason") in ("stop", "length") for c in chunks for choice in c["choices"])


def check_openai_completion(r: httpx.Response) -> None:
    body = r.json()
    assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def check_openai_completion_stream(r: httpx.Response) -> None:
    data = sse_data(r.text)
    assert data and data[-1] == "[DONE]", r.text[-300:]
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks and all(c.get("object") == "text_completion" and "error" not in c for c in chunks)
    assert any(choice.get("finish_reason") in ("stop", "length") for c in chunks for choice in c["choices"])


def check_anthropic(r: httpx.Response) -> None:
    body = r.json()
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["content"] == [] or body["content"][0]["type"] == "text"
    assert body["stop_reason"] in ("end_turn", "max_tokens") and body["usage"]["output_tokens"] <= 3


def check_anthropic_stream(r: httpx.Response) -> None:
    events = [json.loads(d) for d in sse_data(r.text)]
    kinds = [e["type"] for e in events]
    assert kinds and kinds[0] == "message_start" and kinds[-1] == "message_stop", kinds
    assert "error" not in kinds and "message_delta" in kinds


def check_ollama_generate(r: httpx.Response) -> None:
    body = r.json()
    assert body["done"] is True and isinstance(body["response"], str) and body["model"] == MODEL
    assert body["done_reason"] in ("stop", "length")


def check_ollama_stream(r: httpx.Response) -> None:
    lines = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert lines and lines[-1]["done"] is True, r.text[-300:]
    assert all("error" not in line for line in lines)


def check_ollama_chat(r: httpx.Response) -> None:
    body = r.json()
    assert body["done"] is True and body["message"]["role"] == "assistant"
    assert isinstance(body["message"]["content"], str)


def error_shape(protocol: str, r: httpx.Response) -> None:
    """The protocol's own error envelope."""
    body = r.json()
    if protocol == "openai":
        assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), body
    elif protocol == "anthropic":
        assert body["type"] == "error" and isinstance(body["error"]["type"], str), body
        assert isinstance(body["error"]["message"], str), body
    else:
        assert isinstance(body["error"], str), body


def overloaded(protocol: str, r: httpx.Response) -> bool:
    """A full queue, in the protocol's words, with ``retry-after``."""
    if "retry-after" not in r.headers:
        return False
    try:
        body = r.json()
    except ValueError:
        return False
    if protocol == "openai":
        return r.status_code == 429 and body.get("error", {}).get("code") == "overloaded"
    if protocol == "anthropic":
        return r.status_code == 529 and body.get("error", {}).get("type") == "overloaded_error"
    return r.status_code == 503 and "maximum pending requests exceeded" in body.get("error", "")


# ------------------------------------------------------------------------------------- the request mix


@dataclass(frozen=True)
class Job:
    name: str
    kind: str  # "valid", "invalid" or "abandon"
    protocol: str  # "openai", "anthropic" or "ollama"
    path: str
    body: dict | bytes
    check: Check | None = None  # for valid ones
    status: int | None = None  # for invalid ones: the exact 4xx expected


def _chat(content: object = "Say hi.", **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def _huge_prompt() -> str:
    words = ("apple", "river", "stone", "cloud", "seven", "green", "quiet", "march")
    rng = random.Random(7)
    return " ".join(rng.choice(words) for _ in range(170_000))[: 1 << 20]  # ~1 MB, far past 1,024 tokens


NEST = "<nest>"


def nested(body: dict, depth: int = 990) -> bytes:
    """``body`` as JSON with arrays nested ``depth`` deep where it says ``NEST``."""
    return json.dumps(body).replace(json.dumps(NEST), "[" * depth + "]" * depth).encode()


def job_kinds() -> list[Job]:
    huge = _huge_prompt()
    ant = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Say hi."}]}
    long_prompt = "Count from one to one hundred, one number per line."
    return [
        # valid: every protocol, streaming and not, a few tokens each
        Job("oai-chat", "valid", "openai", "/v1/chat/completions", _chat(max_tokens=3), check_openai_chat),
        Job(
            "oai-chat-stream",
            "valid",
            "openai",
            "/v1/chat/completions",
            _chat(max_tokens=3, stream=True),
            check_openai_chat_stream,
        ),
        Job(
            "oai-completion",
            "valid",
            "openai",
            "/v1/completions",
            {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3},
            check_openai_completion,
        ),
        Job(
            "oai-completion-stream",
            "valid",
            "openai",
            "/v1/completions",
            {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "stream": True},
            check_openai_completion_stream,
        ),
        Job("ant-messages", "valid", "anthropic", "/v1/messages", ant, check_anthropic),
        Job(
            "ant-messages-stream", "valid", "anthropic", "/v1/messages", {**ant, "stream": True}, check_anthropic_stream
        ),
        Job(
            "oll-generate",
            "valid",
            "ollama",
            "/api/generate",
            {"model": MODEL, "prompt": "Say hi.", "stream": False, "options": {"num_predict": 3}},
            check_ollama_generate,
        ),
        Job(
            "oll-generate-stream",
            "valid",
            "ollama",
            "/api/generate",
            {"model": MODEL, "prompt": "Say hi.", "options": {"num_predict": 3}},
            check_ollama_stream,
        ),
        Job(
            "oll-chat",
            "valid",
            "ollama",
            "/api/chat",
            _chat(stream=False, options={"num_predict": 3}),
            check_ollama_chat,
        ),
        Job("oll-chat-stream", "valid", "ollama", "/api/chat", _chat(options={"num_predict": 2}), check_ollama_stream),
        # invalid: each must be a 4xx in its protocol's envelope
        Job(
            "oai-malformed-json",
            "invalid",
            "openai",
            "/v1/chat/completions",
            b'{"model": "gemma3:270m", "messages": [{"role": "user", "content": "Hi"',
            status=400,
        ),
        Job(
            "oai-wrong-type",
            "invalid",
            "openai",
            "/v1/chat/completions",
            {"model": MODEL, "messages": "Hi", "max_tokens": "three"},
            status=400,
        ),
        Job(
            "oai-unknown-model",
            "invalid",
            "openai",
            "/v1/chat/completions",
            {**_chat(max_tokens=3), "model": "no-such-model:1b"},
            status=404,
        ),
        Job("oai-huge-max-tokens", "invalid", "openai", "/v1/chat/completions", _chat(max_tokens=2**70), status=400),
        Job(
            "oai-bad-role",
            "invalid",
            "openai",
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "wizard", "content": "Hi"}]},
            status=400,
        ),
        Job(
            "oai-completion-wrong-type",
            "invalid",
            "openai",
            "/v1/completions",
            {"model": MODEL, "prompt": {"text": "Hi"}, "max_tokens": 3},
            status=400,
        ),
        Job("oai-1mb-prompt", "invalid", "openai", "/v1/chat/completions", _chat(huge, max_tokens=3), status=400),
        Job(
            "oai-deep-nesting",
            "invalid",
            "openai",
            "/v1/chat/completions",
            nested(
                _chat(
                    "Hi",
                    tools=[
                        {"type": "function", "function": {"name": "t", "parameters": {"type": "object", "x": NEST}}}
                    ],
                )
            ),
            status=400,
        ),
        Job(
            "ant-malformed-json", "invalid", "anthropic", "/v1/messages", b'{"model": "gemma3:270m", "max_', status=400
        ),
        Job(
            "ant-missing-max-tokens",
            "invalid",
            "anthropic",
            "/v1/messages",
            {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
            status=400,
        ),
        Job(
            "ant-bad-role",
            "invalid",
            "anthropic",
            "/v1/messages",
            {**ant, "messages": [{"role": "system", "content": "Hi"}]},
            status=400,
        ),
        Job("ant-unknown-model", "invalid", "anthropic", "/v1/messages", {**ant, "model": "claude-nope"}, status=404),
        Job("ant-huge-max-tokens", "invalid", "anthropic", "/v1/messages", {**ant, "max_tokens": 2**70}, status=400),
        Job(
            "ant-1mb-prompt",
            "invalid",
            "anthropic",
            "/v1/messages",
            {**ant, "messages": [{"role": "user", "content": huge}]},
            status=400,
        ),
        Job(
            "ant-deep-nesting",
            "invalid",
            "anthropic",
            "/v1/messages",
            nested({**ant, "metadata": {"x": NEST}}),
            status=400,
        ),
        Job(
            "oll-malformed-json",
            "invalid",
            "ollama",
            "/api/generate",
            b'{"model": "gemma3:270m", "prompt": ',
            status=400,
        ),
        Job(
            "oll-wrong-type",
            "invalid",
            "ollama",
            "/api/generate",
            {"model": MODEL, "prompt": ["Hi"], "stream": False},
            status=400,
        ),
        Job(
            "oll-unknown-model",
            "invalid",
            "ollama",
            "/api/chat",
            {**_chat(stream=False), "model": "nope:7b"},
            status=404,
        ),
        Job(
            "oll-bad-role",
            "invalid",
            "ollama",
            "/api/chat",
            {"model": MODEL, "stream": False, "messages": [{"role": "wizard", "content": "Hi"}]},
            status=400,
        ),
        Job(
            "oll-1mb-prompt",
            "invalid",
            "ollama",
            "/api/generate",
            {"model": MODEL, "prompt": huge, "stream": False, "options": {"num_predict": 3}},
            status=400,
        ),
        Job(
            "oll-deep-nesting",
            "invalid",
            "ollama",
            "/api/generate",
            nested({"model": MODEL, "prompt": "Hi", "stream": False, "format": {"x": NEST}}),
            status=400,
        ),
        # abandoned: the client reads the first chunk and hangs up
        Job(
            "oai-chat-abandon",
            "abandon",
            "openai",
            "/v1/chat/completions",
            _chat(long_prompt, max_tokens=48, stream=True),
        ),
        Job(
            "ant-messages-abandon",
            "abandon",
            "anthropic",
            "/v1/messages",
            {**ant, "max_tokens": 48, "stream": True, "messages": [{"role": "user", "content": long_prompt}]},
        ),
        Job(
            "oll-generate-abandon",
            "abandon",
            "ollama",
            "/api/generate",
            {"model": MODEL, "prompt": long_prompt, "options": {"num_predict": 48}},
        ),
        Job("oll-chat-abandon", "abandon", "ollama", "/api/chat", _chat(long_prompt, options={"num_predict": 48})),
    ]


# ------------------------------------------------------------------------------------- the load


@dataclass
class Tally:
    started: float
    done: Counter = field(default_factory=Counter)  # job name -> answered as expected
    overloads: Counter = field(default_factory=Counter)  # protocol -> overload answers (each retried)
    retry_after: Counter = field(default_factory=Counter)  # retry-after values handed out
    most_tries: int = 0
    failures: list[str] = field(default_factory=list)


async def attempt(http: httpx.AsyncClient, job: Job) -> httpx.Response | None:
    """One try. An abandoned stream returns ``None`` once it has read its first chunk and hung up."""
    headers = {"content-type": "application/json", **(ANTHROPIC_HEADERS if job.protocol == "anthropic" else {})}
    content = job.body if isinstance(job.body, bytes) else json.dumps(job.body).encode()
    if job.kind != "abandon":
        return await http.post(job.path, content=content, headers=headers)
    async with http.stream("POST", job.path, content=content, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return r
        async for chunk in r.aiter_raw():
            if chunk:
                break
        return None  # leaving the block closes the connection mid-stream


def judge(job: Job, r: httpx.Response) -> None:
    if job.kind == "invalid":
        assert r.status_code == job.status, f"status {r.status_code}, wanted {job.status}"
        error_shape(job.protocol, r)
    else:
        assert r.status_code == 200, f"status {r.status_code}"
        if job.check:
            job.check(r)


async def run_job(http: httpx.AsyncClient, job: Job, tally: Tally, rng: random.Random) -> None:
    """Send ``job`` until it is answered other than "overloaded" (retrying after ``retry-after``, until the
    deadline), and judge that answer."""
    tries = 0
    while time.monotonic() - tally.started < RETRY_DEADLINE:
        tries += 1
        try:
            r = await attempt(http, job)
        except httpx.HTTPError as exc:
            tally.failures.append(f"{job.name}: {exc!r} at {time.monotonic() - tally.started:.1f} s")
            return
        tally.most_tries = max(tally.most_tries, tries)
        if r is not None and overloaded(job.protocol, r):
            tally.overloads[job.protocol] += 1
            tally.retry_after[r.headers["retry-after"]] += 1
            await asyncio.sleep(float(r.headers["retry-after"]) + rng.uniform(0, 1.5))
            continue
        if r is not None:
            try:
                judge(job, r)
            except (AssertionError, KeyError, IndexError, TypeError, ValueError) as exc:
                tally.failures.append(f"{job.name}: {exc!r} {r.status_code} {r.text[:300]!r}")
                return
        tally.done[job.name] += 1
        return
    tally.failures.append(f"{job.name}: still overloaded after {tries} tries and {RETRY_DEADLINE} s")


async def load(url: str, jobs: list[Job], clients: int) -> Tally:
    """``jobs`` shared out among ``clients`` concurrent clients, each with its own connection pool."""
    tally = Tally(started=time.monotonic())
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    limits = httpx.Limits(keepalive_expiry=CLIENT_KEEPALIVE)

    async def client(n: int) -> None:
        rng = random.Random(n)
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=30), limits=limits) as http:
            while not queue.empty():
                await run_job(http, queue.get_nowait(), tally, rng)

    await asyncio.gather(*(client(n) for n in range(clients)))
    return tally


async def instance_of(http: httpx.AsyncClient) -> dict:
    instances = (await http.get("/instances")).json()
    assert len(instances) == 1, instances
    return instances[0]


async def settled_rss(pid: int, target: int, seconds: float = 15) -> int:
    """The gateway's RSS, polled until it is at most ``target`` or ``seconds`` pass; the lowest seen."""
    lowest = rss_kib(pid)
    deadline = time.monotonic() + seconds
    while lowest > target and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        lowest = min(lowest, rss_kib(pid))
    return lowest


async def test_two_hundred_hostile_clients(server: Server) -> None:
    began = time.monotonic()
    gateway = server.proc.pid
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        first = await http.post("/v1/chat/completions", json=_chat(max_tokens=2))
    assert first.status_code == 200, first.text
    runners = server.children()
    assert len(runners) == 1, runners
    await asyncio.sleep(2)
    rss_first = rss_kib(gateway)
    kinds = job_kinds()
    warm = await load(server.url, kinds, 1)  # each kind once, one after another
    assert not warm.failures and not warm.overloads, warm.failures
    await asyncio.sleep(2)
    rss_before = rss_kib(gateway)

    jobs = [job for job in kinds for _ in range(HUGE if "1mb" in job.name else COUNTS[job.kind])]
    random.Random(42).shuffle(jobs)
    tally = await load(server.url, jobs, CLIENTS)
    elapsed = time.monotonic() - tally.started

    assert server.proc.poll() is None, "the gateway died"
    assert server.children() == runners and all(alive(pid) for pid in runners), "the runner died or was replaced"
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        instance = await instance_of(http)
        assert instance["state"]["state"] == "ready" and instance["attempts"] == 0, instance
        assert [r["pid"] for r in instance["runners"].values()] == runners, instance
        deadline = time.monotonic() + 10
        while (queue := (await instance_of(http))["queue"])["active"] or queue["queued"]:
            assert time.monotonic() < deadline, f"the queue never drained: {queue}"
            await asyncio.sleep(0.2)
    rss_after = await settled_rss(gateway, int(rss_before * (1 + MEMORY_SLACK)))

    by_kind = Counter(job.kind for job in jobs)
    huge = sum(1 for job in jobs if "1mb" in job.name)
    mib = 1024
    print(
        f"\nabuse load: {len(jobs)} requests from {CLIENTS} clients ({by_kind['valid']} valid, "
        f"{by_kind['invalid']} invalid of which {huge} ~1 MB, {by_kind['abandon']} abandoned mid-stream); "
        f"{sum(tally.overloads.values())} overload answers {dict(tally.overloads)} retried "
        f"(retry-after {dict(sorted(tally.retry_after.items(), key=lambda kv: float(kv[0])))}, "
        f"most tries {tally.most_tries}); {len(tally.failures)} failures; load {elapsed:.1f} s, "
        f"test {time.monotonic() - began:.1f} s; gateway RSS {rss_first / mib:.1f} MiB after one request, "
        f"{rss_before / mib:.1f} MiB after one of each kind, {rss_after / mib:.1f} MiB after the load "
        f"({(rss_after / rss_before - 1) * 100:+.1f}%)"
    )
    assert not tally.failures, "\n".join(tally.failures[:20])
    assert sum(tally.done.values()) == len(jobs)
    assert rss_after <= rss_before * (1 + MEMORY_SLACK), (rss_before, rss_after)
