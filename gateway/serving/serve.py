"""What the client reads of a generation that has started (``served``): its events, resumed on another replica
when its own fails (``gateway.serving.resume``), relayed (the slot freed at the end, telemetry, the shared load's
tally, a key's token budget), and a stop the model's stored defaults added made a plain end of turn.

Imports the serving modules below the dispatcher; the dispatcher imports this.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import msgspec

from meshgate.gateway.cluster.loads import LoadBoard
from meshgate.gateway.cluster.records import Instance
from meshgate.gateway.serving import streams
from meshgate.gateway.serving.model_defaults import end_turn_at_default_stops
from meshgate.gateway.serving.resume import Resume, resumable
from meshgate.gateway.serving.start import Job, Started
from meshgate.gateway.serving.streams import EventStream
from meshgate.gateway.telemetry import record as telemetry
from meshgate.protocols.model import Event, GatewayError, Usage

__all__ = ["Restart", "served"]

Restart = Callable[[Job, tuple[Instance, GatewayError]], Awaitable[Started]]
"""Starts a job again on another replica, from the one that failed (and why): the dispatcher's retry loop."""


def served(
    job: Job,
    started: Started,
    *,
    restart: Restart,
    loads: LoadBoard | None,
    resume_wait: float,
    keepalive: float,
    on_usage: Callable[[Usage], None] | None,
    end_turn: bool,
) -> EventStream:
    """``started``'s events as the client reads them; resumed through ``restart`` within ``resume_wait`` seconds
    (0: never) when its replica fails, with a keep-alive every ``keepalive`` seconds meanwhile."""
    telemetry.note_served(job.card.name, started.instance.id)
    events = started.events
    if resume_wait > 0:
        events = resumable(
            events, _resumer(job, started, restart), wait=resume_wait, keepalive=keepalive, seen=started.first
        )
    tally = loads.tally(started.instance.id) if loads is not None else None
    events = streams.relay(
        started.first, events, started.ticket.release, record=telemetry.current(), tally=tally, on_usage=on_usage
    )
    if end_turn:
        events = end_turn_at_default_stops(events)
    return EventStream(events, started.close)


def _resumer(job: Job, started: Started, restart: Restart) -> Resume:
    """``job``'s ``Resume``: ``restart`` from the replica that broke off, with the request as it was sent and the
    tokens already sent as its ``resume``."""
    serving = [started.instance]

    async def resume(tokens: tuple[int, ...], error: GatewayError) -> AsyncIterator[Event]:
        # the lost stream's slot is free now: re-placed, its replica keeps its id and gate, and the resume must
        # not queue behind its own ticket (a moved stream's ticket is freed when ``resumable`` closes it)
        started.ticket.release()
        again = replace(job, request=msgspec.structs.replace(started.request, resume=tokens), fitted=True)
        moved = await restart(again, (serving[0], error))
        serving[0] = moved.instance
        telemetry.note_served(job.card.name, moved.instance.id)
        return EventStream(streams.released(moved.first, moved.events, moved.ticket.release), moved.close)

    return resume
