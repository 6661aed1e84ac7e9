"""Batch jobs paused for interactive ones in the llama.cpp scheduler, on the real Gemma 3 270M in this process.

Two batch jobs fill both decode lanes of a scheduler with one spare sequence; an interactive job submitted while
they generate pauses the batch job admitted last (its KV kept in its sequence), takes the spare, and gets its
first token before either batch job ends. The paused job resumes when the interactive one is done and its greedy
text is the undisturbed run's, token for token. A paused job that is cancelled leaves at once.
"""

from __future__ import annotations

import threading
import time

import pytest

from meshgate.backends.llama_cpp.batch import Job, Scheduler
from tests.llama.scheduling import greedy_job, load, running

BATCH_TOKENS = 48
CHAT_TOKENS = 8


@pytest.fixture(scope="module")
def scheduler(packaged_gguf):
    with running(load(packaged_gguf), parallel=2, n_ctx=512, spares=1, threads=1) as s:
        yield s


def _prompt(s: Scheduler, text: str) -> list[int]:
    turn = f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
    return s.llm.tokenize(turn.encode(), add_bos=True, special=True)


def _job(s: Scheduler, text: str, limit: int, *, batch: bool) -> Job:
    job = greedy_job(s, _prompt(s, text), limit)
    job.batch = batch
    return job


def _read(job: Job, times: list[float]) -> list[int]:
    tokens = []
    while (item := job.out.get(timeout=120)) is not None:
        times.append(time.monotonic())
        tokens.append(item[0])
    return tokens


def _reading(job: Job) -> tuple[threading.Thread, dict[str, list]]:
    got: dict[str, list] = {"times": []}
    thread = threading.Thread(target=lambda: got.update(tokens=_read(job, got["times"])), daemon=True)
    thread.start()
    return thread, got


BATCH = ("Write a long story about a lighthouse keeper.", "List the planets and describe each one.")
CHAT = "Name a colour."


