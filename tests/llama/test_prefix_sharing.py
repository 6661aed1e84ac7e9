"""Slots share a cached prompt prefix, on the real Gemma 3 270M in this process.

Two prompts share a long preamble and differ after it (an agent's two tasks behind one system prompt). The second,
admitted while the first is generating, or while the first is still prefilling the preamble, takes the preamble
from the first one's slot (a copy of its KV stream) instead of evaluating it again, and reports those tokens as
cached; its greedy text is, token for token, its text alone (run in a second scheduler, where nothing is cached).
The preamble is a whole number of prompt chunks long, so the prompt alone is cut into the same chunks and any
difference would be the copy's.
"""

from __future__ import annotations

import time

import pytest

from meshgate.backends.llama_cpp.batch import CHUNK, Job, Scheduler
from tests.llama.scheduling import greedy_job, load, running

TOKENS = 12
TEXT = " ".join(
    f"Rule {i}: the {animal} may cross the {place} only after it has counted {i * 7 % 31} stones."
    for i, (animal, place) in enumerate(
        [("fox", "river"), ("heron", "field"), ("badger", "bridge"), ("otter", "orchard"), ("crow", "market")] * 30
    )
)


@pytest.fixture(scope="module")
def llm(packaged_gguf):
    return load(packaged_gguf)


@pytest.fixture(scope="module")
def scheduler(llm):
    with running(llm, parallel=3) as s:
        yield s


@pytest.fixture(scope="module")
def reference(llm):
    """The same scheduler beside it, for each prompt's text alone: a fresh context, nothing cached."""
    with running(llm, parallel=3) as s:
        yield s


def _tokens(s: Scheduler, text: str, bos: bool = False) -> list[int]:
    return s.llm.tokenize(text.encode(), add_bos=bos, special=True)


def _preamble(s: Scheduler, name: str, chunks: int) -> list[int]:
    """A preamble of exactly ``chunks`` prompt chunks, its own for each test (so no slot holds it yet)."""
    tokens = _tokens(s, f"Preamble of {name}. {TEXT}", bos=True)[: chunks * CHUNK]
    assert len(tokens) == chunks * CHUNK
    return tokens


def _job(s: Scheduler, prompt: list[int], limit: int = TOKENS) -> Job:
    return greedy_job(s, prompt, limit)


def _read(job: Job) -> list[int]:
    tokens = []
    while (item := job.out.get(timeout=300)) is not None:
        tokens.append(item[0])
    return tokens


def _alone(s: Scheduler, prompt: list[int]) -> list[int]:
    """``prompt``'s greedy tokens from an empty sequence (``s`` holds none of it)."""
    job = _job(s, prompt)
    s.submit(job)
    tokens = _read(job)
    assert job.cached == 0
    return tokens


def _tasks(s: Scheduler, preamble: list[int]) -> tuple[list[int], list[int]]:
    first = preamble + _tokens(s, "First task: fix the parser.\n")
    second = preamble + _tokens(s, "Second task: write a haiku about the river and the stones.\n")
    assert first[len(preamble)] != second[len(preamble)] and len(first) < len(second)
    return first, second


def test_a_prompt_takes_its_prefix_from_a_generating_slot(scheduler, reference):
    s = scheduler
    preamble = _preamble(s, "the generating test", 2)
    first, second = _tasks(s, preamble)
    second_alone = _alone(reference, second)
    copies, reused = s.stats()["copied_prefixes"], s.stats()["reused_tokens"]

    running = _job(s, first, limit=64)
    s.submit(running)
    deadline = time.monotonic() + 300
    while running.count < 1:  # its prompt is in its slot's cache and it is generating
        assert time.monotonic() < deadline
        time.sleep(0.01)
    job = _job(s, second)
    s.submit(job)
    tokens = _read(job)
    running.cancel.set()
    _read(running)

    assert job.cached == len(preamble)  # the whole preamble, taken from the other slot, reported as cached
    assert s.stats()["copied_prefixes"] == copies + 1
    assert s.stats()["reused_tokens"] - reused == len(preamble)
    assert tokens == second_alone


def test_a_prompt_follows_a_slot_still_prefilling_its_preamble(scheduler, reference):
    s = scheduler
    preamble = _preamble(s, "the prefilling test", 4)
    first, second = _tasks(s, preamble)
    second_alone = _alone(reference, second)
    copies = s.stats()["copied_prefixes"]

    ahead = _job(s, first)
    s.submit(ahead)
    deadline = time.monotonic() + 300
    while not (ahead.fed == CHUNK and s._inflight is ahead):  # its second chunk is being decoded
        assert time.monotonic() < deadline
        time.sleep(0.01)
    job = _job(s, second)
    s.submit(job)
    tokens = _read(job)
    _read(ahead)

    # Admitted after that chunk, it copied the two chunks computed. Shortest remaining first then ran the prompt
    # ahead (less left: a shorter task) through the rest of the preamble, and this one copied that too when its
    # turn came: the preamble was evaluated once.
    assert s.stats()["copied_prefixes"] == copies + 2
    assert job.cached == len(preamble) and ahead.cached == 0
    assert tokens == second_alone
