"""One MLX runner serving several requests at once: batched decoding through the runner's HTTP protocol.

Real runner processes (the MLX venv's python) on the tiny llama model, whose greedy decoding of these raw
prompts never meets its end token, so a generation runs exactly as long as asked. Concurrent requests must each
get the text, finish reason and usage they get alone, decoded in one batch (the engine's own counters say how
wide its steps were); a cancelled request frees its slot for the next at once. Every process is killed on the
way out.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.mlx.test_mlx_engine import ENV, HERE, ROOT, _mlx, _ready_port, mlx_python

PROMPTS = ["Hello world", "The quick brown fox", "Ranks talk over a ring", "One, two, three"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-batching") / "llama"
    _mlx(str(HERE / "tiny_model.py"), str(path), "llama")
    return path


@contextlib.contextmanager
def runner(model: Path, parallel: int) -> Iterator[str]:
    argv = [str(mlx_python()), "-m", "meshgate.backends.mlx.runner", "--model", str(model), "--parallel", str(parallel)]
    proc = subprocess.Popen(
        argv, env=ENV, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        yield f"http://127.0.0.1:{_ready_port(proc, time.monotonic() + 90)}"
    finally:
        proc.kill()
        proc.wait(10)


def body(prompt: str, max_tokens: int, **extra: object) -> dict:
    return {"model": "tiny", "raw_prompt": prompt, "sampling": {"temperature": 0.0}, "max_tokens": max_tokens, **extra}


def generate(url: str, request: dict) -> dict:
    """One streamed generation: its text, finish reason and final usage."""
    with httpx.Client(timeout=120) as client:
        reply = client.post(f"{url}/generate", json=request)
    events = [json.loads(line) for line in reply.text.splitlines() if line]
    assert events[0]["type"] == "usage" and events[-2]["type"] == "usage", events[-3:]
    return {
        "text": "".join(e["text"] for e in events if e["type"] == "text"),
        "finish": events[-1]["reason"],
        "completion_tokens": events[-2]["completion_tokens"],
        "prompt_tokens": events[-2]["prompt_tokens"],
    }


def batch(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()["batch"]


def test_concurrent_requests_get_their_own_text_from_one_batch(tiny: Path) -> None:
    """Four requests at once, with different lengths, a stop string, a token limit and a seeded sampled one, each
    get what they get alone, and every one of them was in the batch at the same step."""
    requests = [
        body(PROMPTS[0], 300),
        body(PROMPTS[1], 240),
        body(PROMPTS[2], 40),  # long enough to still run when the last of the four joins (6 could end first)
        body(PROMPTS[3], 260, sampling={"temperature": 0.9, "seed": 5}),
    ]
    with runner(tiny, 4) as url:
        alone = [generate(url, r) for r in requests]
        full = alone[1]["text"]
        stop = full[100:108]  # a stop string from the middle of its own text
        requests[1]["stop"] = [stop]
        alone[1] = generate(url, requests[1])
        assert alone[1]["finish"] == "stop_sequence" and alone[1]["text"] == full[: full.index(stop)]
        assert [a["finish"] for a in alone] == ["length", "stop_sequence", "length", "length"]
        assert [a["completion_tokens"] for a in alone[::2]] == [300, 40]
        before = batch(url)
        assert before["widest"] == 1 and before["parallel"] == 4

        start = threading.Barrier(len(requests))
        together: list[dict] = [{} for _ in requests]

        def one(i: int) -> None:
            start.wait(30)
            together[i] = generate(url, requests[i])

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        after = batch(url)
    assert together == alone
    # all four decoded in one step at least once, and far fewer steps than tokens: they ran side by side
    assert after["widest"] == 4
    steps, decoded = after["steps"] - before["steps"], after["decoded"] - before["decoded"]
    assert decoded >= sum(a["completion_tokens"] for a in alone) - len(alone)
    assert steps < decoded * 2 / 3


def test_a_cancelled_request_frees_its_slot_at_once(tiny: Path) -> None:
    """Two slots, two long generations: closing one lets a third start while the other still runs."""
    with runner(tiny, 2) as url, httpx.Client(timeout=120) as client:
        expected = generate(url, body(PROMPTS[2], 8))
        long = body(PROMPTS[0], 3000)
        with client.stream("POST", f"{url}/generate", json=body(PROMPTS[1], 3000)) as other:
            lines = other.iter_lines()
            assert json.loads(next(lines))["type"] == "usage"
            with client.stream("POST", f"{url}/generate", json=long) as cancelled:
                read = cancelled.iter_lines()  # held: a line iterator that is dropped closes its stream
                assert [json.loads(next(read))["type"] for _ in range(3)] == ["usage", "text", "text"]
                assert batch(url)["running"] == 2
            started = time.monotonic()
            third = generate(url, body(PROMPTS[2], 8))  # waits for a slot: only the cancelled one can free it
            waited = time.monotonic() - started
            health = httpx.get(f"{url}/health", timeout=30).json()  # the other is still generating
        assert third == expected and waited < 5
        assert health["active"] == 1 and health["cancelled"] == 1 and health["batch"]["running"] == 1