def _wait(what, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_an_interactive_job_pauses_a_batch_job_whose_text_stays_the_same(scheduler):
    s = scheduler
    undisturbed = []
    jobs = [_job(s, text, BATCH_TOKENS, batch=True) for text in BATCH]
    readers = [_reading(job) for job in jobs]
    for job in jobs:
        s.submit(job)
    for thread, got in readers:
        thread.join(120)
        undisturbed.append(got["tokens"])
    assert all(len(tokens) == BATCH_TOKENS for tokens in undisturbed)  # long enough to be interrupted

    before = s.stats()["paused_batch_jobs"]
    jobs = [_job(s, text, BATCH_TOKENS, batch=True) for text in BATCH]
    readers = [_reading(job) for job in jobs]
    for job in jobs:
        s.submit(job)
    _wait(lambda: all(job.count >= 8 for job in jobs))  # both lanes taken, both generating
    chat = _job(s, CHAT, CHAT_TOKENS, batch=False)
    chat_thread, chat_got = _reading(chat)
    submitted = time.monotonic()
    s.submit(chat)
    chat_thread.join(120)
    for thread, _ in readers:
        thread.join(120)
    paused = [job for job in jobs if job.admitted == max(j.admitted for j in jobs)]
    print(f"interactive first token after {chat_got['times'][0] - submitted:.2f} s")
    assert s.stats()["paused_batch_jobs"] == before + 1
    assert chat_got["times"][0] < min(got["times"][-1] for _, got in readers), "the interactive job waited"
    assert [got["tokens"] for _, got in readers] == undisturbed, "a paused job's text changed"
    assert paused[0].end == "length" and s.stats()["paused_sequences"] == 0


class _SubmitsInFlight:
    """llama_cpp as the scheduler calls it, but the first decode of batch jobs only (``Scheduler._batch_step``) once
    ``ready()`` submits ``job`` just before llama.cpp runs it: an interactive request arriving mid-step, every time."""

    def __init__(self, s: Scheduler, job: Job, ready) -> None:
        self.lib, self.s, self.job, self.ready = s._lib, s, job, ready

    def __getattr__(self, name: str):
        return getattr(self.lib, name)

    def llama_decode(self, ctx, batch):
        if self.job is not None and self.s._batch_step and self.ready():
            job, self.job = self.job, None
            self.s.submit(job)
        return self.lib.llama_decode(ctx, batch)


def _submit_with_newcomer(s: Scheduler, jobs: list[Job], newcomer: Job, ready, readers: list[threading.Thread]) -> None:
    """Submit ``jobs``, and ``newcomer`` just before the first stoppable decode once ``ready()`` (``_SubmitsInFlight``);
    wait for ``readers``."""
    s._lib = _SubmitsInFlight(s, newcomer, ready)  # type: ignore[assignment]
    try:
        for job in jobs:
            s.submit(job)
        for thread in readers:
            thread.join(120)
    finally:
        s._lib = s._lib.lib  # type: ignore[attr-defined]


def test_an_interactive_job_stops_a_batch_step_in_flight_and_the_batch_text_stays_the_same(scheduler):
    """An interactive job submitted while a decode of batch jobs only runs stops it (ggml's abort callback; llama.cpp
    drops the step's cells), is placed (pausing a batch job) and prefilled first; the stopped rows decode again at
    the next step with the same numbers, so both batch texts are the undisturbed ones, token for token."""
    s = scheduler
    undisturbed = []
    for text in BATCH:
        job = _job(s, text, BATCH_TOKENS, batch=True)
        thread, got = _reading(job)
        s.submit(job)
        thread.join(120)
        undisturbed.append(got["tokens"])
    before = s.stats()
    jobs = [_job(s, text, BATCH_TOKENS, batch=True) for text in BATCH]
    readers = [_reading(job) for job in jobs]
    chat = _job(s, CHAT, CHAT_TOKENS, batch=False)
    chat_thread, chat_got = _reading(chat)
    _submit_with_newcomer(s, jobs, chat, lambda: all(job.count >= 8 for job in jobs), [t for t, _ in readers])
    chat_thread.join(120)
    after = s.stats()
    assert after["interrupted_steps"] == before["interrupted_steps"] + 1, "the step in flight was not stopped"
    assert after["paused_batch_jobs"] == before["paused_batch_jobs"] + 1
    assert chat.end in ("length", "stop") and chat_got["times"][0] < min(got["times"][-1] for _, got in readers)
    assert [got["tokens"] for _, got in readers] == undisturbed, "a stopped step changed a batch job's text"
    assert s.stats()["active_sequences"] == 0


def test_interactive_jobs_wait_before_batch_jobs(scheduler):
    s = scheduler
    jobs = [_job(s, text, BATCH_TOKENS, batch=True) for text in BATCH]
    readers = [_reading(job) for job in jobs]
    for job in jobs:
        s.submit(job)
    _wait(lambda: all(job.count >= 1 for job in jobs))
    late_batch = _job(s, BATCH[0], 4, batch=True)
    s.submit(late_batch)
    chat = _job(s, CHAT, 4, batch=False)
    s.submit(chat)
    assert list(s.waiting)[:2] == [chat, late_batch] or chat.admitted  # interactive ahead of the batch job
    late_times: list[float] = []
    chat_times: list[float] = []
    _read(chat, chat_times)
    _read(late_batch, late_times)
    for thread, _ in readers:
        thread.join(120)
    assert chat_times[0] < late_times[0]


def test_a_paused_job_can_be_cancelled(scheduler):
    s = scheduler
    jobs = [_job(s, text, BATCH_TOKENS, batch=True) for text in BATCH]
    readers = [_reading(job) for job in jobs]
    for job in jobs:
        s.submit(job)
    _wait(lambda: all(job.count >= 2 for job in jobs))
    chat = _job(s, CHAT, 32, batch=False)
    chat_thread, _ = _reading(chat)
    s.submit(chat)
    _wait(lambda: any(job.paused for job in jobs))
    paused = next(job for job in jobs if job.paused)
    paused.cancel.set()
    _wait(lambda: paused.end == "cancelled")  # at the next step, while the interactive job runs
    for thread, _ in readers:
        thread.join(120)
    chat_thread.join(120)
    assert paused.end == "cancelled" and paused.count < BATCH_TOKENS
    assert chat.end in ("length", "stop") and s.stats()["active_sequences"] == 0


def test_a_paused_job_waits_at_most_the_aging_bound_under_steady_interactive_load(scheduler):
    """Interactive jobs queue up faster than they finish: without aging the paused batch job would wait for all of
    them; past ``aging`` it takes the next free lane before them, is not paused again, and its text is unchanged."""
    s = scheduler
    alone = _job(s, BATCH[1], BATCH_TOKENS, batch=True)
    alone_thread, alone_got = _reading(alone)
    s.submit(alone)
    alone_thread.join(120)
    s.aging = 0.5
    try:
        jobs = [_job(s, text, BATCH_TOKENS, batch=True) for text in BATCH]
        readers = [_reading(job) for job in jobs]
        for job in jobs:
            s.submit(job)
        _wait(lambda: all(job.count >= 8 for job in jobs))
        chats = [_job(s, f"{CHAT} ({i})", CHAT_TOKENS, batch=False) for i in range(16)]
        chat_readers = [_reading(chat) for chat in chats]
        for chat in chats:
            s.submit(chat)
        for thread, _ in [*readers, *chat_readers]:
            thread.join(120)
    finally:
        s.aging = 30.0
    paused = max(jobs, key=lambda j: j.admitted)  # the one the first interactive job paused
    last_chat_starts = max(got["times"][0] for _, got in chat_readers)
    assert paused.aged, "the paused job never aged"
    assert readers[1][1]["times"][-1] < last_chat_starts, "the paused job waited for every interactive job"
    assert readers[1][1]["tokens"] == alone_got["tokens"], "an aged job's text changed"
    assert all(chat.end in ("length", "stop") for chat in chats) and s.stats()["paused_sequences"] == 0


def test_a_waiting_batch_job_without_a_lane_stops_no_chunk(scheduler):
    """A spare sequence is free but both lanes are taken: a waiting batch job with a shorter prompt cannot take a
    running job's place, so it must not stop that job's prompt chunk (it did, step after step, for ever: a
    livelock once a gateway sent more batch requests than the runner has lanes)."""
    s = scheduler
    jobs = [_job(s, text, 8, batch=True) for text in (*BATCH, "Hi.")]  # the last one's prompt is the shortest
    readers = [_reading(job) for job in jobs]
    for job in jobs:
        s.submit(job)
    for thread, _ in readers:
        thread.join(60)
    assert [job.end for job in jobs] == ["length"] * 3, "a job never ran"
    assert s.stats()["active_sequences"] == 0 and s.stats()["waiting"] == 0


def test_an_interactive_job_stops_a_step_a_chat_shares_with_a_batch_job_and_no_text_changes(scheduler):
    """A decode holding a running chat and a batch job is stopped for an interactive newcomer as a batch-only one
    is: the newcomer pauses the batch job and is prefilled first; the chat's and the batch job's rows decode again
    at the next step with the same numbers, so both texts are the undisturbed ones, token for token."""
    s = scheduler
    running_chat = "Describe a walk along the sea in autumn."
    undisturbed = {}
    for name, text, batch in (("batch", BATCH[0], True), ("chat", running_chat, False)):
        job = _job(s, text, BATCH_TOKENS, batch=batch)
        thread, got = _reading(job)
        s.submit(job)
        thread.join(120)
        undisturbed[name] = got["tokens"]
    before = s.stats()
    batch_job = _job(s, BATCH[0], BATCH_TOKENS, batch=True)
    chat = _job(s, running_chat, BATCH_TOKENS, batch=False)
    readers = {"batch": _reading(batch_job), "chat": _reading(chat)}
    newcomer = _job(s, CHAT, CHAT_TOKENS, batch=False)
    new_thread, _ = _reading(newcomer)

    def both_generating() -> bool:
        return batch_job.count >= 8 and 8 <= chat.count < BATCH_TOKENS - 8

    _submit_with_newcomer(s, [batch_job, chat], newcomer, both_generating, [t for t, _ in readers.values()])
    new_thread.join(120)
    after = s.stats()
    assert after["interrupted_steps"] == before["interrupted_steps"] + 1, "the shared step was not stopped"
    assert after["paused_batch_jobs"] == before["paused_batch_jobs"] + 1
    assert newcomer.end in ("length", "stop")
    assert {name: got["tokens"] for name, (_, got) in readers.items()} == undisturbed, "a stopped step changed a text"
