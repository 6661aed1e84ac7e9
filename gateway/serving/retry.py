"""The one retry loop that takes a request to a replica (``RetryLoop.run``): generations, their resumes,
embeddings and token counts all go through it.

Each pass routes to a replica (``Replicas.acquire``: placed if there is none) and waits until it is ready, then
calls what the request does there. A replica that cannot be reached is failed (so it is re-placed) and the next
pass goes to another, up to ``START_RETRIES`` times; a resume waits patiently, its caller bounding the time. A
call that answers ``start.Bigger`` sends the next pass to a replica with that context.

Imports the records, routing, the shared load and ``start``'s pass bookkeeping (``Visit``, ``Bigger``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from meshgate.backends.base import ModelCard
from meshgate.backends.placement import InstanceId
from meshgate.gateway.cluster.loads import LoadBoard
from meshgate.gateway.cluster.records import Instance, Ready
from meshgate.gateway.cluster.routing import Routing
from meshgate.gateway.serving.start import Bigger, Visit
from meshgate.protocols.model import BackendTimeout, BackendUnavailable, GatewayError, NoCapacity

__all__ = ["START_RETRIES", "Replicas", "RetryLoop"]

log = logging.getLogger("meshgate.dispatch")
T = TypeVar("T")


START_RETRIES = 3
"""Replicas a request that finds its runner unreachable at its start moves on to (each reported, so re-placed):
during a node's restart a second replica may be going too."""

_UNREACHABLE = (BackendUnavailable,)
"""What sends a request to another replica: the runner (or its replica's placement) cannot be reached."""

_NOT_YET = (BackendUnavailable, BackendTimeout, NoCapacity)
"""What a resume waits through (its caller bounds the wait): a replica going too, or nowhere to go yet. Of these
only ``_UNREACHABLE`` fails the replica: a full queue (``Overloaded``) or no room is load, and a busy replica is
healthy."""


class Replicas(Protocol):
    """What the dispatcher needs of the instances (``InstanceManager`` is one): a ready replica for a request
    (placed if there is none), reporting one its runner cannot be reached on, and a model's keep-alive."""

    async def acquire(
        self, card: ModelCard, *, context: int | None = None, routing: Routing | None = None
    ) -> Instance: ...

    async def wait_ready(self, instance_id: InstanceId, timeout: float = 300.0) -> Instance: ...

    async def report_unreachable(self, instance: Instance, error: str) -> None: ...

    async def unload(self, model: str, busy: Callable[[str], bool]) -> None: ...

    async def keep(self, model: str, until: float | None) -> None: ...


class RetryLoop:
    """The retry loop over ``instances`` (the dispatcher's port); ``loads``: the shared load it tells when a routed
    request reaches its replica's queue."""

    def __init__(self, instances: Replicas, loads: LoadBoard | None = None) -> None:
        self.instances = instances
        self.loads = loads

    async def run(
        self,
        card: ModelCard,
        call: Callable[[Instance, Visit], Awaitable[T | Bigger]],
        *,
        context: int | None = None,
        routing: Routing | None = None,
        retries: int = START_RETRIES,
        waiting: Callable[[], object] | None = None,
        failed: tuple[Instance, GatewayError] | None = None,
        patient: bool = False,
    ) -> T:
        """``call(replica, visit)`` on a ready replica of ``card``.

        Each pass routes to a replica holding ``context`` tokens (``routing`` picks among them for a generation;
        one is placed when there is none) and waits until it is ready. A replica that cannot be reached (its
        placement fails, its runner does not answer, its first event says so) is failed, so it is re-placed, and
        the next pass goes to another replica or the re-placed one: ``retries`` times, or, ``patient`` (a resume,
        which its caller bounds in time), until one takes it, through ``_NOT_YET`` too. ``call`` answering
        ``Bigger`` routes the next pass to that context. ``waiting`` is told before anything that may take long
        (``call`` tells it through ``visit`` too); ``failed`` is the replica (and why) a resume comes from.
        """
        retry_on = _NOT_YET if patient else _UNREACHABLE
        while True:
            if failed is not None:
                gone, error = failed
                log.warning("instance %s unreachable (%s); re-placing", gone.id, error.message)
                await self.instances.report_unreachable(gone, error.message)
                context = gone.placement.context
                if waiting is not None:
                    waiting()
            instance: Instance | None = None
            visit = Visit(waiting)
            try:
                instance = await self.instances.acquire(card, context=context, routing=routing)
                if routing is not None and self.loads is not None:
                    visit.routed(functools.partial(self.loads.settled, instance.id))
                if not isinstance(instance.state, Ready):
                    visit.waiting()
                    instance = await self.instances.wait_ready(instance.id)
                result = await call(instance, visit)
                if not isinstance(result, Bigger):
                    return result
                context = result.context
            except retry_on as error:
                if not patient and retries <= 0:
                    raise
                retries -= 1
                failed = (instance, error) if instance is not None and isinstance(error, _UNREACHABLE) else None
                await asyncio.sleep(0.5 if patient else 0.2 * (START_RETRIES - retries - 1))
            finally:
                visit.settle()
