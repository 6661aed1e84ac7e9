"""Instances: creating placements, watching them come up, failing and re-placing them when nodes leave.

``InstanceManager`` is the gateway's side of the control plane. It plans with the pure planner over a topology
snapshot, stores the chosen candidate as an ``Instance`` (state ``Starting``), and lets node agents start the
shards. Its reconcile loop (in every gateway; compare-and-set on state keeps two gateways from acting twice)
carries out the steps of the pure lifecycle rule (``lifecycle.plan``): an instance becomes ``Ready`` when every
shard's runner reports ready, ``Failed(reason)`` when a node leaves or a runner fails, and a failed one is
re-placed on the nodes that remain when it fits.

A model may have several instances, its **replicas**: ``deploy`` places N at once, each on nodes no other
replica of the model uses where any fit (anti-affinity; an instance that shares a node says why in ``note``),
and keeps the desired count in the store as the model's ``Deployment``, so every gateway and a restarted one
agree on it; the reconcile loop places replicas a deployment misses (one gateway at a time: a store lease).
Deleting an instance (by the API, ``keep_alive`` expiry, Ollama's unload) lowers its deployment's count.

**Drain.** ``drain`` stops routing to a replica at once (state ``Draining``: ``_pick`` takes only ready ones, on
every gateway, as each sees the store change) and lets what runs on it finish: the reconcile loop deletes it when
no gateway runs or queues anything on it, or when its grace period ends (streams still running then lose their
runner and resume on another replica, ``gateway.serving.resume``). ``DELETE /instances/{id}`` and the autoscaler drain;
a node whose agent got ``SIGTERM`` says ``draining_until`` in its record, and each replica on it drains until
then while a replacement is placed elsewhere (nothing new is planned on a draining node).
A deployment's ``min_replicas``/``max_replicas`` bound its autoscaling, which ``scale``
(``autoscale.Autoscaler.step``) carries out in each reconcile pass, before missing replicas are placed.

The hot path (``acquire``) reads a cached view that is refreshed only when the store says something changed,
and picks among the ready replicas that hold the request's context with ``routing.route`` on the shared load
(``loads``). A request for more context than every replica holds gets a bigger replica placed beside the others,
never instead of them; an instance is never deleted by a request, and ``keep_alive`` expiry waits while any
gateway still runs or queues generations on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import msgspec

from meshgate.backends.base import Backend, ModelCard
from meshgate.backends.placement import Candidate, InstanceId, NodeId, Topology
from meshgate.gateway.cluster import lifecycle
from meshgate.gateway.cluster.lifecycle import MAX_ATTEMPTS
from meshgate.gateway.cluster.planner import BackendOffer, plan
from meshgate.gateway.cluster.records import Deployment, Draining, Failed, Instance, Ready, Starting
from meshgate.gateway.cluster.recovery import Incarnation, republish
from meshgate.gateway.cluster.routing import Choice, PrefixTable, Replica, Routing, route
from meshgate.gateway.cluster.store import StateStore
from meshgate.protocols.model import (
    BackendUnavailable,
    GatewayError,
    InvalidRequest,
    NoCapacity,
    NotFound,
    Overloaded,
    StoreUnavailable,
)

__all__ = ["InstanceManager", "given_up", "missing_replicas"]

log = logging.getLogger("meshgate.instances")


PLACING, PLACING_LEASE, PLACING_WAIT = "placing", 10.0, 10.0
"""The store lease a gateway holds while it places a replica (``InstanceManager._placing``), its time to live,
and how long a placement waits for another gateway's to end."""


