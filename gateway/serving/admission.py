"""Admission: a bounded queue per instance in front of its runner, by class, fair across callers.

One gateway has at most ``parallel`` generations in flight on an instance (the runner batches that many
sequences); up to ``max_queue`` more of each class wait, and a request beyond that is refused at once with
``Overloaded`` (never left hanging).

Classes (``protocols.model.Priority``) are served in strict order: a free slot goes to a waiting ``interactive``
request before any ``batch`` one, with aging: a batch request that has waited ``aging`` seconds takes the next
slot over interactive ones, and then the clock restarts for the next (at most one such slot per ``aging``
seconds), so bulk work never starves entirely and never crowds out people either.

A runner with spare sequences (``Candidate.spares``: llama.cpp's pause batch sequences for interactive ones) takes
that many interactive requests beyond ``parallel`` while batch requests hold slots: an interactive request is
granted while fewer than ``parallel`` interactive ones run and fewer than ``parallel + spares`` run in all, and the
runner pauses a batch sequence for it instead of making it wait for one to end. Batch requests never take a spare.

Within a class, a free slot goes in turn across callers (an API key, or the client address when there is none):
the waiting caller with the fewest requests running per unit of its ``weight`` (a key attribute, 1 by default)
goes first, ties in round-robin order, so a caller with 50 queued requests cannot starve one with a single
request, and a key of weight 2 holds twice the slots of a key of weight 1 while both wait.

    ticket = admission.enter(instance_id, caller, priority="batch", weight=2)   # granted, waiting, or Overloaded
    await ticket.wait()                             # cancelled while waiting: it leaves the queue
    try: ... generate ...
    finally: ticket.release()                       # idempotent; grants the next waiting request

Queues are per gateway process (as the runner's batch is per instance): with several gateway replicas each keeps
its own. Embeddings and token counts are not queued by class. Imports the standard library, msgspec and
``protocols.model`` only; no I/O.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict, deque

import msgspec

from meshgate.protocols.model import Overloaded, Priority

__all__ = ["AGING", "CLASSES", "SHARED_SLOTS", "Admission", "Load", "Ticket"]

SHARED_SLOTS = 4
"""Generations one gateway sends at once to a runner whose placement declares no slots of its own."""
AGING = 30.0
"""Seconds a batch request waits before it takes the next slot over interactive ones (``Settings.batch_aging``)."""
CLASSES: tuple[Priority, ...] = ("interactive", "batch")
"""The classes, in the order admission serves them."""


class Load(msgspec.Struct, frozen=True):
    """An instance's queue as this gateway sees it: requests generating, requests waiting, and the bounds;
    ``batch_active`` and ``batch_queued`` are the batch class's share of ``active`` and ``queued``."""

    active: int = 0
    queued: int = 0
    parallel: int = 0
    max_queue: int = 0
    batch_active: int = 0
    batch_queued: int = 0


