"""Shared load: what every gateway runs and queues on every instance, for routing and for the dashboard.

Each gateway keeps a ``LoadBoard``. Every ``PERIOD`` seconds (``IDLE_PERIOD`` while it serves nothing) it
publishes one ``LoadReport`` per instance it sends generations to (its admission gate's running and queued
counts, the tokens it streamed and the prefix hits it saw) and reads every gateway's reports back (one store round
trip each way). A router asks ``load(id)``: the other gateways' running + queued as of the last read (at most
about ``IDLE_PERIOD`` old, ``PERIOD`` while this gateway is busy)
plus this gateway's own, live: its admission gate's counts and the generations routed to the instance that have
not reached the gate yet (``routed`` / ``settled``: between the two a request may wait for a model to load or
its prompt to be counted, and a burst routed meanwhile must see it). Reports live in the state store's ``loads``
hash (``gateway.cluster.store``); a gateway that stops publishing drops out after ``store.LOAD_STALE`` seconds.

``view(id)`` gives the cluster-wide figures shown by ``/cluster``, ``meshgate ps`` and ``/ui``: running,
queued, tokens/s (the change of the summed token counts over the last ``RATE_WINDOW`` seconds) and prefix hits.

Imports the standard library, msgspec and the store modules; the admission gate it reads is the ``Queues`` it is
given (``gateway.serving.admission.Admission``), so the control room never imports the serving one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

import msgspec

from meshgate.gateway.cluster.records import LoadReport
from meshgate.gateway.cluster.store import StateStore

__all__ = ["IDLE_PERIOD", "PERIOD", "RATE_WINDOW", "LoadBoard", "Queues", "ReplicaLoad", "Tally"]

log = logging.getLogger("meshgate.loads")


class QueueCounts(Protocol):
    """One instance's queue at this gateway: requests generating and requests waiting."""

    @property
    def active(self) -> int: ...

    @property
    def queued(self) -> int: ...


class Queues(Protocol):
    """What the board reads of this gateway's admission gate, per instance."""

    def load(self, instance_id: str) -> QueueCounts: ...

    def loads(self) -> Mapping[str, QueueCounts]: ...

    def forget(self, live: set[str]) -> None: ...


PERIOD = 0.25
"""Seconds between a gateway's publications (and reads) of the shared load while it has requests in flight."""
IDLE_PERIOD = 1.0
"""The same while it has none: its reports stay fresh (``store.LOAD_STALE``) and what it reads of the others is
at most about a second old, at a quarter of the wake-ups."""
RATE_WINDOW = 3.0
"""Seconds of token counts that one tokens/s figure spans."""
PENDING_LIMIT = 60.0
"""Seconds after which a routed request that never settled (its client left before it started) stops counting."""


class ReplicaLoad(msgspec.Struct, frozen=True):
    """An instance's load across every gateway: generations running and waiting for a slot, tokens per second
    streamed to clients, and generations whose prompt reused a prefix the runner held."""

    running: int = 0
    queued: int = 0
    tokens_per_s: float = 0.0
    prefix_hits: int = 0


class Tally:
    """This gateway's running counts for one instance, bumped by the stream relay."""

    __slots__ = ("prefix_hits", "tokens")

    def __init__(self) -> None:
        self.tokens = 0
        self.prefix_hits = 0


