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
)

__all__ = ["POLL", "Waker", "run_pushed"]

POLL = 0.1
"""Seconds a stream waits for a wake at most before it polls anyway (cancels, keep-alives while it prefills)."""


class Waker:
    """One event loop's streams, woken together: ``wake`` from any thread, ``wait`` on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._waiting: list[asyncio.Future[None]] = []
        self._lock = threading.Lock()
        self._scheduled = False

    def wake(self) -> None:
        """Called by the engine's thread: the waiting streams poll (one callback, however often it is called before
        the loop runs it)."""
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        with self._lock:
            self._scheduled = False
        waiting, self._waiting = self._waiting, []
        for future in waiting:
            if not future.done():
                future.set_result(None)

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
                yield events
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