class InstanceManager:
    """Plans, creates, watches and re-places instances; keeps a cached view for the request path."""

    def __init__(
        self,
        store: StateStore,
        backends: Sequence[Backend],
        *,
        resolve: Callable[[str], ModelCard],
        choose: Callable[..., Backend | None],
        rank: Callable | None = None,
        auto_place: bool = True,
        context: Callable[[Backend, ModelCard], int | None] | None = None,
        reconcile_every: float = 0.5,
        load: Callable[[str], int] = lambda instance_id: 0,
        holder: str | None = None,
        routing: str = "affinity",
        on_route: Callable[[str], None] = lambda instance_id: None,
        min_replicas: int = 1,
        max_replicas: int = 1,
        drain_grace: float = 30.0,
        node_ttl: float = 3.0,
    ) -> None:
        self.store = store
        self.backends = list(backends)
        self.resolve = resolve
        self.choose = choose
        self.rank = rank
        self.auto_place = auto_place
        self.context = context
        self.reconcile_every = reconcile_every
        self._view: dict[str, Instance] = {}
        self._generation = -1
        self._incarnation = Incarnation(store)  # a store that restarted empty gets what this gateway knew back
        self._deployments: list[Deployment] = []  # as the last reconcile pass read them (``recovery.republish``)
        self._emptied_at = -math.inf  # monotonic time this gateway found the store restarted empty
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._create_lock = asyncio.Lock()
        self.replacements: dict[str, int] = {}  # model -> instances this gateway re-placed (``/metrics``)
        self.load = load  # instance id -> generations running + queued on it, every gateway's (``loads``)
        self.holder = holder or uuid.uuid4().hex[:12]  # this gateway, as the holder of store leases
        self.routed: dict[tuple[str, str], int] = {}  # (model, routing rule) -> requests (``/metrics``)
        self.routing = routing  # "affinity", "least_loaded" (no prefix key) or "round_robin" (in turn)
        self.on_route = on_route  # told the replica of each generation routed (``loads.LoadBoard.routed``)
        self.prefixes = PrefixTable()  # which replica this gateway sent each prompt prefix to
        self._turn = 0
        self.min_replicas, self.max_replicas = min_replicas, max_replicas  # bounds of a new deployment
        self.scale: Callable[[], Awaitable[object]] | None = None  # autoscaling, once per reconcile pass
        self._nodes: set[NodeId] = set()  # the nodes of the last reconcile pass: one that joins retries the unplaceable
        self.drain_grace = drain_grace  # seconds a drained replica's streams have to finish (``MESHGATE_DRAIN_GRACE``)
        # A node is gone when the store no longer has it. Not within a TTL (``MESHGATE_NODE_TTL``) of a call of this
        # gateway's failing (``StateStore.unavailable_at``): the store let lapse every node whose heartbeats could
        # not reach it, and they beat again once it answers.
        self.node_ttl = node_ttl
        self._before_away: set[NodeId] = set()  # the nodes seen up to then, and since while it was away
        self._drains_seen: dict[tuple[str, float], float] = {}  # (instance, its drain's since) -> first seen here
        self._pass_at = 0.0  # wall time the current reconcile pass began

    # ------------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await self._refresh(force=True)
        self._tasks = [
            asyncio.create_task(self._watch(), name="instances-watch"),
            asyncio.create_task(self._reconcile_loop(), name="instances-reconcile"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _watch(self) -> None:
        """Reconcile at once when the instances or deployments change. Node records change with every heartbeat
        (each node's, every second): a join, a drain or a departure is seen by the next periodic pass."""
        async for kind in self.store.watch():
            if kind == "instances":
                self._changed.set()

    async def _refresh(self, force: bool = False) -> None:
        generation = await self.store.generation()
        if force or generation != self._generation:
            found = await self.store.instances()
            if await self._republished():  # the store restarted empty, maybe since that read: what it has now
                found = await self.store.instances()
            self._generation = generation
            self._view = {i.id: i for i in found}

    async def _republished(self) -> bool:
        """Whether the store restarted empty since this gateway last looked, and it put back what it knew then
        (``recovery``): its replicas serve on, instead of being placed anew beside their running runners. Asked
        after every read the cache keeps (the view, the deployments), so an empty read never replaces them."""
        incarnation = await self._incarnation.new()
        if incarnation is None:
            return False
        await republish(self.store, self._deployments, self._view.values(), self.holder)
        self._incarnation.accept(incarnation)
        self._emptied_at = time.monotonic()  # no node is in it until its next heartbeat: as if it had been away
        return True

    async def _reconcile_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # ``asyncio.timeout``: 3.11's ``wait_for`` can swallow a
                async with asyncio.timeout(self.reconcile_every):  # cancel that meets a wake-up (close hung on it)
                    await self._changed.wait()
            self._changed.clear()
            try:
                await self._refresh()
                await self.reconcile()
            except StoreUnavailable:
                log.warning("reconcile: the state store is away; trying again in %gs", self.reconcile_every)
            except Exception:
                log.exception("reconcile failed; retrying")

    # ------------------------------------------------------------------------------------------- planning

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
        placed = self.placed_memory()
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
    async def _placing(self) -> AsyncIterator[None]:
        """Place (plan and write) as the only placer in the cluster, from the store's records as they are: the
        ``placing`` lease in the store, held by one gateway at a time (two gateways planning at once would each
        count only the memory their own view places, and fill a node twice over). Waits ``PLACING_WAIT`` seconds
        at most for another gateway's placement to end."""
        async with self._create_lock:
            deadline = time.monotonic() + PLACING_WAIT
            while not await self.store.claim(PLACING, self.holder, ttl=PLACING_LEASE):
                if time.monotonic() > deadline:
                    raise Overloaded("another gateway is placing models; retry shortly", retry_after=1.0)
                await asyncio.sleep(0.05)
            try:
                await self._refresh(force=True)
                yield
            finally:
                with contextlib.suppress(StoreUnavailable):  # else its lease lapses by itself
                    await self.store.release(PLACING, self.holder)

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
        occupied = {s.node_id: i.id for i in self.cached(card.name) for s in i.placement.shards}
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
            raise NoCapacity(_no_fit_message(card.name, candidates))
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
        self._view[instance.id] = instance
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
        autoscaling bounds given (see ``_record_deployment``)."""
        _check_bounds(min_replicas, max_replicas)
        card = self.resolve(model)
        placed: list[Instance] = []
        async with self._placing():
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
            await self._record_deployment(card.name, context=context, bounds=(min_replicas, max_replicas), pinned=True)
        return placed

    async def set_bounds(self, model: str, min_replicas: int | None, max_replicas: int | None) -> Deployment:
        """Change ``model``'s autoscaling bounds (``None``: keep that one). Raising ``min_replicas`` above the
        replicas it has places more; lowering ``max_replicas`` below them removes the extra ones once idle."""
        await self._refresh(force=True)
        current = next((d for d in await self.store.deployments() if d.model == model), None)
        if current is None or not self.cached(model):
            raise NotFound(f"model '{model}' has no deployment")
        lo = current.min_replicas if min_replicas is None else min_replicas
        hi = current.max_replicas if max_replicas is None else max_replicas
        _check_bounds(lo, hi)
        await self._record_deployment(model, bounds=(lo, hi), pinned=True)
        found = next((d for d in await self.store.deployments() if d.model == model), None)
        if found is None:  # its last replica was deleted meanwhile, and the deployment with it
            raise NotFound(f"model '{model}' has no deployment")
        await self.store.append_event(
            "deployment.bounds",
            f"{model}: min_replicas {found.min_replicas}, max_replicas {found.max_replicas}",
            data={"min_replicas": str(found.min_replicas), "max_replicas": str(found.max_replicas)},
        )
        return found

    async def _record_deployment(
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
        count = sum(1 for i in self.cached(model) if i.id != without and not isinstance(i.state, Draining))
        current = next((d for d in await self.store.deployments() if d.model == model), None)
        if count == 0:
            if current is not None:
                await self.store.delete_deployment(model)
                self._deployments = [d for d in self._deployments if d.model != model]
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
        self._deployments = [*(d for d in self._deployments if d.model != model), written]  # known at once

    async def beyond_minimum(self, model: str) -> int:
        """How many of ``model``'s replicas a request's ``keep_alive`` may unload: all of them unless an admin
        pinned its deployment, then those above its ``min_replicas`` (draining and given-up ones not counted)."""
        deployment = next((d for d in await self.store.deployments() if d.model == model), None)
        live = [i for i in self.cached(model) if not isinstance(i.state, Draining) and not given_up(i)]
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
            first = self._drains_seen.get((instance_id, state.since), time.monotonic())
            sooner = state.since + (time.monotonic() - first) + grace
            if sooner < state.until:
                shorter = msgspec.structs.replace(state, until=sooner)
                await self.store.set_state(instance_id, shorter, expected=Draining, epoch=found.epoch)
                await self._refresh(force=True)
                self._changed.set()
            return self._view.get(instance_id, found)
        if lower:
            await self._record_deployment(found.model, without=instance_id)
        if isinstance(found.state, Ready) and until > now and (settle or self.load(instance_id)):
            state = Draining(since=now, until=until, reason=reason, replaced=not lower)
            began = time.monotonic()
            if await self.store.set_state(instance_id, state, expected=Ready, epoch=found.epoch):
                self._drains_seen[(instance_id, now)] = began  # its window, on this clock (``_on_this_clock``)
                left = until - now
                await self.store.append_event(
                    "instance.draining",
                    f"{found.model} drains ({reason}): no new requests; {self.load(instance_id)} running or queued "
                    f"have {left:.0f}s to finish",
                    instance_id=instance_id,
                    data={"reason": reason, "grace_s": f"{left:.1f}", "load": str(self.load(instance_id))},
                )
                await self._refresh(force=True)
                self._changed.set()
                return self._view.get(instance_id)
            now_found = await self.store.get_instance(instance_id)  # the state moved since it was read
            if now_found is None or isinstance(now_found.state, Draining):  # another gateway removed or drains it
                await self._refresh(force=True)
                return None if now_found is None else self._view.get(instance_id, now_found)
            found = now_found
        await self._remove(found, f"deleted instance {instance_id} ({reason})", kind="instance.deleted")
        return None

    async def _remove(self, instance: Instance, message: str, *, kind: str) -> None:
        if await self.store.delete_instance(instance.id):
            await self.store.append_event(kind, message, instance_id=instance.id)
        self._view.pop(instance.id, None)

    async def unload(self, model: str, busy: Callable[[str], bool]) -> None:
        """Delete ``model``'s idle replicas now and the ``busy`` ones once idle (Ollama's ``keep_alive: 0``):
        another client's stream on a replica is never cut by it, and a deployment an admin pinned keeps its
        ``min_replicas`` (``beyond_minimum``)."""
        waiting = False
        left = await self.beyond_minimum(model)
        for instance in self.cached(model):
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
        if until is not None or any(i.expires_at is not None for i in self.cached(model)):
            await self.set_expiry(model, until)

    async def set_expiry(self, model: str, expires_at: float | None) -> None:
        """Set when ``model``'s ready instances are unloaded (``None``: never; Ollama's ``keep_alive``). Each write
        holds only over the ready state and epoch it read: one failed, drained or deleted meanwhile stays so."""
        await self._refresh()
        for instance in self.cached(model):
            if isinstance(instance.state, Ready) and instance.expires_at != expires_at:
                current = await self.store.get_instance(instance.id)
                if current is not None and isinstance(current.state, Ready):
                    changed = msgspec.structs.replace(current, expires_at=expires_at)
                    await self.store.update_instance(changed, expected=Ready, epoch=current.epoch)
        await self._refresh(force=True)

    # ------------------------------------------------------------------------------------------- hot path

    def placed_memory(self) -> dict[str, int]:
        """Bytes per node the instances in this gateway's view take (or will, once loaded): every state but failed
        (whose runners are stopped)."""
        placed: dict[str, int] = {}
        for instance in self._view.values():
            if not isinstance(instance.state, Failed):
                for node_id, size in instance.placement.memory_per_node.items():
                    placed[node_id] = placed.get(node_id, 0) + size
        return placed

    def snapshot(self) -> list[Instance]:
        """Every instance as this gateway last read them."""
        return list(self._view.values())

    async def refresh(self) -> None:
        """Read every instance again now."""
        await self._refresh(force=True)

    async def lower(self, model: str, without: str) -> None:
        """Lower ``model``'s deployment by the replica ``without`` (before it is drained)."""
        await self._record_deployment(model, without=without)

    def ids(self) -> set[str]:
        """The ids of every instance in this gateway's view."""
        return set(self._view)

    def cached(self, model: str) -> list[Instance]:
        return [i for i in self._view.values() if i.model == model]

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
        async with self._placing():
            found = self._pick(card.name, context, routing)
            if found is not None:
                return found
            largest = _usable(sorted(self.cached(card.name), key=lambda i: -i.placement.context))
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
                created = await self.create(card.name, context=context, reason=why)
            except NoCapacity:
                if largest is None:
                    raise
                log.warning("no room for a %s replica of %s tokens; serving on %s", card.name, context, largest.id)
                return self._routed(largest, routing)
            await self._record_deployment(card.name, context=context)
            return self._routed(created, routing)

    def _pick(self, model: str, context: int | None, routing: Routing | None) -> Instance | None:
        """A ready replica holding ``context`` tokens, routed; else one holding it that is coming up."""
        holding = [i for i in self.cached(model) if context is None or i.placement.context >= context]
        ready = [i for i in holding if isinstance(i.state, Ready)]
        if not ready:
            found = _usable(holding)
            return self._routed(found, routing) if found is not None else None
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
            choice = route(replicas, routing.key, preferred=preferred)
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
            instance = self._view.get(instance_id) or await self.store.get_instance(instance_id)
            if instance is None:
                raise BackendUnavailable(f"instance {instance_id} was deleted while starting")
            if isinstance(instance.state, Ready):
                return instance
            if isinstance(instance.state, Failed) and instance.attempts >= MAX_ATTEMPTS:
                raise BackendUnavailable(f"instance {instance_id} failed: {instance.state.reason}")
            if isinstance(instance.state, Draining):
                raise BackendUnavailable(f"instance {instance_id} is draining ({instance.state.reason})")
            await asyncio.sleep(0.05)
            await self._refresh()
        raise BackendUnavailable(f"instance {instance_id} was not ready within {timeout:.0f}s")

    async def report_unreachable(self, instance: Instance, error: str) -> None:
        """The gateway could not reach the instance's runner: fail it so it is re-placed. Only the epoch the
        caller reached fails: a late report about a placement already replaced changes nothing."""
        failed = Failed(reason=f"runner unreachable: {error}")
        try:
            if await self.store.set_state(instance.id, failed, expected=Ready, epoch=instance.epoch):
                await self.store.append_event("instance.failed", failed.reason, instance_id=instance.id)
            await self._refresh(force=True)
        except StoreUnavailable:  # the agent reports a dead runner too, and the next request finds it again
            log.warning("could not report instance %s unreachable: the state store is away", instance.id)
        self._changed.set()

    # ------------------------------------------------------------------------------------------- reconcile

    async def reconcile(self) -> None:
        """One pass: the steps ``lifecycle.plan`` gives for the cached instances, carried out in order (promote,
        fail, re-place, expire, drain, remove), then autoscaling and the replicas deployments miss."""
        nodes = await self.store.nodes()
        await self._republished()  # each pass (a new store's generation starts again from 0); after the read
        node_ids = {n.id for n in nodes}
        if time.monotonic() - max(self.store.unavailable_at, self._emptied_at) < self.node_ttl:
            self._before_away |= node_ids  # the store expired them while no heartbeat could reach it: a TTL to beat
            node_ids = set(self._before_away)
        else:
            self._before_away = node_ids
        now = self._pass_at = time.time()  # what a node's agent stamps (its drain's end) is on its clock: the time
        # left of it is not (a heartbeat's age off, at most)
        stopping = {n.id: now + n.draining_until - n.heartbeat_at for n in nodes if n.draining_until is not None}
        joined, self._nodes = bool(node_ids - self._nodes), node_ids
        for step in lifecycle.plan(self._on_this_clock(now), node_ids, stopping, self.load, now, joined):
            instance = self._view.get(step.instance_id)
            if instance is not None:
                await self._carry_out(step, instance)
        await self._refresh()
        if self.scale is not None:
            try:
                await self.scale()
            except Exception:  # the store away for a moment: placing what deployments miss goes on
                log.exception("autoscaling failed; deciding again next pass")
        await self._fill_deployments()

    def _on_this_clock(self, wall: float) -> list[Instance]:
        """The view, each drain's window moved onto this gateway's clock: it began when this gateway first saw it
        (or wrote it), and lasts what its writer gave it. Another gateway's clock may be off from this one's by
        any amount; a drain judged by it would end early (cutting streams) or late. ``wall``: this pass's now."""
        mono = time.monotonic()
        seen: dict[tuple[str, float], float] = {}
        instances = []
        for instance in self._view.values():
            state = instance.state
            if isinstance(state, Draining):
                key = (instance.id, state.since)
                first = seen[key] = self._drains_seen.get(key, mono)
                since = wall - (mono - first)
                state = msgspec.structs.replace(state, since=since, until=since + state.until - state.since)
                instance = msgspec.structs.replace(instance, state=state)
            instances.append(instance)
        self._drains_seen = seen
        return instances

    async def _carry_out(self, step: lifecycle.Step, instance: Instance) -> None:
        """One step of a reconcile pass, as a compare-and-set on the instance's state where it changes one."""
        iid = instance.id
        if isinstance(step, lifecycle.Promote):  # a replica that came up has its tries back
            ready = msgspec.structs.replace(instance, state=Ready(), attempts=0, updated_at=time.time())
            if await self.store.update_instance(ready, expected=Starting, epoch=instance.epoch):
                await self.store.append_event("instance.ready", f"{instance.model} is ready", instance_id=iid)
        elif isinstance(step, lifecycle.Fail):
            expected = Ready if step.expected == "ready" else Starting
            if await self.store.set_state(iid, Failed(reason=step.reason), expected=expected, epoch=instance.epoch):
                log.warning("instance %s failed: %s", iid, step.reason)
                await self.store.append_event("instance.failed", step.reason, instance_id=iid)
        elif isinstance(step, lifecycle.Replace):
            await self._replace(msgspec.structs.replace(instance, attempts=0) if step.fresh else instance, step.why)
        elif isinstance(step, lifecycle.Expire):
            if await self.beyond_minimum(instance.model) <= 0:  # an admin's minimum stays: the expiry goes instead
                kept = msgspec.structs.replace(instance, expires_at=None)
                await self.store.update_instance(kept, expected=Ready, epoch=instance.epoch)
                return
            with contextlib.suppress(NotFound):  # settles first: another gateway may have just begun a stream on it
                await self.drain(iid, reason="expired (keep_alive)", settle=True)
        elif isinstance(step, lifecycle.Drain):
            with contextlib.suppress(NotFound):  # another gateway removed it in the meantime
                left = max(0.0, step.until - self._pass_at)  # what is left of it: this pass may have taken a while
                await self.drain(iid, reason=step.reason, grace=left, lower=False, settle=True)
        else:
            await self._remove(instance, f"{instance.model} {step.why}", kind="instance.drained")

    async def _fill_deployments(self) -> None:
        """Place the replicas deployments miss (``missing_replicas``), one gateway at a time per model."""
        found = await self.store.deployments()
        if await self._republished():
            found = await self.store.deployments()
        self._deployments = found
        if not self.auto_place:
            return
        for model in missing_replicas(self._deployments, list(self._view.values())):
            if not await self.store.claim(f"deploy:{model}", self.holder, ttl=10.0):
                continue  # another gateway is on it
            await self._refresh(force=True)
            if missing_replicas(await self.store.deployments(), list(self._view.values())).get(model, 0) <= 0:
                continue
            try:
                deployment = next(d for d in await self.store.deployments() if d.model == model)
                async with self._placing():
                    created = await self.create(
                        model, context=deployment.context, reason=f"deployment: {deployment.replicas} replicas"
                    )
            except Exception as exc:  # no room, the model left the catalog: say so, try again next pass
                log.warning("cannot place a replica of %s: %s", model, exc)
                continue
            stale = next((i for i in self.cached(model) if given_up(i)), None)
            if stale is not None:  # its substitute is placed: the record that said why it failed goes
                why = stale.state.reason if isinstance(stale.state, Failed) else ""
                await self._remove(
                    stale, f"{model}: {created.id} placed in place of {stale.id} ({why})", kind="instance.superseded"
                )

    async def _replace(self, instance: Instance, why: str) -> None:
        """Plan again on the nodes that remain, for the context it held: with the instance's own constraints if it
        still fits so, else with none. Written over the failed state and epoch read, in one step."""
        async with self._placing():
            await self._replace_placed(instance, why)

    async def _replace_placed(self, instance: Instance, why: str) -> None:
        candidates: list[Candidate] = []
        context = instance.placement.context or None
        try:
            if instance.strategy or instance.min_nodes:
                candidates = await self.preview(
                    instance.model, strategy=instance.strategy, min_nodes=instance.min_nodes, context=context
                )
            if not any(c.fits for c in candidates):
                candidates = await self.preview(instance.model, context=context)
        except Exception as exc:  # the model vanished from the catalog, no backend, ...
            candidates, why = [], f"{why}; cannot plan: {exc}"
        fitting = [c for c in candidates if c.fits]
        attempts = instance.attempts + 1
        if not fitting:
            given_up = msgspec.structs.replace(instance, attempts=MAX_ATTEMPTS)
            if await self.store.update_instance(given_up, expected=Failed, epoch=instance.epoch):
                await self.store.append_event(
                    "instance.unplaceable", _no_fit_message(instance.model, candidates), instance_id=instance.id
                )
            return
        replaced = msgspec.structs.replace(
            instance,
            placement=fitting[0],
            state=Starting(),
            runners={},
            epoch=instance.epoch + 1,
            attempts=attempts,
            updated_at=time.time(),
        )
        if not await self.store.update_instance(replaced, expected=Failed, epoch=instance.epoch, runners=True):
            return  # another gateway re-placed it, or it was deleted
        self.replacements[instance.model] = self.replacements.get(instance.model, 0) + 1
        await self.store.append_event(
            "instance.replaced",
            f"re-placed {instance.model} after: {why}; now on {', '.join(s.node_id for s in fitting[0].shards)}",
            instance_id=instance.id,
            data={"placement": msgspec.json.encode(fitting[0]).decode(), "reason": why},
        )


