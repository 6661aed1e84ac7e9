"""Every ggml compute of a llama.cpp runner runs on its scheduler's thread (``Scheduler.call``).

llama-cpp-python's wheel is an OpenMP build: each thread that runs a graph gets a thread team of its own, and once
libgomp manages more threads than the machine has CPUs it cuts every team's barrier spin short, so every later
decode costs more (embeddings run on the runner's pool threads took generation from 63.5 to 37-42 tokens/s on 2
cores). An embedding's decodes go through the scheduler's thread, so the process keeps one team: the threads
alive after embeddings from three pool threads are the threads alive before them, and the pool's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from meshgate.backends.llama_cpp.engine import LlamaEngine
from meshgate.protocols.model import EmbedRequest
from tests.llama.scheduling import load, running


@pytest.fixture(scope="module")
def engine(packaged_gguf: Path) -> Iterator[LlamaEngine]:
    engine = LlamaEngine(str(packaged_gguf), n_ctx=256, n_threads=2, parallel=1)
    yield engine
    engine.scheduler.close()


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def test_embeddings_decode_on_the_scheduler_thread_and_add_no_thread_team(engine):
    request = EmbedRequest(model="m", inputs=("a lighthouse keeper's long night",))
    engine.embed(request, threading.Event())  # the embedding context made and warm
    seen: list[str] = []
    decode = engine._embedder.ctx.decode

    def recorded(batch):
        seen.append(threading.current_thread().name)
        return decode(batch)

    engine._embedder.ctx.decode = recorded
    with ThreadPoolExecutor(3) as pool:  # as the runner's ``asyncio.to_thread`` calls it
        barrier = threading.Barrier(3)
        list(pool.map(lambda _: barrier.wait(), range(3)))  # three pool threads alive before the count
        before = _threads()
        results = list(pool.map(lambda i: engine.embed(request, threading.Event()), range(3)))
        after = _threads()
    assert seen and set(seen) == {"llama-scheduler"}, seen
    assert after <= before, f"threads started by embeddings: {sorted(after - before)}"
    assert results[0].vectors == results[1].vectors == results[2].vectors


def test_a_call_returns_or_raises_on_the_callers_thread_and_fails_once_closed(packaged_gguf):
    with running(load(packaged_gguf), parallel=1, n_ctx=256, threads=1) as s:
        assert s.call(lambda: threading.current_thread().name) != threading.current_thread().name
        assert s.call(pow, 2, 10) == 1024
        with pytest.raises(ZeroDivisionError):
            s.call(lambda: 1 / 0)
        assert s.call(sum, [1, 2]) == 3  # the loop goes on after an error
    with pytest.raises(RuntimeError, match="closed"):
        s.call(sum, [1])
