"""Prefill fairness in the llama.cpp scheduler, on the real Gemma 3 270M in this process.

A short prompt submitted while a long one (~2,400 tokens, five chunks) is being prefilled gets its first token
before the long prompt's first token: it goes first (shortest remaining first) and the long prompt's chunk in
flight is stopped for it and evaluated again. Both greedy texts are their texts alone, token for token, so the
stopped chunk left nothing behind. A cancelled long prompt leaves its slot without finishing its chunk.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from meshgate.backends.llama_cpp.batch import Job, Scheduler
from tests.llama.scheduling import greedy_job, load, running

TOKENS = 12
LONG = " ".join(
    f"Entry {i}: the {animal} crossed the {place} at dawn and counted {i * 7 % 31} stones."
    for i, (animal, place) in enumerate(
        [("fox", "river"), ("heron", "field"), ("badger", "bridge"), ("otter", "orchard"), ("crow", "market")] * 26
    )
)


@pytest.fixture(scope="module")
def scheduler(packaged_gguf):
    with running(load(packaged_gguf), parallel=2) as s:
        yield s


def _job(s: Scheduler, text: str) -> Job:
    return greedy_job(s, s.llm.tokenize(text.encode(), add_bos=True, special=True), TOKENS)


def _read(job: Job, times: list[float]) -> list[int]:
    """The job's tokens; ``times`` gets when each came."""
    tokens = []
    while (item := job.out.get(timeout=120)) is not None:
        times.append(time.monotonic())
        tokens.append(item[0])
    return tokens


def _alone(s: Scheduler, text: str) -> list[int]:
    job = _job(s, text)
    s.submit(job)
    return _read(job, [])


def _short() -> str:
    return "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n"


def test_a_short_prompt_goes_before_a_long_one_being_prefilled(scheduler):
    s = scheduler
    long_alone, short_alone = _alone(s, LONG), _alone(s, _short())
    long_job, short_job = _job(s, LONG), _job(s, _short())
    assert len(long_job.prompt) > 2000 and len(short_job.prompt) < 20
    long_times: list[float] = []
    results: dict[str, list[int]] = {}
    reader = threading.Thread(target=lambda: results.update(long=_read(long_job, long_times)))
    reader.start()
    before = s.stats()["preempted_chunks"]
    s.submit(long_job)
    deadline = time.monotonic() + 120
    while not (long_job.fed >= 1024 and s._inflight is long_job):  # a chunk at depth is being decoded
        assert time.monotonic() < deadline and reader.is_alive()
        time.sleep(0.01)
    submitted = time.monotonic()
    s.submit(short_job)
    short_times: list[float] = []
    short = _read(short_job, short_times)
    reader.join(300)
    waited = short_times[0] - submitted
    print(f"short first token after {waited:.2f} s; long prompt's first token {long_times[0] - submitted:.2f} s")
    assert short_times[0] < long_times[0], "the short prompt waited for the long one"
    assert s.stats()["preempted_chunks"] > before  # the long prompt's chunk in flight was stopped for it
    assert short == short_alone and results["long"] == long_alone


def test_a_cancelled_prompt_stops_its_chunk(scheduler):
    s = scheduler
    job = _job(s, LONG)
    s.submit(job)
    deadline = time.monotonic() + 120
    while not (job.fed >= 1024 and s._inflight is job):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    job.cancel.set()
    cancelled = time.monotonic()
    try:
        assert job.out.get(timeout=60) is None
    except queue.Empty:
        pytest.fail("the cancelled job never ended")
    took = time.monotonic() - cancelled
    assert job.end == "cancelled" and job.fed < len(job.prompt)
    assert s.stats()["active_sequences"] == 0
    print(f"cancelled after {took:.2f} s")
