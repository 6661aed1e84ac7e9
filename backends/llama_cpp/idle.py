"""A thread that runs llama.cpp's decodes at the CPU's idle priority, for steps of batch-class jobs only.

Beside a running batch, llama.cpp's compute threads hold every core the runner was given. A person's request
then waits for a core at every hop on its way in (the client, the gateway, the runner's HTTP handler and
tokenizer), and its first token waits again on its way out: on 2 cores, 44-47 ms between the client and the
runner against 21-31 ms with no batch (``benchmarks/tiers.py``). Decodes of batch jobs only, and their prompt
chunks, run here instead, on a thread that asked Linux for ``SCHED_IDLE``: any ordinary thread that wakes
preempts them at once, and they use every cycle nothing else wants. ggml's compute threads come from the thread
that calls ``llama_decode`` (an OpenMP build gives each calling thread its own team, created on its first
parallel region; a build without OpenMP makes them per call) and inherit its policy, so the whole team is idle
class, while the scheduler's own thread, which decodes every step that holds an interactive job, keeps its team
at the ordinary class.

Linux lets a thread enter ``SCHED_IDLE`` without privileges but not leave it (unless ``RLIMIT_NICE`` allows),
hence a thread of its own rather than a switch. Where that is refused (a seccomp profile), the thread takes nice 19
instead; where the OS has neither per thread (macOS: ``setpriority`` would lower the whole runner) it stays as it
is. ``idle`` says which it got.

Starvation: idle class gets a core only when no ordinary thread wants it. Within a runner that is what the
tiers ask (its own interactive steps run on the ordinary team; aging admits a paused batch job, it does not need
CPU from other work); on a node whose cores other busy processes share, batch steps wait for them too, so the
runner takes ``--batch-cpu normal`` to turn this off.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["IdleThread"]


class IdleThread:
    """Runs ``call``'s function on one thread of idle CPU priority and hands back its result (one caller at a
    time: the scheduler's thread, which waits for it)."""

    def __init__(self, name: str = "llama-batch-decode") -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[bool, Any]] = queue.SimpleQueue()
        self.idle = ""  # what the OS granted: "SCHED_IDLE", "nice 19", or "" (nothing)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._results.get()  # its priority set before the first call

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        self._calls.put((fn, args))
        ok, value = self._results.get()
        if not ok:
            raise value
        return value

    def close(self) -> None:
        self._calls.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        self.idle = _lower()
        self._results.put((True, None))
        while (item := self._calls.get()) is not None:
            fn, args = item
            try:
                self._results.put((True, fn(*args)))
            except BaseException as exc:  # handed to the caller, which raises it on its own thread
                self._results.put((False, exc))


def _lower() -> str:
    """Put the calling thread in the lowest CPU class the OS lets it enter; what it got."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return ""
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))  # 0: the calling thread, on Linux
        return "SCHED_IDLE"
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice 19"
    except OSError:
        return ""