def missing_replicas(deployments: Sequence[Deployment], instances: Sequence[Instance]) -> dict[str, int]:
    """Replicas each deployment lacks: its desired count less the instances of its model that are coming up,
    serving or being re-placed. A draining one is on its way out, and one that failed for good (``given_up``: no
    tries left) holds nothing: a substitute is due for each."""
    have: dict[str, int] = {}
    for instance in instances:
        if not isinstance(instance.state, Draining) and not given_up(instance):
            have[instance.model] = have.get(instance.model, 0) + 1
    lacking = {d.model: d.replicas - have.get(d.model, 0) for d in deployments}
    return {model: n for model, n in lacking.items() if n > 0}


def given_up(instance: Instance) -> bool:
    """Failed with no re-placement tries left: it waits for a node to join, and its deployment places a
    substitute meanwhile."""
    return isinstance(instance.state, Failed) and instance.attempts >= MAX_ATTEMPTS


def _check_bounds(lo: int | None, hi: int | None) -> None:
    if (lo is not None and lo < 1) or (hi is not None and hi < 1):
        raise InvalidRequest("min_replicas and max_replicas must be at least 1", param="min_replicas")
    if lo is not None and hi is not None and lo > hi:
        raise InvalidRequest(f"min_replicas ({lo}) is above max_replicas ({hi})", param="min_replicas")


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


def _no_fit_message(model: str, candidates: Sequence[Candidate]) -> str:
    if not candidates:
        return f"model '{model}' fits nowhere: no nodes are registered"
    reasons = "; ".join(dict.fromkeys(c.reason or "" for c in candidates if c.reason))
    return f"model '{model}' fits nowhere: {reasons}"