class Ticket:
    """One request's place at an instance: ``granted`` holds a slot; otherwise it waits in its caller's line of
    its class."""

    def __init__(self, gate: _Gate, caller: str, priority: Priority = "interactive") -> None:
        self.caller = caller
        self.priority: Priority = priority
        self.granted = False
        self.released = False
        self.entered = time.monotonic()
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
    """One instance's slots and its callers' lines, per class."""

    def __init__(self, parallel: int, max_queue: int, aging: float = AGING, spares: int = 0) -> None:
        self.parallel = parallel
        self.spares = spares
        self.max_queue = max_queue
        self.aging = aging
        self.active = 0
        self.queued = 0
        self.running: dict[str, int] = {}  # caller -> granted tickets
        self.weights: dict[str, float] = {}  # caller -> its weight, as its latest request gave it
        self.lines: dict[Priority, OrderedDict[str, deque[Ticket]]] = {c: OrderedDict() for c in CLASSES}
        self.queued_by: dict[Priority, int] = dict.fromkeys(CLASSES, 0)
        self.active_by: dict[Priority, int] = dict.fromkeys(CLASSES, 0)
        self.promoted_at = -math.inf  # when a batch request last took a slot by aging
        self.mean_hold = 0.0  # seconds a slot is held, smoothed: the basis of retry-after

    def enter(self, caller: str, priority: Priority, weight: float) -> Ticket:
        ticket = Ticket(self, caller, priority)
        self.weights[caller] = weight
        first = not self.queued if priority == "batch" else not self.queued_by["interactive"]
        if first and self._room(priority):
            self._grant(ticket)
        elif self.queued_by[priority] >= self.max_queue:
            raise Overloaded(
                f"the model is busy: {self.active} requests running and {self.queued} waiting (at most "
                f"{self.max_queue}); retry shortly",
                retry_after=self.retry_after(),
            )
        else:
            self.lines[priority].setdefault(caller, deque()).append(ticket)
            self.queued += 1
            self.queued_by[priority] += 1
        return ticket

    def leave(self, ticket: Ticket) -> None:
        if ticket.granted:
            self.active -= 1
            self.active_by[ticket.priority] -= 1
            self.running[ticket.caller] -= 1
            if not self.running[ticket.caller]:
                del self.running[ticket.caller]
            held = time.monotonic() - ticket.granted_at
            self.mean_hold = held if not self.mean_hold else 0.8 * self.mean_hold + 0.2 * held
            self._forget(ticket.caller)
            self._grant_next()
            return
        lines = self.lines[ticket.priority]
        line = lines.get(ticket.caller)
        if line is not None and ticket in line:
            line.remove(ticket)
            self.queued -= 1
            self.queued_by[ticket.priority] -= 1
            if not line:
                del lines[ticket.caller]
            self._forget(ticket.caller)

    def retry_after(self) -> float:
        """Seconds until a place in the queue likely opens: one slot's mean hold time over the slots, 1..30."""
        return min(30.0, max(1.0, self.mean_hold / self.parallel))

    def _forget(self, caller: str) -> None:
        if caller not in self.running and not any(caller in lines for lines in self.lines.values()):
            self.weights.pop(caller, None)

    def _grant(self, ticket: Ticket) -> None:
        self.active += 1
        self.active_by[ticket.priority] += 1
        self.running[ticket.caller] = self.running.get(ticket.caller, 0) + 1
        ticket._grant()

    def _room(self, priority: Priority) -> bool:
        """Whether a request of class ``priority`` may take a slot now: one of the ``parallel``, or for an
        interactive one a spare while batch requests hold some of them."""
        if self.active < self.parallel:
            return True
        spare = self.active < self.parallel + self.spares and self.active_by["interactive"] < self.parallel
        return priority == "interactive" and spare

    def _grant_next(self) -> None:
        while self.queued:
            if self.active < self.parallel:
                priority, caller = self._next()
            elif self.lines["interactive"] and self._room("interactive"):
                priority, caller = "interactive", self._fairest(self.lines["interactive"])
            else:
                return
            lines = self.lines[priority]
            line = lines.pop(caller)
            ticket = line.popleft()
            if line:
                lines[caller] = line  # back of the turn order
            self.queued -= 1
            self.queued_by[priority] -= 1
            self._grant(ticket)

    def _next(self) -> tuple[Priority, str]:
        """The class and caller whose request takes the free slot (the module docstring's order)."""
        batch = self.lines["batch"]
        if batch:
            oldest = min(batch, key=lambda c: batch[c][0].entered)
            now = time.monotonic()
            if not self.lines["interactive"] or max(batch[oldest][0].entered, self.promoted_at) + self.aging <= now:
                if self.lines["interactive"]:
                    self.promoted_at = now
                    return "batch", oldest
                return "batch", self._fairest(batch)
        return "interactive", self._fairest(self.lines["interactive"])

    def _fairest(self, lines: OrderedDict[str, deque[Ticket]]) -> str:
        """The first of the least served callers waiting in ``lines``: fewest slots held per unit of weight."""
        return min(lines, key=lambda c: self.running.get(c, 0) / self.weights.get(c, 1.0))


class Admission:
    """The gates of every instance this gateway sends generations to, keyed by instance id."""

    def __init__(self, parallel: int | None = None, max_queue: int = 64, aging: float = AGING) -> None:
        self.parallel = max(1, parallel) if parallel else None  # None: each instance's own slots
        self.max_queue = max(0, max_queue)
        self.aging = aging
        self._gates: dict[str, _Gate] = {}

    def enter(
        self,
        instance_id: str,
        caller: str,
        slots: int = 1,
        *,
        priority: Priority = "interactive",
        weight: float = 1.0,
        spares: int = 0,
    ) -> Ticket:
        """A ticket for ``caller`` on ``instance_id`` in class ``priority``: granted if a slot is free, else waiting
        in line (``weight``: the caller's share within its class). The gate has the ``parallel`` slots it was made
        with, else the instance's runner's ``slots``; a runner that batches on its own terms (vLLM's scheduler:
        its placement says 1) gets ``SHARED_SLOTS``. ``spares``: the runner's spare sequences, for interactive
        requests while batch ones hold slots.

        Raises:
            Overloaded: ``max_queue`` requests of the class already wait for the instance.
        """
        gate = self._gates.get(instance_id)
        if gate is None:
            gate = self._gates[instance_id] = _Gate(
                self.parallel or (slots if slots > 1 else SHARED_SLOTS), self.max_queue, self.aging, max(0, spares)
            )
        return gate.enter(caller, priority, weight if weight > 0 else 1.0)

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
        if gate is None:
            return Load(parallel=self.parallel or 0, max_queue=self.max_queue)
        return Load(
            active=gate.active,
            queued=gate.queued,
            parallel=gate.parallel,
            max_queue=self.max_queue,
            batch_active=gate.active_by["batch"],
            batch_queued=gate.queued_by["batch"],
        )
