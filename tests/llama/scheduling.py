"""The llama.cpp scheduler on the real model in the test's own process, for the tests that drive ``batch.Scheduler``
directly (prefill fairness, prefix sharing): the model loaded as the engine loads it, a running scheduler, and
greedy jobs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import llama_cpp

from meshgate.backends.llama_cpp.batch import Job, Scheduler
from meshgate.backends.llama_cpp.rpc import weight_repacking
from meshgate.backends.llama_cpp.sampling import Sampler
from meshgate.backends.runner.kvtier import KVTier

GREEDY = dict(top_k=40, top_p=1.0, min_p=0.0, repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)


def load(gguf: Path) -> llama_cpp.Llama:
    """The model, its weights as the engine loads them (no repacking); the scheduler makes its own context."""
    with weight_repacking(False):
        return llama_cpp.Llama(model_path=str(gguf), n_ctx=64, n_batch=64, n_threads=2, verbose=False)


@contextmanager
def running(
    llm: llama_cpp.Llama,
    parallel: int,
    tier: KVTier | None = None,
    *,
    n_ctx: int = 4096,
    threads: int = 2,
    spares: int = 0,
) -> Iterator[Scheduler]:
    """A ``Scheduler`` of ``parallel`` sequences (and ``spares`` more) of ``n_ctx`` tokens over ``llm``, run in a
    thread; closed and freed on the way out. ``s.llm`` keeps the model alive with the context (and tokenizes)."""
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    s = Scheduler(
        llm._model.model,
        n_ctx=n_ctx,
        parallel=parallel,
        n_threads=threads,
        is_eog=lambda token: bool(llama_cpp.llama_vocab_is_eog(vocab, token)),
        tier=tier,
        spares=spares,
    )
    s.llm = llm
    thread = threading.Thread(target=s.run, daemon=True)
    thread.start()
    try:
        yield s
    finally:
        s.close()
        thread.join(60)
        s.free()


def greedy_job(s: Scheduler, prompt: list[int], limit: int) -> Job:
    """A job generating up to ``limit`` greedy tokens after ``prompt``."""
    sampler = Sampler(s.n_vocab, temp=0.0, seed=0, **GREEDY)
    return Job(prompt=prompt, limit=limit, sampler=sampler, cancel=threading.Event())
