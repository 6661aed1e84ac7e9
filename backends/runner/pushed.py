"""Streams an engine pushes to the runner's event loop: one wake a decode step for all of them, no thread a stream.

An engine with ``open_stream(request, cancel, wake)`` (the llama.cpp one: ``backends.llama_cpp.relay.Pushed``) is
read here instead of through a thread that iterates its ``generate``. ``open_stream`` runs on a thread (it may read
a KV tier entry from disk or fetch one from a peer) and returns a stream with ``opening`` (the first event),
``poll()`` (the events ready now, and whether the stream has ended; never waits) and ``close()``. The engine calls
``wake`` from its decode thread once per step in which any stream got tokens; ``Waker`` turns that into one
callback on this loop, which resolves every stream's pending wait, and each stream polls. With a thread a
stream, a token cost two hand-offs (the decode thread waking the request's thread, that thread waking the loop);
here a step costs one, whatever the number of streams.

Runs in runner processes; imports protocols only.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from meshgate.protocols.model import (
    BackendProtocolError,
    Event,
    Failed,
    Finished,
    GatewayError,
    InvalidRequest,
    Request,
    TextDelta,
)

__all__ = ["POLL", "Waker", "run_pushed"]

POLL = 0.1
"""Seconds a stream waits for a wake at most before it polls anyway (cancels, keep-alives while it prefills)."""


class Waker:
    """One event loop's streams, woken together: ``wake`` from any thread, ``wait`` on the loop.

    ``interval`` (seconds, ``LlamaEngine.stream_interval``): after the loop has run a wake, wakes that come within
    ``interval`` are held until it has passed and then run as one (the timer is the loop's own, so a held wake
    costs the engine's thread a lock and nothing else: no cross-thread wake, no socket write, no read at the
    gateway or the client). ``wake(now=True)`` (a stream's first token, its end) is never held. 0: every wake runs
    as soon as the loop can."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float = 0.0) -> None:
        self.loop = loop
        self.interval = max(0.0, interval)
        self._waiting: list[asyncio.Future[None]] = []
        self._lock = threading.Lock()
        self._scheduled = False  # a callback to ``_resolve`` is on its way to the loop
        self._holding = False  # the interval after the last resolve has not passed: wakes are held
        self._held = False  # a wake came while holding

    def wake(self, now: bool = False) -> None:
        """Called by the engine's thread: the waiting streams poll (one callback, however often it is called before
        the loop runs it; held while ``interval`` has not passed since the last unless ``now``)."""
        with self._lock:
            if self._scheduled:
                return
            if self._holding and not now:
                self._held = True
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        with self._lock:
            self._scheduled = self._held = False
            hold = self.interval > 0 and not self._holding
            self._holding = self._holding or hold
        if hold:
            self.loop.call_later(self.interval, self._release)
        waiting, self._waiting = self._waiting, []
        for future in waiting:
            if not future.done():
                future.set_result(None)

    def _release(self) -> None:
        """The interval has passed: run the wakes held meanwhile (and hold again), or stop holding."""
        with self._lock:
            self._holding = False
            held = self._held and not self._scheduled
        if held:
            self._resolve()

    def armed(self) -> asyncio.Future[None]:
        """A future the next wake resolves; take it *before* polling, so a wake that comes between the poll and the
        wait is not missed."""
        future = self.loop.create_future()
        self._waiting.append(future)
        return future

    async def wait(self, future: asyncio.Future[None], timeout: float) -> None:
        timer = self.loop.call_later(timeout, _resolve_once, future)
        try:
            await future
        finally:
            timer.cancel()


def _resolve_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def run_pushed(
    engine: Any, request: Request, cancel: threading.Event, waker: Waker
) -> AsyncIterator[list[Event]]:
    """``request``'s events in lists, as ``server._run_in_thread`` yields them: the last list ends in ``Finished``
    or ``Failed`` (none when the client went away)."""
    try:
        stream = await asyncio.to_thread(engine.open_stream, request, cancel, waker.wake)
    except GatewayError as exc:
        yield [Failed(error=exc.info())]
        return
    except Exception as exc:  # the runtime's own failure: report it, keep the runner serving
        wrapped = InvalidRequest(str(exc)) if isinstance(exc, ValueError) else GatewayError(repr(exc))
        yield [Failed(error=wrapped.info())]
        return
    try:
        yield [stream.opening]
        while True:
            armed = waker.armed()
            try:
                events, done = stream.poll()
            except Exception as exc:  # a bug of the engine's: this stream fails, the runner goes on
                yield [Failed(error=GatewayError(repr(exc)).info())]
                return
            if events:
                yield _joined(events)
            if done:
                if not events or not isinstance(events[-1], (Failed, Finished)):
                    if not cancel.is_set():
                        yield [Failed(error=BackendProtocolError("the engine stopped without finishing").info())]
                return
            if cancel.is_set():
                return
            await waker.wait(armed, POLL)
    finally:
        cancel.set()
        stream.close()


def _joined(events: list[Event]) -> list[Event]:
    """``events`` with each run of text deltas made one (their text, tokens and log probabilities in order): a poll
    that found several tokens sends one delta, which the gateway and the client then handle once."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if (
            isinstance(event, TextDelta)
            and isinstance(last, TextDelta)
            and (event.logprobs is None) == (last.logprobs is None)
        ):
            logprobs = None if last.logprobs is None else last.logprobs + (event.logprobs or ())
            out[-1] = TextDelta(text=last.text + event.text, logprobs=logprobs, tokens=last.tokens + event.tokens)
        else:
            out.append(event)
    return out
