"""The plumbing between a runner's event stream and the client's: starting a generation in its slot, relaying its
events, freeing the slot, closing streams.

A generation holds a queue slot (``admission.Ticket``) from its start until its stream ends: ``begin`` waits for
the slot and takes the first event; ``chain`` (a fresh generation) and ``released`` (a resumed one) free the slot
at the terminal event, so it is free before the client reads the end, and again (idempotently) when the stream is
closed or dropped unstarted (``on_drop``: a generator closed before it started never runs its ``finally``).
``relay`` turns an unexpected exception into a ``Failed`` event and notes on the request's telemetry record
what the stream shows (first token, usage, end: ``telemetry.observe``); ``metered`` hands the last ``Usage``
to a key's token budget. ``aclose`` and ``closing`` close any async iterator.

Imports protocols, the telemetry record and the shared load's ``Tally`` only.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Callable
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

__all__ = ["aclose", "begin", "chain", "closing", "metered", "on_drop", "relay", "released"]

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


def chain(
    first: Event,
    rest: AsyncIterator[Event],
    release: Callable[[], None],
    on_usage: Callable[[Usage], None] | None = None,
    served: tuple[str, str] | None = None,
    tally: Tally | None = None,
) -> AsyncIterator[Event]:
    """``first`` then ``rest``; ``release`` (the queue slot) when it ends, is closed, or is dropped unstarted;
    ``on_usage`` with the last ``Usage`` seen when it ends or is closed. ``served`` (model, instance id) and what
    the stream shows go to the request's telemetry record, if it has one."""
    record = telemetry.current()
    if record is not None and served is not None:
        record.model, record.instance = served
    stream = relay(first, rest, release, record, tally)
    if on_usage is not None:
        stream = metered(stream, on_usage)
    on_drop(stream, release)  # a generator closed before it started never runs its ``finally``
    return stream


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


def on_drop(stream: AsyncIterator[Event], release: Callable[[], None]) -> None:
    """Call ``release`` when ``stream`` is garbage (not at interpreter exit, when the loop is gone)."""
    weakref.finalize(stream, release).atexit = False


_TERMINAL: frozenset[type] = frozenset({Finished, Failed})


async def relay(
    first: Event,
    rest: AsyncIterator[Event],
    release: Callable[[], None],
    record: telemetry.RequestRecord | None = None,
    tally: Tally | None = None,
) -> AsyncIterator[Event]:
    """``first`` then ``rest``; an unexpected exception becomes a ``Failed`` event, never a crash. With a
    ``record``, the first token's time, the last ``Usage`` and the end go into it: one set lookup per event.

    The events not watched (the deltas after the first token) are counted with one integer increment: a stream
    that ends without finishing (its client went away, or it failed) never got its final ``Usage``, so its record
    then says how many deltas were relayed (``_note_relayed``)."""
    watch: frozenset[type] = observe.UNTIL_FIRST_TOKEN if record is not None else frozenset()
    unwatched = 0  # events relayed without a look: after the first token, each a delta (about a token)
    counts = tally or Tally()  # the shared load's counts (``loads``), live: tokens/s while the stream runs
    counts.tokens += 1  # the first event
    try:
        async with closing(rest):
            if type(first) in watch:
                watch = observe.note(record, first)
            yield first
            try:
                async for event in rest:
                    if type(event) in watch:
                        watch = observe.note(record, event)
                    else:
                        unwatched += 1
                        counts.tokens += 1
                    if type(event) in _TERMINAL:
                        release()  # the generation is over: its slot is free before the client reads the end
                    yield event
            except GatewayError as exc:
                failed = Failed(error=exc.info())
                observe.note(record, failed)
                yield failed
            except Exception as exc:
                log.exception("backend stream raised")
                failed = Failed(error=GatewayError(f"internal error: {exc!r}").info())
                observe.note(record, failed)
                yield failed
    finally:
        release()
        if record is not None:
            observe.note_relayed(record, unwatched)
        if record is not None and record.cached_tokens:
            counts.prefix_hits += 1


async def metered(events: AsyncIterator[Event], on_usage: Callable[[Usage], None]) -> AsyncIterator[Event]:
    """``events`` unchanged; the last ``Usage`` among them goes to ``on_usage`` once: at the terminal event (a
    reader may stop there), or when the stream is closed early."""
    usage: Usage | None = None
    try:
        async with closing(events):
            async for event in events:
                if isinstance(event, Usage):
                    usage = event
                elif isinstance(event, Finished | Failed) and usage is not None:
                    on_usage(usage)
                    usage = None
                yield event
    finally:
        if usage is not None:
            on_usage(usage)


async def aclose(stream: AsyncIterator[Any]) -> None:
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
