"""The KV tier on the real Gemma 3 270M in this process: a prompt's state kept, then restored instead of evaluated.

Each test compares token for token with the prompt evaluated cold in a scheduler without a tier (a fresh context,
nothing cached): a whole prompt restored starts from its kept logits; a longer prompt restores where the kept
prompt's last chunk started (``kvstate.tail``) or at a multiple of ``CHUNK`` (where cold evaluation cut a chunk)
and evaluates the rest in chunks that give cold's numbers. A second scheduler over the
same tier is a runner restarted: its slots are empty, its tier is not. The prompts are not multiples of ``CHUNK``
long, so a restore point inside them is exercised with the sliding-window cells it keeps.

The restored cells are the bytes computed, and a whole prompt's first token comes from its kept logits, bit for
bit. Later tokens' logits are not always bit for bit the cold ones: llama.cpp puts the restored sliding-window
cells at other places in the cache than a cold evaluation left them, and once the window moves over them the
attention sums run in another order (seen: up to ~1 in a logit after 20 tokens). Greedy tokens are compared.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshgate.backends.llama_cpp.batch import CHUNK, MIN_REUSE, Job, Scheduler
from meshgate.backends.llama_cpp.kvstate import tail
from meshgate.backends.runner.kvtier import KVTier
from tests.llama.scheduling import greedy_job, load, running

TOKENS = 32
TEXT = " ".join(
    f"Step {i}: the {tool} reads line {i * 13 % 97} of the {place} file and reports {i * 7 % 31} warnings."
    for i, (tool, place) in enumerate(
        [("linter", "parser"), ("compiler", "lexer"), ("formatter", "router"), ("profiler", "cache")] * 40
    )
)


@pytest.fixture(scope="module")
def llm(packaged_gguf):
    return load(packaged_gguf)


@pytest.fixture(scope="module")
def reference(llm):
    """A scheduler without a tier: each prompt evaluated cold."""
    with running(llm, parallel=2) as s:
        yield s


def _prompt(s: Scheduler, name: str, n: int) -> list[int]:
    tokens = s.llm.tokenize(f"{name}. {TEXT}".encode(), add_bos=True, special=True)[:n]
    assert len(tokens) == n
    return tokens


def _run(
    s: Scheduler, prompt: list[int], tier: KVTier | None = None, scope: str = "", whole: bool = False
) -> tuple[list[int], Job]:
    """The greedy tokens after ``prompt``; the first one's logits (as bytes) in ``job.first``. ``whole``: an
    entry's end may be restored (the inexact mode's lookup; the exact engine restores restore points only)."""
    job = greedy_job(s, prompt, TOKENS)
    job.logprob = lambda row, token: np.ctypeslib.as_array(row, shape=(s.n_vocab,)).tobytes()
    if tier is not None:
        job.scope = scope
        job.restore = tier.find(scope, prompt, usable=MIN_REUSE, whole=whole)
    s.submit(job)
    out = []
    while (item := job.out.get(timeout=300)) is not None:
        out.append(item)
    assert len(out) == TOKENS
    job.first = out[0][1]  # type: ignore[attr-defined]
    return [token for token, _ in out], job


def test_a_prompt_restored_whole_or_at_a_chunk_gives_its_cold_tokens(llm, reference, tmp_path):
    tier = KVTier("test", ram_budget=1 << 30)
    prompt = _prompt(reference, "Whole", 2 * CHUNK + 300)
    longer = prompt + _prompt(reference, "And then", 200)[1:]  # the next turn: goes on from the whole prompt
    edited = prompt[: 2 * CHUNK + 100] + _prompt(reference, "Instead", 150)[1:]  # its last message changed
    cold, alone = _run(reference, prompt)
    cold_longer, alone_longer = _run(reference, longer)
    cold_edited, alone_edited = _run(reference, edited)
    with running(llm, parallel=2, tier=tier) as first:
        kept, job = _run(first, prompt, tier)
        assert job.cached == 0 and kept == cold
        assert tier.stats()["saved"] == 1
        reused, job = _run(first, longer)  # its slot holds the prompt: reused up to where cold's last chunk began
        assert job.cached == tail(len(prompt)) and job.exact, "a slot gives back only what cold would compute"
        assert reused == cold_longer and job.first == alone_longer.first
    with running(llm, parallel=2, tier=tier) as restarted:  # empty slots, the same tier
        again, job = _run(restarted, prompt, tier)
        assert job.cached == tail(len(prompt)), "restored but for its last chunk, evaluated as cold evaluates it"
        assert again == cold and job.first == alone.first
    with running(llm, parallel=2, tier=tier) as restarted:
        again, job = _run(restarted, prompt, tier, whole=True)
        assert job.cached == len(prompt), "the whole prompt is restored, its first token from the kept logits"
        assert again == cold
        assert job.first == alone.first, "the kept logits are the cold ones, bit for bit"
    with running(llm, parallel=2, tier=tier) as restarted:
        extended, job = _run(restarted, longer, tier)
        assert job.cached == tail(len(prompt)) == 2 * CHUNK + 256, "restored up to the kept prompt's last chunk"
        assert extended == cold_longer
        assert job.first == alone_longer.first, "the restored KV is cold's: the next token's logits bit for bit"
    with running(llm, parallel=2, tier=tier) as restarted:
        changed, job = _run(restarted, edited, tier)
        assert job.cached == 2 * CHUNK, "restored at the last chunk boundary before the change"
        assert changed == cold_edited
        assert job.first == alone_edited.first
        assert restarted.stats()["restored_tokens"] == 2 * CHUNK


def test_entries_survive_a_restart_on_disk_and_stay_in_their_scope(llm, reference, tmp_path):
    prompt = _prompt(reference, "Disk", CHUNK + 100)
    cold, _ = _run(reference, prompt)
    tier = KVTier("test", ram_budget=0, directory=tmp_path, disk_budget=1 << 30)
    with running(llm, parallel=2, tier=tier) as first:
        _run(first, prompt, tier, scope="team-a")
    tier.flush()
    tier.close()
    (path,) = tmp_path.glob("*.kv")
    assert path.stat().st_mode & 0o777 == 0o600
    reopened = KVTier("test", ram_budget=1 << 30, directory=tmp_path, disk_budget=1 << 30)
    assert reopened.find("team-b", prompt) is None, "another tenant's entry is never served"
    with running(llm, parallel=2, tier=reopened) as restarted:
        again, job = _run(restarted, prompt, reopened, scope="team-a")
    assert job.cached == tail(len(prompt)) and again == cold
    assert reopened.stats()["hits_disk"] == 1
