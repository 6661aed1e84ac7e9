"""Deployments: planning placements and every write of an instance's lifecycle that a gateway decides.

``Deployments`` plans with the pure planner over a topology snapshot (``preview``), stores the chosen candidate
as an ``Instance`` (state ``Starting``) under the store's ``placing`` lease (``placing``: one gateway plans at a
time, from the store's records), and keeps each model's desired count in the store as its ``Deployment``
(``deploy`` places N at once, each on nodes no other replica of the model uses where any fit: anti-affinity; an
instance that shares a node says why in ``note``). Deleting an instance (by the API, ``keep_alive`` expiry,
Ollama's unload) lowers its deployment's count.

**Drain.** ``drain`` stops routing to a replica at once (state ``Draining``: ``replicas`` routes only to ready
ones, on every gateway, as each sees the store change) and lets what runs on it finish: the reconcile loop
deletes it when no gateway runs or queues anything on it, or when its grace period ends (streams still running
then lose their runner and resume on another replica, ``gateway.serving.resume``). ``DELETE /instances/{id}``
and the autoscaler drain; a node whose agent got ``SIGTERM`` says ``draining_until`` in its record, and each
replica on it drains until then while a replacement is placed elsewhere (nothing new is planned on a draining
node). Every change of an existing record is a compare-and-set on the state and epoch read.

Imports the backends' interface, the planner, the records, the store's interface and the cached view.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from meshgate.backends.base import Backend, ModelCard
from meshgate.backends.placement import Candidate, InstanceId, Topology
from meshgate.gateway.cluster.lifecycle import MAX_ATTEMPTS
from meshgate.gateway.cluster.planner import BackendOffer, plan
from meshgate.gateway.cluster.records import Deployment, Draining, Failed, Instance, Ready, Starting
from meshgate.gateway.cluster.view import InstanceCache
from meshgate.protocols.model import GatewayError, InvalidRequest, NoCapacity, NotFound, Overloaded, StoreUnavailable

__all__ = ["PLACING", "Deployments", "given_up", "no_fit_message"]

PLACING, PLACING_LEASE, PLACING_WAIT = "placing", 10.0, 10.0
"""The store lease a gateway holds while it places a replica (``Deployments.placing``), its time to live, and how
long a placement waits for another gateway's to end."""


