"""Runner processes under stress: a client that disconnects cancels the generation; a runner killed mid-stream
hands its streams on to a new runner (``gateway.serving.resume``): each client's stream goes on unbroken with the text
an undisturbed run gives; with resume off (``MESHGATE_RESUME_WAIT=0``) each protocol gets its mid-stream error, the
gateway keeps serving, and the next request starts a fresh runner."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from meshgate.gateway.telemetry.middleware import REPORT_DELAY
from tests.cluster.faults import greedy_streams, resumes
from tests.conftest import MODEL, Server
from tests.e2e.agent_clients import request_lines

LONG = "Count from one to one thousand, one number per line."
SECRET = "runner-faults-test-secret"  # the runners' cluster secret, so this test may read their /health
RUNNER = {"authorization": f"Bearer {SECRET}"}


@pytest.fixture(scope="module")
def server(data_dir) -> Iterator[Server]:
    """A gateway whose streams are not resumed: a failure mid-stream reaches the client."""
    s = Server(data_dir, "--n-ctx", "2048", env={"MESHGATE_CLUSTER_SECRET": SECRET, "MESHGATE_RESUME_WAIT": "0"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def resuming(data_dir) -> Iterator[Server]:
    """A gateway with the default settings: streams resume."""
    s = Server(data_dir, "--n-ctx", "2048", "--log-level", "info", env={"MESHGATE_CLUSTER_SECRET": SECRET})
    yield s
    s.stop()


def runner_pid(server: Server) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if children := server.children():
            return children[0]
        time.sleep(0.1)
    raise AssertionError("no runner process")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def warm(server: Server) -> int:
    httpx.post(f"{server.url}/api/generate", json={"model": MODEL, "prompt": "", "stream": False}, timeout=60)
    return runner_pid(server)


def test_client_disconnect_cancels_generation(server):
    pid = warm(server)
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        timeout=30,
        json={
            "model": MODEL,
            "stream": True,
            "max_tokens": 1500,
            "temperature": 0,  # greedy: it never ends by itself, so only the cancel stops it
            "messages": [{"role": "user", "content": LONG}],
        },
    ) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    # The runner notices at its next token; on a loaded machine the hops take a while, so poll (bounded): a
    # generation that was not cancelled keeps both cores busy for the ~30 s its 1,500 tokens take.
    deadline, burned = time.monotonic() + 10, []
    while time.monotonic() < deadline:
        before = cpu_seconds(pid)
        time.sleep(0.5)
        burned.append(cpu_seconds(pid) - before)
        if burned[-1] < 0.1:
            break
    assert burned[-1] < 0.1, f"runner kept generating after the client left (CPU s per 0.5 s: {burned})"
    ok = httpx.post(
        f"{server.url}/api/generate",
        timeout=60,
        json={"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2, "temperature": 0}},
    )
    assert ok.status_code == 200 and ok.json()["eval_count"] == 2


def _kill_after_first_chunk(server: Server, chunks: Iterator) -> tuple[int, list]:
    pid = runner_pid(server)
    seen = [next(chunks)]
    os.kill(pid, signal.SIGKILL)
    return pid, seen


def _next_request_works(server: Server, old_pid: int) -> None:
    response = ollama.Client(host=server.url).generate(
        model=MODEL, prompt="Hello", options={"num_predict": 3, "temperature": 0}
    )
    assert response.eval_count == 3
    assert runner_pid(server) != old_pid


def test_runner_killed_mid_stream_in_each_protocol(server):
    """A stream in each protocol, all three generating when the runner is killed (one kill, one restart for the
    three): each SDK raises its mid-stream error, and the next request is served by a new runner. Greedy, so that
    none of them ends by itself before the kill."""
    warm(server)
    long = [{"role": "user", "content": LONG}]
    openai_stream = iter(
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model=MODEL, stream=True, max_tokens=1500, temperature=0, messages=long
        )
    )
    anthropic_stream = iter(
        anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0).messages.create(
            model=MODEL, max_tokens=1500, stream=True, messages=long, extra_body={"temperature": 0}
        )
    )
    ollama_stream = iter(
        ollama.Client(host=server.url).chat(
            model=MODEL, stream=True, options={"num_predict": 1500, "temperature": 0}, messages=long
        )
    )
    next(openai_stream)
    next(anthropic_stream)
    pid, _ = _kill_after_first_chunk(server, ollama_stream)

    with pytest.raises(openai.APIError) as openai_error:
        for _ in openai_stream:
            pass
    assert "model runner" in openai_error.value.message
    with pytest.raises(anthropic.APIStatusError) as anthropic_error:
        for _ in anthropic_stream:
            pass
    assert anthropic_error.value.body["error"]["type"] == "overloaded_error"
    with pytest.raises(ollama.ResponseError) as ollama_error:
        for _ in ollama_stream:
            pass
    assert ollama_error.value.status_code == -1 and "model runner" in ollama_error.value.error
    _next_request_works(server, pid)


RESUMED_TOKENS = 96


def test_runner_killed_mid_stream_is_resumed_in_each_protocol(resuming):
    """A greedy stream in each protocol and a non-streaming request, all four generating when the runner is killed:
    the gateway re-places the instance and continues each on the new runner from the tokens already sent. Every
    SDK gets its whole answer without an error, equal to the text of an undisturbed run; ``/metrics`` counts the
    resumes and the request log says how long each client waited."""
    warm(resuming)
    reference = {
        protocol: "".join(text) for protocol, text in greedy_streams(resuming.url, MODEL, LONG, RESUMED_TOKENS).items()
    }
    assert all(len(t) > 40 for t in reference.values()), reference
    oai = openai.OpenAI(base_url=f"{resuming.url}/v1", api_key="x", max_retries=0, timeout=120)
    plain = oai.completions.create(model=MODEL, prompt=LONG, max_tokens=RESUMED_TOKENS, temperature=0).choices[0].text

    resumed_before = resumes(resuming.url)
    streams = greedy_streams(resuming.url, MODEL, LONG, RESUMED_TOKENS)
    got = {protocol: next(text) for protocol, text in streams.items()}  # all three generating
    unary: dict[str, str] = {}
    worker = threading.Thread(
        target=lambda: unary.setdefault(
            "text",
            oai.completions.create(model=MODEL, prompt=LONG, max_tokens=RESUMED_TOKENS, temperature=0).choices[0].text,
        )
    )
    worker.start()
    health_url = f"{runner_url(resuming)}/health"
    deadline = time.monotonic() + 30
    while httpx.get(health_url, headers=RUNNER, timeout=5).json()["active_sequences"] < 4:
        assert time.monotonic() < deadline, "the four requests never ran together"
        time.sleep(0.05)
    pid = runner_pid(resuming)
    os.kill(pid, signal.SIGKILL)
    for protocol, text in streams.items():
        got[protocol] += "".join(text)
    worker.join(120)
    assert got == reference
    assert unary["text"] == plain
    assert runner_pid(resuming) != pid
    assert resumes(resuming.url) - resumed_before == 4
    time.sleep(REPORT_DELAY + 0.2)  # the request lines are written in batches
    lines = [r for r in request_lines(resuming.log.read_text(errors="replace")) if r.get("resumes")]
    assert len(lines) == 4 and all(r["status"] == 200 and r["error"] is None for r in lines), lines
    assert all(r["resumes"] == 1 and r["resume_wait_ms"] > 0 for r in lines), lines
    assert {r["path"] for r in lines} == {"/v1/chat/completions", "/v1/messages", "/api/chat", "/v1/completions"}


def test_no_runner_outlives_its_gateway(data_dir):
    s = Server(data_dir, "--n-ctx", "512")
    try:
        pid = warm(s)
    finally:
        s.proc.kill()  # no graceful shutdown: the runner must notice on its own
        s.proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.1)
    alive = os.path.exists(f"/proc/{pid}") and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    assert not alive, "runner survived its gateway"


def test_embedding_after_the_runner_died_is_served_by_a_new_one(server):
    """A runner found unreachable when an embedding starts is re-placed and the request retried (OAI-5)."""
    pid = warm(server)
    os.kill(pid, signal.SIGKILL)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    reply = client.embeddings.create(model=MODEL, input="a cat")
    assert len(reply.data[0].embedding) == 640
    assert runner_pid(server) != pid


def runner_url(server: Server) -> str:
    instances = httpx.get(f"{server.url}/instances", timeout=10).json()
    return next(r["url"] for i in instances for r in i["runners"].values() if r.get("url"))


def test_non_streaming_client_that_leaves_cancels_generation(server):
    """``curl -m 3 .../api/generate -d '{..., "stream": false, "options": {"num_predict": -1}}'``: the runner stops
    generating soon after the client gives up (issue 15, item 2); it used to run to the end of the context."""
    warm(server)
    health_url = f"{runner_url(server)}/health"
    gone = threading.Event()

    def leave_after_3_seconds() -> None:
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(
                f"{server.url}/api/generate",
                timeout=3,
                json={
                    "model": MODEL,
                    "prompt": LONG,
                    "stream": False,
                    "options": {"num_predict": -1, "temperature": 0},
                },
            )
        gone.set()

    thread = threading.Thread(target=leave_after_3_seconds)
    thread.start()
    seen_active = False
    while not gone.wait(0.2):
        seen_active = seen_active or httpx.get(health_url, headers=RUNNER, timeout=5).json()["active_sequences"] == 1
    thread.join()
    assert seen_active, "the generation never started"
    deadline, health = time.monotonic() + 10, {}
    while time.monotonic() < deadline:
        health = httpx.get(health_url, headers=RUNNER, timeout=5).json()
        if health["active_sequences"] == 0 and health["active"] == 0:
            break
        time.sleep(0.2)
    assert health["active_sequences"] == 0 and health["active"] == 0, f"still generating: {health}"


def test_a_runner_that_dies_is_logged_with_why(server):
    """A runner that dies on its own fails only its requests, and the gateway's log says why (issue 15, item 1)."""
    pid = warm(server)
    os.kill(pid, signal.SIGABRT)
    expected = f"runner for {MODEL} (pid {pid}) was killed by SIGABRT"
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and expected not in server.log.read_text(errors="replace"):
        time.sleep(0.2)
    assert expected in server.log.read_text(errors="replace")
    _next_request_works(server, pid)
