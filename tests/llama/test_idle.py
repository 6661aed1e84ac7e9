"""``idle.IdleThread``: calls run on one thread of Linux's idle CPU class, and threads it starts (ggml's compute
team) are of that class too, while the caller's stay ordinary."""

from __future__ import annotations

import os
import threading

import pytest

from meshgate.backends.llama_cpp.idle import IdleThread


def _policy() -> int:
    return os.sched_getscheduler(0)  # the calling thread's, on Linux


def _started_policy() -> int:
    """The class of a thread started from the calling one (as OpenMP starts a team on a thread's first region)."""
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(_policy()))
    thread.start()
    thread.join()
    return seen[0]


@pytest.fixture
def idle():
    thread = IdleThread()
    yield thread
    thread.close()


def test_calls_run_at_idle_class_and_so_do_the_threads_they_start(idle):
    assert idle.idle == "SCHED_IDLE"
    assert idle.call(_policy) == os.SCHED_IDLE
    assert idle.call(_started_policy) == os.SCHED_IDLE
    assert _policy() == os.SCHED_OTHER and _started_policy() == os.SCHED_OTHER  # the caller's class is its own


def test_a_call_hands_back_its_result_or_raises_its_error_on_the_caller(idle):
    assert idle.call(sum, [1, 2, 3]) == 6
    with pytest.raises(ZeroDivisionError):
        idle.call(lambda: 1 / 0)
    assert idle.call(pow, 2, 10) == 1024  # the thread goes on after an error
    assert threading.get_native_id() != idle.call(threading.get_native_id)