class Deployments:
    """Plans, places, drains and deletes instances; keeps each model's deployment."""

    def __init__(
        self,
        cache: InstanceCache,
        backends: Sequence[Backend],
        *,
        resolve: Callable[[str], ModelCard],
        choose: Callable[..., Backend | None],
        rank: Callable | None = None,
        context: Callable[[Backend, ModelCard], int | None] | None = None,
        load: Callable[[str], int] = lambda instance_id: 0,
        min_replicas: int = 1,
        max_replicas: int = 1,
        drain_grace: float = 30.0,
    ) -> None:
        self.cache = cache
        self.store = cache.store
        self.backends = list(backends)
        self.resolve = resolve
        self.choose = choose
        self.rank = rank
        self.context = context
        self.load = load  # instance id -> generations running + queued on it, every gateway's (``loads``)
        self.min_replicas, self.max_replicas = min_replicas, max_replicas  # bounds of a new deployment
        self.drain_grace = drain_grace  # seconds a drained replica's streams have to finish (``MESHGATE_DRAIN_GRACE``)
        self._create_lock = asyncio.Lock()

    async def topology(self, *, usable: bool = False) -> Topology:
        """The nodes and links; ``usable``: only the nodes to plan on (a draining node takes nothing new)."""
        nodes, links = await asyncio.gather(self.store.nodes(), self.store.links())
        if usable:
            nodes = [n for n in nodes if n.draining_until is None]
        return Topology(nodes=tuple(nodes), links=tuple(links))

    def _offers(self, card: ModelCard) -> list[tuple[Backend, BackendOffer]]:
        chosen = self.choose(card=card, backends=self.backends)
        if chosen is None:
            raise NoCapacity(f"no backend can serve model '{card.name}' (format {card.format})")
        costs = chosen.costs(card)
        return [
            (
                chosen,
                BackendOffer(
                    backend=chosen.name,
                    strategies=frozenset(chosen.strategies(card)),
                    overhead_bytes=costs.base_bytes,
                    overhead_per_token=costs.per_token_bytes,
                    head_overhead_bytes=costs.head_bytes,
                    tied_output_copy=costs.tied_output_copy,
                    vocab_parallel=costs.vocab_parallel,
                    kv_sequences=costs.sequences,
                    kv_spares=costs.spares,
                    head_cache_share=costs.cache_share,
                    head_cache_cap=costs.cache_cap,
                    required_runtime=None,
                ),
            )
        ]

    async def preview(
        self,
        model: str,
        *,
        nodes: Sequence[str] | None = None,
        strategy: str | None = None,
        min_nodes: int | None = None,
        context: int | None = None,
    ) -> list[Candidate]:
        """Every candidate placement for ``model``, fitting ones first, best first (``context``: tokens of KV
        cache to hold; the backend's default for the model when None).

        A node offers what it reports available, but never more than its total (its ``--memory`` cap, if any)
        less what the instances placed on it already take (``placed_memory``): a runner placed a moment ago has
        not loaded yet, and a capped node's free memory does not shrink as placements fill the cap."""
        card = self.resolve(model)
        offers = self._offers(card)
        backend = offers[0][0]
        if context is None and self.context:
            context = self.context(backend, card)
        topology = await self.topology(usable=True)
        placed = self.cache.placed_memory()
        topology = Topology(
            nodes=tuple(
                msgspec.structs.replace(
                    n,
                    memory_available=max(
                        0,
                        min(n.memory_available, n.memory_total - placed.get(n.id, 0)),
                    ),
                )
                for n in topology.nodes
            ),
            links=topology.links,
        )
        return plan(
            backend.spec(card),
            topology,
            [o for _, o in offers],
            context=context,
            nodes=nodes,
            rank=self.rank,
            strategy=strategy,
            min_nodes=min_nodes,
        )

    @contextlib.asynccontextmanager
    async def placing(self) -> AsyncIterator[None]:
        """Place (plan and write) as the only placer in the cluster, from the store's records as they are: the
        ``placing`` lease in the store, held by one gateway at a time (two gateways planning at once would each
        count only the memory their own view places, and fill a node twice over). Waits ``PLACING_WAIT`` seconds
        at most for another gateway's placement to end."""
        async with self._create_lock:
            deadline = time.monotonic() + PLACING_WAIT
            while not await self.store.claim(PLACING, self.cache.holder, ttl=PLACING_LEASE):
                if time.monotonic() > deadline:
                    raise Overloaded("another gateway is placing models; retry shortly", retry_after=1.0)
                await asyncio.sleep(0.05)
            try:
                await self.cache.refresh(force=True)
                yield
            finally:
                with contextlib.suppress(StoreUnavailable):  # else its lease lapses by itself
                    await self.store.release(PLACING, self.cache.holder)

    async def create(
        self,
        model: str,
        *,
        candidate_id: str | None = None,
        nodes: Sequence[str] | None = None,
        strategy: str | None = None,
        min_nodes: int | None = None,
        context: int | None = None,
        reason: str = "requested",
    ) -> Instance:
        """Place ``model`` (a previewed candidate by id, or the best under the constraints); store the instance.

        Without ``nodes`` or ``candidate_id``, nodes that hold no replica of the model come first (anti-affinity);
        a replica placed beside another says why in its ``note``."""
        card = self.resolve(model)
        plan_with: dict[str, Any] = dict(strategy=strategy, min_nodes=min_nodes, context=context)
        note = None
        occupied = {s.node_id: i.id for i in self.cache.cached(card.name) for s in i.placement.shards}
        candidates: list[Candidate] = []
        if occupied and nodes is None and candidate_id is None:
            free = [n.id for n in (await self.topology(usable=True)).nodes if n.id not in occupied]
            if free:
                candidates = await self.preview(card.name, nodes=free, **plan_with)
        if not any(c.fits for c in candidates):
            candidates = await self.preview(card.name, nodes=nodes, **plan_with)
            shared = [c for c in candidates if c.fits][:1]
            if occupied and shared and nodes is None and candidate_id is None:
                beside = sorted({f"{n} (replica {occupied[n]})" for n in shared[0].memory_per_node if n in occupied})
                if beside:
                    note = f"shares {', '.join(beside)}: no node without a replica of {card.name} has room for it"
        fitting = [c for c in candidates if c.fits]
        if candidate_id is not None:
            fitting = [c for c in candidates if c.id == candidate_id]
            if not fitting:
                raise NotFound(f"no candidate '{candidate_id}' for model '{card.name}' in the current topology")
            if not fitting[0].fits:
                raise NoCapacity(f"candidate {candidate_id} does not fit: {fitting[0].reason}")
        if not fitting:
            raise NoCapacity(no_fit_message(card.name, candidates))
        now = time.time()
        instance = Instance(
            id=InstanceId(uuid.uuid4().hex[:12]),
            model=card.name,
            placement=fitting[0],
            state=Starting(),
            created_at=now,
            updated_at=now,
            runners={},
            strategy=strategy,
            min_nodes=min_nodes,
            note=note,
        )
        await self.store.put_instance(instance)
        where = ", ".join(s.node_id for s in fitting[0].shards)
        await self.store.append_event(
            "instance.placed",
            f"placed {card.name} ({reason}) on {where}" + (f"; {note}" if note else ""),
            instance_id=instance.id,
            data={"placement": msgspec.json.encode(fitting[0]).decode(), "reason": reason, "note": note or ""},
        )
        self.cache.by_id[instance.id] = instance
        return instance

    async def deploy(
        self,
        model: str,
        *,
        replicas: int = 1,
        candidate_id: str | None = None,
        nodes: Sequence[str] | None = None,
        strategy: str | None = None,
        min_nodes: int | None = None,
        context: int | None = None,
        reason: str = "requested",
        min_replicas: int | None = None,
        max_replicas: int | None = None,
    ) -> list[Instance]:
        """Place ``replicas`` more instances of ``model`` (see ``create``), spread over distinct nodes where they
        fit, and record the model's desired count (its ``Deployment``) as the instances it has now, with the
        autoscaling bounds given (see ``record``)."""
        _check_bounds(min_replicas, max_replicas)
        card = self.resolve(model)
        placed: list[Instance] = []
        async with self.placing():
            for _ in range(replicas):
                instance = await self.create(
                    card.name,
                    candidate_id=candidate_id,
                    nodes=nodes,
                    strategy=strategy,
                    min_nodes=min_nodes,
                    context=context,
                    reason=reason if replicas == 1 else f"{reason}: {replicas} replicas",
                )
                placed.append(instance)  # in the view now: the next one's preview counts its memory
            await self.record(card.name, context=context, bounds=(min_replicas, max_replicas), pinned=True)
        return placed

    async def set_bounds(self, model: str, min_replicas: int | None, max_replicas: int | None) -> Deployment:
        """Change ``model``'s autoscaling bounds (``None``: keep that one). Raising ``min_replicas`` above the
        replicas it has places more; lowering ``max_replicas`` below them removes the extra ones once idle."""
        await self.cache.refresh(force=True)
        current = next((d for d in await self.store.deployments() if d.model == model), None)
        if current is None or not self.cache.cached(model):
            raise NotFound(f"model '{model}' has no deployment")
        lo = current.min_replicas if min_replicas is None else min_replicas
        hi = current.max_replicas if max_replicas is None else max_replicas
        _check_bounds(lo, hi)
        await self.record(model, bounds=(lo, hi), pinned=True)
        found = next((d for d in await self.store.deployments() if d.model == model), None)
        if found is None:  # its last replica was deleted meanwhile, and the deployment with it
            raise NotFound(f"model '{model}' has no deployment")
        await self.store.append_event(
            "deployment.bounds",
            f"{model}: min_replicas {found.min_replicas}, max_replicas {found.max_replicas}",
            data={"min_replicas": str(found.min_replicas), "max_replicas": str(found.max_replicas)},
        )
        return found

    async def record(
        self,
        model: str,
        *,
        context: int | None = None,
        without: str | None = None,
        bounds: tuple[int | None, int | None] = (None, None),
        pinned: bool | None = None,
    ) -> None:
        """Make ``model``'s deployment ask for the instances it has now, less ``without`` (none: forget the
        deployment), and at least its ``min_replicas``. Called after an instance is stored and before one is
        deleted, so another gateway never sees fewer instances than the deployment asks for (and places one).

        ``bounds`` (min, max) set the autoscaling bounds where given. Else a new deployment gets
        ``MESHGATE_MIN_REPLICAS`` / ``MESHGATE_MAX_REPLICAS``, raised to the replicas placed (N placed at once stay
        N unless told otherwise), and an existing one keeps its own, widened to the replicas it has; one of a fixed
        size (min = max) follows the replicas it has, both ways."""
        count = sum(1 for i in self.cache.cached(model) if i.id != without and not isinstance(i.state, Draining))
        current = next((d for d in await self.store.deployments() if d.model == model), None)
        if count == 0:
            if current is not None:
                await self.store.delete_deployment(model)
                self.cache.forget(model)
            return
        lo, hi = bounds
        if current is None:
            base = Deployment(model=model, context=context)
            lo = max(self.min_replicas, count) if lo is None else lo
            hi = max(self.max_replicas, count) if hi is None else hi
        elif lo is None and hi is None and current.min_replicas == current.max_replicas:
            # a fixed size (no autoscaling asked for) stays fixed at what is placed: a replica placed beside the
            # others for a bigger context is not an extra for the autoscaler to take away when idle
            base = current
            lo = hi = min(current.min_replicas, count) if without is not None else max(current.max_replicas, count)
        else:
            base = current
            lo = min(current.min_replicas, count) if lo is None else lo
            if hi is None:  # a deletion never widens it: a lowered max stays lowered while the extras go
                hi = current.max_replicas if without is not None else max(current.max_replicas, count)
        written = msgspec.structs.replace(
            base,
            replicas=max(count, lo),
            min_replicas=lo,
            max_replicas=max(hi, lo),
            updated_at=time.time(),
            pinned=base.pinned if pinned is None else pinned,
        )
        await self.store.put_deployment(written)
        self.cache.remember(written)  # known at once

    async def beyond_minimum(self, model: str) -> int:
        """How many of ``model``'s replicas a request's ``keep_alive`` may unload: all of them unless an admin
        pinned its deployment, then those above its ``min_replicas`` (draining and given-up ones not counted)."""
        deployment = next((d for d in await self.store.deployments() if d.model == model), None)
        live = [i for i in self.cache.cached(model) if not isinstance(i.state, Draining) and not given_up(i)]
        if deployment is None or not deployment.pinned:
            return len(live)
        return max(0, len(live) - deployment.min_replicas)

    async def delete(self, instance_id: InstanceId, *, grace: float | None = None) -> Instance | None:
        """Remove an instance and lower its deployment's count: by draining it for ``grace`` seconds (the setting
        when None), ``lifecycle.SETTLE`` at least even when it looks idle (another gateway may have just begun a
        stream on it); at once when it is not ready or ``grace`` is 0. Returns the draining instance, or None when
        it is gone."""
        return await self.drain(instance_id, reason="deleted", grace=grace, settle=grace != 0)

    async def drain(
        self,
        instance_id: InstanceId,
        *,
        reason: str,
        grace: float | None = None,
        lower: bool = True,
        settle: bool = False,
    ) -> Instance | None:
        """Take the instance out of routing and delete it once what runs on it has finished, or ``grace`` seconds
        from now (the ``drain_grace`` setting when None). ``lower``: its deployment asks for one replica fewer (a
        deletion, a scale-down); else (its node is stopping) the reconcile loop places a replacement while it
        drains. One that is not ready is deleted at once, and so is an idle one unless ``settle``: then it drains
        for at least ``lifecycle.SETTLE`` seconds, so that a stream another gateway began on it in the last moments
        (not yet in the shared load) finishes there too. Two gateways acting on one node's drain both get here: the
        one whose Ready -> Draining write loses leaves the replica to the other's drain, never deletes it. Returns
        it while it drains, None once gone."""
        found = await self.store.get_instance(instance_id)
        if found is None:
            raise NotFound(f"instance '{instance_id}' not found")
        now, grace = time.time(), self.drain_grace if grace is None else grace
        until = now + grace
        if isinstance(found.state, Draining):  # already draining: a shorter ``grace`` (``?grace=0``) moves its end
            # Its times are on its writer's clock, which may be off from this one's: the new end is its start plus
            # what has passed of it (measured here, since this gateway first saw it) plus the grace.
            state = found.state
            first = self.cache.drains_seen.get((instance_id, state.since), time.monotonic())
            sooner = state.since + (time.monotonic() - first) + grace
            if sooner < state.until:
                shorter = msgspec.structs.replace(state, until=sooner)
                await self.store.set_state(instance_id, shorter, expected=Draining, epoch=found.epoch)
                await self.cache.refresh(force=True)
                self.cache.changed.set()
            return self.cache.by_id.get(instance_id, found)
        if lower:
            await self.record(found.model, without=instance_id)
        if isinstance(found.state, Ready) and until > now and (settle or self.load(instance_id)):
            state = Draining(since=now, until=until, reason=reason, replaced=not lower)
            began = time.monotonic()
            if await self.store.set_state(instance_id, state, expected=Ready, epoch=found.epoch):
                self.cache.drains_seen[(instance_id, now)] = (
                    began  # its window, on this clock (``reconcile.Reconciler``)
                )
                left = until - now
                await self.store.append_event(
                    "instance.draining",
                    f"{found.model} drains ({reason}): no new requests; {self.load(instance_id)} running or queued "
                    f"have {left:.0f}s to finish",
                    instance_id=instance_id,
                    data={"reason": reason, "grace_s": f"{left:.1f}", "load": str(self.load(instance_id))},
                )
                await self.cache.refresh(force=True)
                self.cache.changed.set()
                return self.cache.by_id.get(instance_id)
            now_found = await self.store.get_instance(instance_id)  # the state moved since it was read
            if now_found is None or isinstance(now_found.state, Draining):  # another gateway removed or drains it
                await self.cache.refresh(force=True)
                return None if now_found is None else self.cache.by_id.get(instance_id, now_found)
            found = now_found
        await self.remove(found, f"deleted instance {instance_id} ({reason})", kind="instance.deleted")
        return None

    async def remove(self, instance: Instance, message: str, *, kind: str) -> None:
        if await self.store.delete_instance(instance.id):
            await self.store.append_event(kind, message, instance_id=instance.id)
        self.cache.by_id.pop(instance.id, None)

    async def unload(self, model: str, busy: Callable[[str], bool]) -> None:
        """Delete ``model``'s idle replicas now and the ``busy`` ones once idle (Ollama's ``keep_alive: 0``):
        another client's stream on a replica is never cut by it, and a deployment an admin pinned keeps its
        ``min_replicas`` (``beyond_minimum``)."""
        waiting = False
        left = await self.beyond_minimum(model)
        for instance in self.cache.cached(model):
            if left <= 0:
                break
            if isinstance(instance.state, Draining) or given_up(instance):
                continue
            if busy(instance.id):
                waiting = True
                continue
            with contextlib.suppress(GatewayError):
                await self.delete(instance.id)
                left -= 1
        if waiting and left > 0:
            await self.set_expiry(model, time.time())  # the reconcile loop expires them when idle

    async def keep(self, model: str, until: float | None) -> None:
        """``model``'s ready replicas expire at ``until`` (Unix time; None: never, written only where one would)."""
        if until is not None or any(i.expires_at is not None for i in self.cache.cached(model)):
            await self.set_expiry(model, until)

    async def set_expiry(self, model: str, expires_at: float | None) -> None:
        """Set when ``model``'s ready instances are unloaded (``None``: never; Ollama's ``keep_alive``). Each write
        holds only over the ready state and epoch it read: one failed, drained or deleted meanwhile stays so."""
        await self.cache.refresh()
        for instance in self.cache.cached(model):
            if isinstance(instance.state, Ready) and instance.expires_at != expires_at:
                current = await self.store.get_instance(instance.id)
                if current is not None and isinstance(current.state, Ready):
                    changed = msgspec.structs.replace(current, expires_at=expires_at)
                    await self.store.update_instance(changed, expected=Ready, epoch=current.epoch)
        await self.cache.refresh(force=True)

    async def lower(self, model: str, without: str) -> None:
        """Lower ``model``'s deployment by the replica ``without`` (before it is drained)."""
        await self.record(model, without=without)


def given_up(instance: Instance) -> bool:
    """Failed with no re-placement tries left: it waits for a node to join, and its deployment places a
    substitute meanwhile."""
    return isinstance(instance.state, Failed) and instance.attempts >= MAX_ATTEMPTS


def _check_bounds(lo: int | None, hi: int | None) -> None:
    if (lo is not None and lo < 1) or (hi is not None and hi < 1):
        raise InvalidRequest("min_replicas and max_replicas must be at least 1", param="min_replicas")
    if lo is not None and hi is not None and lo > hi:
        raise InvalidRequest(f"min_replicas ({lo}) is above max_replicas ({hi})", param="min_replicas")


def no_fit_message(model: str, candidates: Sequence[Candidate]) -> str:
    if not candidates:
        return f"model '{model}' fits nowhere: no nodes are registered"
    reasons = "; ".join(dict.fromkeys(c.reason or "" for c in candidates if c.reason))
    return f"model '{model}' fits nowhere: {reasons}"