class LoadBoard:
    """This gateway's view of every instance's load, and its share of it published for the others."""

    def __init__(
        self,
        store: StateStore,
        admission: Queues,
        *,
        gateway_id: str | None = None,
        live: Callable[[], set[str]] | None = None,
    ) -> None:
        self.store = store
        self.admission = admission
        self.live = live  # the instance ids that exist (the gateway's view); what concerns others is forgotten
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]
        self._tallies: dict[str, Tally] = {}
        self._others: dict[str, tuple[int, int]] = {}  # instance id -> (running, queued) of the other gateways
        self._totals: dict[str, tuple[int, int]] = {}  # instance id -> (tokens, prefix hits), every gateway
        self._history: dict[str, deque[tuple[float, int]]] = {}  # instance id -> (time, tokens) samples
        self._sent: dict[str, LoadReport] = {}  # this gateway's reports as last published
        self._pending: dict[str, deque[float]] = {}  # instance id -> when each routed, unsettled request was routed
        self._task: asyncio.Task[None] | None = None

    def tally(self, instance_id: str) -> Tally:
        found = self._tallies.get(instance_id)
        if found is None:
            found = self._tallies[instance_id] = Tally()
        return found

    def load(self, instance_id: str) -> int:
        """Generations running and queued on ``instance_id``, every gateway's (this one's live, routed included)."""
        own = self.admission.load(instance_id)
        running, queued = self._others.get(instance_id, (0, 0))
        pending = self._pending.get(instance_id)
        if pending:
            while pending and time.monotonic() - pending[0] > PENDING_LIMIT:
                pending.popleft()
        return running + queued + own.active + own.queued + (len(pending) if pending else 0)

    def routed(self, instance_id: str) -> None:
        """A generation was routed to ``instance_id``; it counts as load until ``settled``."""
        self._pending.setdefault(instance_id, deque()).append(time.monotonic())

    def settled(self, instance_id: str) -> None:
        """A routed generation reached the instance's gate (which counts it from now on) or ended before."""
        pending = self._pending.get(instance_id)
        if pending:
            pending.popleft()

    def forget(self, live: set[str]) -> None:
        """Keep only what concerns the instances in ``live`` (the ones that exist): this gateway's tallies, its
        routed-but-unsettled counts and its admission gates of the others go (a stream still running on a deleted
        instance keeps its own tally object)."""
        for table in (self._tallies, self._pending):
            for instance_id in [i for i in table if i not in live]:
                del table[instance_id]
        self.admission.forget(live)

    def view(self, instance_id: str) -> ReplicaLoad:
        own = self.admission.load(instance_id)
        running, queued = self._others.get(instance_id, (0, 0))
        _, hits = self._totals.get(instance_id, (0, 0))
        return ReplicaLoad(
            running=running + own.active,
            queued=queued + own.queued,
            tokens_per_s=round(self._rate(instance_id), 1),
            prefix_hits=hits,
        )

    def _rate(self, instance_id: str) -> float:
        samples = self._history.get(instance_id)
        if not samples or len(samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = samples[0], samples[-1]
        return max(0.0, (n1 - n0) / (t1 - t0)) if t1 > t0 else 0.0

    # ------------------------------------------------------------------------------------------- the loop

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="loads")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.store.put_loads(self.gateway_id, {}, gone=set(self._sent))

    async def _loop(self) -> None:
        while True:
            if self.live is not None:
                self.forget(self.live())
            try:
                await self.sync()
            except Exception as exc:  # Redis away for a moment: routing uses the last snapshot meanwhile
                log.warning("could not share load (%r); retrying", exc)
            busy = any(r.running or r.queued for r in self._sent.values()) or any(self._pending.values())
            await asyncio.sleep(PERIOD if busy else IDLE_PERIOD)

    async def sync(self, live: set[str] | None = None) -> None:
        """Publish this gateway's reports and read everyone's (one pass of the loop). ``live``: the instance ids
        that still exist, when known; reports on others are withdrawn."""
        now = time.time()
        loads = self.admission.loads()
        ids = set(loads) | set(self._tallies)
        if live is not None:
            ids &= live
        reports = {}
        for instance_id in ids:
            load, tally = loads.get(instance_id), self._tallies.get(instance_id)
            reports[instance_id] = LoadReport(
                running=load.active if load else 0,
                queued=load.queued if load else 0,
                tokens=tally.tokens if tally else 0,
                prefix_hits=tally.prefix_hits if tally else 0,
                at=now,
            )
        gone = set(self._sent) - set(reports)
        await self.store.put_loads(self.gateway_id, reports, gone=gone)
        self._sent = reports
        everyone = await self.store.loads()
        self._absorb(everyone, now)

    def _absorb(self, everyone: dict[str, list[LoadReport]], now: float) -> None:
        others: dict[str, tuple[int, int]] = {}
        totals: dict[str, tuple[int, int]] = {}
        for instance_id, reports in everyone.items():
            running = sum(r.running for r in reports)
            queued = sum(r.queued for r in reports)
            mine = self._sent.get(instance_id, LoadReport())  # this gateway's own share is counted live
            others[instance_id] = (max(0, running - mine.running), max(0, queued - mine.queued))
            totals[instance_id] = (sum(r.tokens for r in reports), sum(r.prefix_hits for r in reports))
            samples = self._history.setdefault(instance_id, deque())
            samples.append((now, totals[instance_id][0]))
            while samples and now - samples[0][0] > RATE_WINDOW:
                samples.popleft()
        for instance_id in set(self._history) - set(everyone):
            del self._history[instance_id]
        self._others, self._totals = others, totals
