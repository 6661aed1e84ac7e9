"""Replicas: the request path's side of the control plane (``Replicas``).

``acquire`` reads the cached view (``view.InstanceCache``: read again only when the store says something
changed) and picks among the ready replicas that hold the request's context with ``routing.route`` on the
shared load (``loads``). A request for more context than every replica holds gets a bigger replica placed beside
the others (``deployments.Deployments.create``), never instead of them; an instance is never deleted by a
request. ``wait_ready`` waits for one coming up; ``report_unreachable`` fails one whose runner a request could
not reach, so the reconcile loop re-places it.

Imports the records, routing, the cached view and the deployments (to place a replica there is none of).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence

from meshgate.backends.base import ModelCard
from meshgate.backends.placement import InstanceId
from meshgate.gateway.cluster.deployments import Deployments
from meshgate.gateway.cluster.lifecycle import MAX_ATTEMPTS
from meshgate.gateway.cluster.records import Draining, Failed, Instance, Ready, Starting
from meshgate.gateway.cluster.routing import Choice, PrefixTable, Replica, Routing, route
from meshgate.gateway.cluster.view import InstanceCache
from meshgate.protocols.model import BackendUnavailable, NoCapacity, StoreUnavailable

__all__ = ["Replicas"]

log = logging.getLogger("meshgate.instances")


class Replicas:
    """Finds (or places) the replica for each request, waits for it, and reports one that cannot be reached."""

    def __init__(
        self,
        cache: InstanceCache,
        deployments: Deployments,
        *,
        auto_place: bool = True,
        load: Callable[[str], int] = lambda instance_id: 0,
        routing: str = "affinity",
        on_route: Callable[[str], None] = lambda instance_id: None,
    ) -> None:
        self.cache = cache
        self.store = cache.store
        self.deployments = deployments
        self.auto_place = auto_place
        self.load = load  # instance id -> generations running + queued on it, every gateway's (``loads``)
        self.routing = routing  # "affinity", "least_loaded" (no prefix key) or "round_robin" (in turn)
        self.on_route = on_route  # told the replica of each generation routed (``loads.LoadBoard.routed``)
        self.prefixes = PrefixTable()  # which replica this gateway sent each prompt prefix to
        self.cached: Callable[[bytes], Collection[str]] = lambda key: ()  # replicas whose KV tier holds ``key``
        self.cold: Callable[[Collection[str]], Collection[str]] = lambda ids: ()  # new replicas still warming up
        self.routed: dict[tuple[str, str], int] = {}  # (model, routing rule) -> requests (``/metrics``)
        self._turn = 0

    async def acquire(self, card: ModelCard, *, context: int | None = None, routing: Routing | None = None) -> Instance:
        """The replica of ``card`` a request goes to: among the ready ones that hold ``context`` tokens (Ollama's
        ``num_ctx``; any when None), the one ``routing.route`` picks for a generation's prompt (``routing``) on the
        shared load; else one that is starting; else a new one, placed beside the others (when placement is
        automatic). A generation's replica is told to ``on_route`` at once, so it counts as load before the
        request reaches its queue.

        When no replica holds ``context`` and none can be placed (or placement is off), the replica with the
        largest context serves: the prompt is still checked against what it holds.
        """
        if context is not None and card.context_length:
            context = min(context, card.context_length)
        found = self._pick(card.name, context, routing)
        if found is not None:
            return found
        async with self.deployments.placing():
            found = self._pick(card.name, context, routing)
            if found is not None:
                return found
            largest = _usable(sorted(self.cache.cached(card.name), key=lambda i: -i.placement.context))
            if not self.auto_place:
                if largest is not None:
                    return self._routed(largest, routing)
                raise NoCapacity(
                    f"model '{card.name}' has no instance and automatic placement is off; "
                    f"create one with POST /instances"
                )
            if largest is None:
                why = "automatic: first request"
            else:
                why = f"automatic: a request for {context} tokens, more than every replica holds"
            try:
                created = await self.deployments.create(card.name, context=context, reason=why)
            except NoCapacity:
                if largest is None:
                    raise
                log.warning("no room for a %s replica of %s tokens; serving on %s", card.name, context, largest.id)
                return self._routed(largest, routing)
            await self.deployments.record(card.name, context=context)
            return self._routed(created, routing)

    def _pick(self, model: str, context: int | None, routing: Routing | None) -> Instance | None:
        """A ready replica holding ``context`` tokens, routed; else one holding it that is coming up."""
        holding = [i for i in self.cache.cached(model) if context is None or i.placement.context >= context]
        ready = [i for i in holding if isinstance(i.state, Ready)]
        if not ready:
            found = _usable(holding)
            return self._routed(found, routing) if found is not None else None
        cold = self.cold([i.id for i in ready])
        if cold and len(cold) < len(ready):  # a new replica warming its KV tier takes nothing while another can
            ready = [i for i in ready if i.id not in cold]
        if routing is None:  # a load, an embedding, a count: no prompt to route by
            return min(ready, key=lambda i: self.load(i.id))
        if len(ready) == 1:  # nothing to choose: the prompt is not even hashed
            choice = Choice(ready[0].id, "only")
        elif self.routing == "round_robin":
            self._turn += 1
            choice = Choice(sorted(ready, key=lambda i: i.id)[self._turn % len(ready)].id, "round_robin")
        elif self.routing == "least_loaded":
            choice = route([Replica(i.id, self.load(i.id)) for i in ready], None)
        else:
            replicas = [Replica(i.id, self.load(i.id)) for i in ready]
            preferred = self.prefixes.match(routing.blocks, (r.id for r in replicas))
            key = routing.key
            cached = self.cached(key) if key is not None and preferred is None else ()
            choice = route(replicas, key, preferred=preferred, cached=cached)
            self.prefixes.learn(routing.blocks, choice.id)
        rule = (model, choice.rule)
        self.routed[rule] = self.routed.get(rule, 0) + 1
        return self._routed(next(i for i in ready if i.id == choice.id), routing)

    def _routed(self, instance: Instance, routing: Routing | None) -> Instance:
        if routing is not None:
            self.on_route(instance.id)
        return instance

    async def wait_ready(self, instance_id: InstanceId, timeout: float = 300.0) -> Instance:
        """Wait until the instance is ready; raise if it fails (and is not re-placed) or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            instance = self.cache.by_id.get(instance_id) or await self.store.get_instance(instance_id)
            if instance is None:
                raise BackendUnavailable(f"instance {instance_id} was deleted while starting")
            if isinstance(instance.state, Ready):
                return instance
            if isinstance(instance.state, Failed) and instance.attempts >= MAX_ATTEMPTS:
                raise BackendUnavailable(f"instance {instance_id} failed: {instance.state.reason}")
            if isinstance(instance.state, Draining):
                raise BackendUnavailable(f"instance {instance_id} is draining ({instance.state.reason})")
            await asyncio.sleep(0.05)
            await self.cache.refresh()
        raise BackendUnavailable(f"instance {instance_id} was not ready within {timeout:.0f}s")

    async def report_unreachable(self, instance: Instance, error: str) -> None:
        """The gateway could not reach the instance's runner: fail it so it is re-placed. Only the epoch the
        caller reached fails: a late report about a placement already replaced changes nothing."""
        failed = Failed(reason=f"runner unreachable: {error}")
        try:
            if await self.store.set_state(instance.id, failed, expected=Ready, epoch=instance.epoch):
                await self.store.append_event("instance.failed", failed.reason, instance_id=instance.id)
            await self.cache.refresh(force=True)
        except StoreUnavailable:  # the agent reports a dead runner too, and the next request finds it again
            log.warning("could not report instance %s unreachable: the state store is away", instance.id)
        self.cache.changed.set()


def _usable(instances: Sequence[Instance]) -> Instance | None:
    """Ready first, then starting, then failed but still being re-placed."""
    for usable in (
        lambda i: isinstance(i.state, Ready),
        lambda i: isinstance(i.state, Starting),
        lambda i: isinstance(i.state, Failed) and i.attempts < MAX_ATTEMPTS,
    ):
        found = next((i for i in instances if usable(i)), None)
        if found is not None:
            return found
    return None
