"""Virtual time for the simulator: an asyncio loop whose clock moves only when every task waits, and the wall and
monotonic clocks of each simulated machine (with its own skew) read from it.

``VirtualLoop`` is a ``SelectorEventLoop`` whose selector never blocks: when the loop would wait ``t`` seconds
for its next timer, the clock jumps ``t`` ahead, so an episode of minutes runs in milliseconds and the same
seed gives the same interleaving. Nothing in an episode may wait on real I/O or a thread (a selector with no
timer to wait for raises ``Stalled``: every task waits on something that will never come).

``machine(name)`` sets which machine the code running in the current task (and the tasks it creates) is on;
``time.time()`` and ``time.monotonic()`` answer that machine's clocks while ``clocks()`` is active. (Looptime,
the kept library for fake loop time, warps only ``loop.time()``: the code under test reads ``time.time()`` and
``time.monotonic()`` itself, and each machine needs a clock of its own, so this is the smallest loop that does.)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import selectors
import time
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

EPOCH = 1_800_000_000.0
"""Unix time at virtual zero."""

_machine: contextvars.ContextVar[str] = contextvars.ContextVar("sim_machine", default="")


class Stalled(RuntimeError):
    """Every task waits and no timer is set: the episode can never go on."""


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.skew: dict[str, float] = {}  # machine -> seconds its wall clock is ahead of the true time
        self.boot: dict[str, float] = {}  # machine -> its monotonic clock's reading at virtual zero

    def wall(self) -> float:
        return EPOCH + self.now + self.skew.get(_machine.get(), 0.0)

    def monotonic(self) -> float:
        return self.now + self.boot.get(_machine.get(), 0.0)


class _Selector(selectors.BaseSelector):
    def __init__(self, clock: VirtualClock) -> None:
        self._clock = clock
        self._keys: dict[int, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        fd = fileobj if isinstance(fileobj, int) else fileobj.fileno()
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj if isinstance(fileobj, int) else fileobj.fileno())

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Stalled("every task waits and no timer is set")
        self._clock.now += timeout
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return MappingProxyType(self._keys)

    def close(self) -> None:
        self._keys.clear()


class VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        super().__init__(selector=_Selector(clock))
        self._clock_resolution = 1e-6  # a timer due within a microsecond of the jump is due

    def time(self) -> float:
        return self.clock.now


@contextlib.contextmanager
def machine(name: str) -> Iterator[None]:
    """Code in this block, and every task it creates, runs on machine ``name``."""
    token = _machine.set(name)
    try:
        yield
    finally:
        _machine.reset(token)


def now() -> float:
    """The true (virtual) time, which no machine's clock shows exactly."""
    return asyncio.get_running_loop().time()


def current_machine() -> str:
    return _machine.get()


def on(name: str) -> contextvars.Context:
    """A context on machine ``name`` (for ``loop.create_task(..., context=on(name))``)."""
    with machine(name):
        return contextvars.copy_context()


@contextlib.contextmanager
def clocks(clock: VirtualClock) -> Iterator[None]:
    """``time.time`` and ``time.monotonic`` read ``clock`` (as the current machine sees it) in this block."""
    saved = time.time, time.monotonic
    time.time, time.monotonic = clock.wall, clock.monotonic  # type: ignore[assignment]
    try:
        yield
    finally:
        time.time, time.monotonic = saved  # type: ignore[assignment]
