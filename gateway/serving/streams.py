"""The plumbing between a runner's event stream and the client's: starting a generation in its slot, relaying its
events, owning what must be freed when the stream ends, closing streams.

A generation holds a queue slot (``admission.Ticket``) from its start until its stream ends: ``begin`` waits for
the slot and takes the first event; ``relay`` (a fresh generation) and ``released`` (a resumed one) free the slot
at the terminal event, so it is free before the client reads the end. What a stream holds is freed by closing it:
the dispatcher hands out an ``EventStream``, whose ``aclose`` closes the events and runs its cleanups (free the
slot, close the runner's stream, stop a start still under way) whether or not anyone began reading it. Every
reader closes what it opened (the HTTP response when it is done, ``collect_or_cancel``, the tests): no finalizer
is needed to give a slot back.

``relay`` also turns an unexpected exception into a ``Failed`` event, notes on the request's telemetry record what
the stream shows (first token, usage, end: ``telemetry.observe``), counts tokens for the shared load and hands the
last ``Usage`` to a key's token budget. ``aclose`` and ``closing`` close any async iterator.

Imports protocols, the telemetry record and the shared load's ``Tally`` only.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from meshgate.backends.base import Runner
from meshgate.gateway.cluster.loads import Tally
from meshgate.gateway.serving.admission import Ticket
from meshgate.gateway.telemetry import observe
from meshgate.gateway.telemetry import record as telemetry
from meshgate.protocols.model import (
    Event,
    Failed,
    Finished,
    GatewayError,
    Request,
    Usage,
)

__all__ = ["EventStream", "aclose", "begin", "closing", "relay", "released"]

log = logging.getLogger("meshgate.dispatch")
_Stream = TypeVar("_Stream", bound=AsyncIterator[Any])


async def begin(runner: Runner, request: Request, ticket: Ticket) -> tuple[Event, AsyncIterator[Event]]:
    """Wait for ``ticket``'s turn and start ``request`` on ``runner``: its first event and the rest. When the
    first is ``Failed`` the stream is closed and the slot freed before they are returned."""
    try:
        await ticket.wait()
        events = runner.generate(request)
        first = await anext(events)
    except BaseException:
        ticket.release()
        raise
    if isinstance(first, Failed):
        await aclose(events)
        ticket.release()
    return first, events


async def released(first: Event, rest: AsyncIterator[Event], release: Callable[[], None]) -> AsyncIterator[Event]:
    """``first`` then ``rest``; ``release`` at the terminal event (the slot is free before the client reads the
    end) and when the stream is closed."""
    try:
        async with closing(rest):
            yield first
            async for event in rest:
                if type(event) in _TERMINAL:
                    release()
                yield event
    finally:
        release()


_TERMINAL: frozenset[type] = frozenset({Finished, Failed})
_USAGE: frozenset[type] = frozenset({Usage})


async def relay(
    first: Event,
    rest: AsyncIterator[Event],
    release: Callable[[], None],
    *,
    record: telemetry.RequestRecord | None = None,
    tally: Tally | None = None,
    on_usage: Callable[[Usage], None] | None = None,
) -> AsyncIterator[Event]:
    """``first`` then ``rest``; ``release`` (the slot) at the terminal event and when the stream is closed; an
    unexpected exception becomes a ``Failed`` event, never a crash. With a ``record``, the first token's time, the
    last ``Usage`` and the end go into it; ``on_usage`` gets the last ``Usage`` once, at the terminal event (a
    reader may stop there) or when the stream is closed early. One set lookup per event.

    The events not watched (the deltas after the first token) are counted with one integer increment: a stream
    that ends without finishing (its client went away, or it failed) never got its final ``Usage``, so its record
    then says how many deltas were relayed (``observe.note_relayed``)."""
    # what to look at: the record's events (``observe``'s sets, ``Usage`` among them), else ``Usage`` for a budget
    watch: frozenset[type] = (
        observe.UNTIL_FIRST_TOKEN if record is not None else _USAGE if on_usage is not None else frozenset()
    )
    unwatched = 0  # events relayed without a look: after the first token, each a delta (about a token)
    counts = tally or Tally()  # the shared load's counts (``loads``), live: tokens/s while the stream runs
    counts.tokens += 1  # the first event
    usage: Usage | None = None  # the last one, not yet handed to ``on_usage``

    def seen(event: Event) -> frozenset[type]:
        nonlocal usage
        if isinstance(event, Usage):
            usage = event
        return watch if record is None else observe.note(record, event)

    try:
        async with closing(rest):
            if type(first) in watch:
                watch = seen(first)
            yield first
            try:
                async for event in rest:
                    if type(event) in watch:
                        watch = seen(event)
                    else:
                        unwatched += 1
                        counts.tokens += 1
                    if type(event) in _TERMINAL:
                        release()  # the generation is over: its slot is free before the client reads the end
                        if usage is not None and on_usage is not None:
                            on_usage(usage)
                            usage = None
                    yield event
            except GatewayError as exc:
                failed = Failed(error=exc.info())
                seen(failed)
                yield failed
            except Exception as exc:
                log.exception("backend stream raised")
                failed = Failed(error=GatewayError(f"internal error: {exc!r}").info())
                seen(failed)
                yield failed
    finally:
        release()
        if usage is not None and on_usage is not None:
            on_usage(usage)
        if record is not None:
            observe.note_relayed(record, unwatched)
        if record is not None and record.cached_tokens:
            counts.prefix_hits += 1


Cleanup = Callable[[], Awaitable[None] | None]


class EventStream:
    """A generation's events as the client reads them, and what is freed when the stream is closed.

    ``aclose`` closes ``events`` and then runs each cleanup once (a slot's release, the runner's stream, a start
    still waiting for its turn), in order, whether the stream was read to its end, in part or not at all: an
    async generator closed before it started never runs its ``finally``, so what it would free is listed here.
    """

    __slots__ = ("_cleanups", "_events")

    def __init__(self, events: AsyncIterator[Event], *cleanups: Cleanup) -> None:
        self._events = events
        self._cleanups = list(cleanups)

    def __aiter__(self) -> EventStream:
        return self

    def __anext__(self) -> Awaitable[Event]:
        return self._events.__anext__()

    async def aclose(self) -> None:
        cleanups, self._cleanups = self._cleanups, []
        try:
            await aclose(self._events)
        finally:
            for cleanup in cleanups:
                done = cleanup()
                if inspect.isawaitable(done):
                    await done


async def aclose(stream: object) -> None:
    """Close ``stream`` if it can be closed (an async generator can; an iterator object may not)."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


@contextlib.asynccontextmanager
async def closing(stream: _Stream) -> AsyncIterator[_Stream]:
    """``contextlib.aclosing`` for any async iterator, as ``Runner.generate`` promises only iteration."""
    try:
        yield stream
    finally:
        await aclose(stream)
