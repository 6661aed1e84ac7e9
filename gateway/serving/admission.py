"""Admission: a bounded, fair queue per instance in front of its runner.

One gateway has at most ``parallel`` generations in flight on an instance (the runner batches that many
sequences); up to ``max_queue`` more wait, and a request beyond that is refused at once with ``Overloaded``
(never left hanging). A waiting request is granted the next free slot in turn across callers (an API key, or the
client address when there is none): the waiting caller with the fewest requests running goes first, ties in
round-robin order, so a caller with 50 queued requests cannot starve one with a single request.

    ticket = admission.enter(instance_id, caller)   # granted at once, waiting, or Overloaded
    await ticket.wait()                             # cancelled while waiting: it leaves the queue
    try: ... generate ...
    finally: ticket.release()                       # idempotent; grants the next waiting request

Queues are per gateway process (as the runner's batch is per instance): with several gateway replicas each keeps
its own. Embeddings and token counts are not queued. Imports the standard library, msgspec and
``protocols.model`` only; no I/O.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque

import msgspec

from meshgate.protocols.model import Overloaded

__all__ = ["SHARED_SLOTS", "Admission", "Load", "Ticket"]

SHARED_SLOTS = 4
"""Generations one gateway sends at once to a runner whose placement declares no slots of its own."""


class Load(msgspec.Struct, frozen=True):
    """An instance's queue as this gateway sees it: requests generating, requests waiting, and the bounds."""

    active: int = 0
    queued: int = 0
    parallel: int = 0
    max_queue: int = 0


class Ticket:
    """One request's place at an instance: ``granted`` holds a slot; otherwise it waits in its caller's line."""

    def __init__(self, gate: _Gate, caller: str) -> None:
        self.caller = caller
        self.granted = False
        self.released = False
        self.granted_at = 0.0
        self._gate = gate
        self._turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def wait(self) -> None:
        """Return once granted; cancelled while waiting, the ticket leaves the queue (or frees the slot it was just
        given)."""
        if self.granted:
            return
        try:
            await self._turn
        except asyncio.CancelledError:
            self.release()
            raise

    def release(self) -> None:
        """Free the slot (or the place in the queue); the next waiting request is granted. Safe to call twice."""
        if not self.released:
            self.released = True
            self._gate.leave(self)

    def _grant(self) -> None:
        self.granted, self.granted_at = True, time.monotonic()
        if not self._turn.done():
            self._turn.set_result(None)


class _Gate:
    """One instance's slots and its callers' lines."""

    def __init__(self, parallel: int, max_queue: int) -> None:
        self.parallel = parallel
        self.max_queue = max_queue
        self.active = 0
        self.queued = 0
        self.running: dict[str, int] = {}  # caller -> granted tickets
        self.lines: OrderedDict[str, deque[Ticket]] = OrderedDict()  # caller -> waiting tickets, in turn order
        self.mean_hold = 0.0  # seconds a slot is held, smoothed: the basis of retry-after

    def enter(self, caller: str) -> Ticket:
        ticket = Ticket(self, caller)
        if self.active < self.parallel and not self.queued:
            self._grant(ticket)
        elif self.queued >= self.max_queue:
            raise Overloaded(
                f"the model is busy: {self.active} requests running and {self.queued} waiting (at most "
                f"{self.max_queue}); retry shortly",
                retry_after=self.retry_after(),
            )
        else:
            self.lines.setdefault(caller, deque()).append(ticket)
            self.queued += 1
        return ticket

    def leave(self, ticket: Ticket) -> None:
        if ticket.granted:
            self.active -= 1
            self.running[ticket.caller] -= 1
            if not self.running[ticket.caller]:
                del self.running[ticket.caller]
            held = time.monotonic() - ticket.granted_at
            self.mean_hold = held if not self.mean_hold else 0.8 * self.mean_hold + 0.2 * held
            self._grant_next()
            return
        line = self.lines.get(ticket.caller)
        if line is not None and ticket in line:
            line.remove(ticket)
            self.queued -= 1
            if not line:
                del self.lines[ticket.caller]

    def retry_after(self) -> float:
        """Seconds until a place in the queue likely opens: one slot's mean hold time over the slots, 1..30."""
        return min(30.0, max(1.0, self.mean_hold / self.parallel))

    def _grant(self, ticket: Ticket) -> None:
        self.active += 1
        self.running[ticket.caller] = self.running.get(ticket.caller, 0) + 1
        ticket._grant()

    def _grant_next(self) -> None:
        while self.active < self.parallel and self.lines:
            caller = min(self.lines, key=lambda c: self.running.get(c, 0))  # first of the least served, in turn
            line = self.lines.pop(caller)
            ticket = line.popleft()
            if line:
                self.lines[caller] = line  # back of the turn order
            self.queued -= 1
            self._grant(ticket)


class Admission:
    """The gates of every instance this gateway sends generations to, keyed by instance id."""

    def __init__(self, parallel: int | None = None, max_queue: int = 64) -> None:
        self.parallel = max(1, parallel) if parallel else None  # None: each instance's own slots
        self.max_queue = max(0, max_queue)
        self._gates: dict[str, _Gate] = {}

    def enter(self, instance_id: str, caller: str, slots: int = 1) -> Ticket:
        """A ticket for ``caller`` on ``instance_id``: granted if a slot is free, else waiting in line. The gate
        has the ``parallel`` slots it was made with, else the instance's runner's ``slots``; a runner that batches
        on its own terms (vLLM's scheduler: its placement says 1) gets ``SHARED_SLOTS``.

        Raises:
            Overloaded: ``max_queue`` requests already wait for the instance.
        """
        gate = self._gates.get(instance_id)
        if gate is None:
            gate = self._gates[instance_id] = _Gate(
                self.parallel or (slots if slots > 1 else SHARED_SLOTS), self.max_queue
            )
        return gate.enter(caller)

    def forget(self, live: set[str]) -> None:
        """Drop the idle gates of instances that no longer exist (their ids are never used again)."""
        for instance_id in [i for i, g in self._gates.items() if i not in live and not g.active and not g.queued]:
            del self._gates[instance_id]

    def loads(self) -> dict[str, Load]:
        """Every instance's queue this gateway has sent generations to, by instance id (for ``/metrics``)."""
        return {instance_id: self.load(instance_id) for instance_id in self._gates}

    def load(self, instance_id: str) -> Load:
        """``instance_id``'s queue now (zeros when this gateway has sent it nothing)."""
        gate = self._gates.get(instance_id)
        active, queued, parallel = (gate.active, gate.queued, gate.parallel) if gate else (0, 0, self.parallel or 0)
        return Load(active=active, queued=queued, parallel=parallel, max_queue=self.max_queue)
