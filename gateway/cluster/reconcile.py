"""The reconcile loop: each gateway's pass over the instances, once a second and whenever they change.

A pass carries out the steps of the pure lifecycle rule (``lifecycle.plan``) over the cached view, each as a
compare-and-set on the state and epoch read (two gateways never act twice): an instance becomes ``Ready`` when
every shard's runner reports ready, ``Failed(reason)`` when a node leaves or a runner fails, and a failed one is
re-placed on the nodes that remain when it fits, for the context it held; an expired or drained one goes. Then
autoscaling (``scale``: ``autoscale.Autoscaler.step``) and the replicas deployments miss, placed one gateway at a
time per model (a store lease). A node is gone when the store no longer has it, but not within a TTL
(``MESHGATE_NODE_TTL``) of this gateway's store calls failing or of the store restarting empty: the store let
lapse every node whose heartbeats could not reach it, and they beat again once it answers.

Imports the lifecycle rule, the records, the cached view and the deployments.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import msgspec

from meshgate.backends.placement import Candidate, NodeId
from meshgate.gateway.cluster import lifecycle
from meshgate.gateway.cluster.deployments import Deployments, given_up, no_fit_message
from meshgate.gateway.cluster.lifecycle import MAX_ATTEMPTS
from meshgate.gateway.cluster.records import Deployment, Draining, Failed, Instance, Ready, Starting
from meshgate.gateway.cluster.view import InstanceCache
from meshgate.protocols.model import NotFound, StoreUnavailable

__all__ = ["Reconciler", "missing_replicas"]

log = logging.getLogger("meshgate.instances")


class Reconciler:
    """One gateway's reconcile loop (``run``) and its passes (``reconcile``)."""

    def __init__(
        self,
        cache: InstanceCache,
        deployments: Deployments,
        *,
        auto_place: bool = True,
        load: Callable[[str], int] = lambda instance_id: 0,
        reconcile_every: float = 0.5,
        node_ttl: float = 3.0,
    ) -> None:
        self.cache = cache
        self.store = cache.store
        self.deployments = deployments
        self.auto_place = auto_place
        self.load = load  # instance id -> generations running + queued on it, every gateway's (``loads``)
        self.reconcile_every = reconcile_every
        self.node_ttl = node_ttl
        self.scale: Callable[[], Awaitable[object]] | None = None  # autoscaling, once per reconcile pass
        self.replacements: dict[str, int] = {}  # model -> instances this gateway re-placed (``/metrics``)
        self._nodes: set[NodeId] = set()  # the nodes of the last pass: one that joins retries the unplaceable
        self._before_away: set[NodeId] = set()  # the nodes seen up to then, and since while it was away
        self._pass_at = 0.0  # wall time the current reconcile pass began

    async def run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):  # ``asyncio.timeout``: 3.11's ``wait_for`` can swallow a
                async with asyncio.timeout(self.reconcile_every):  # cancel that meets a wake-up (close hung on it)
                    await self.cache.changed.wait()
            self.cache.changed.clear()
            try:
                await self.cache.refresh()
                await self.reconcile()
            except StoreUnavailable:
                log.warning("reconcile: the state store is away; trying again in %gs", self.reconcile_every)
            except Exception:
                log.exception("reconcile failed; retrying")

    async def reconcile(self) -> None:
        """One pass: the steps ``lifecycle.plan`` gives for the cached instances, carried out in order (promote,
        fail, re-place, expire, drain, remove), then autoscaling and the replicas deployments miss."""
        nodes = await self.store.nodes()
        await self.cache.republished()  # each pass (a new store's generation starts again from 0); after the read
        node_ids = {n.id for n in nodes}
        if time.monotonic() - max(self.store.unavailable_at, self.cache.emptied_at) < self.node_ttl:
            self._before_away |= node_ids  # the store expired them while no heartbeat could reach it: a TTL to beat
            node_ids = set(self._before_away)
        else:
            self._before_away = node_ids
        now = self._pass_at = time.time()  # what a node's agent stamps (its drain's end) is on its clock: the time
        # left of it is not (a heartbeat's age off, at most)
        stopping = {n.id: now + n.draining_until - n.heartbeat_at for n in nodes if n.draining_until is not None}
        joined, self._nodes = bool(node_ids - self._nodes), node_ids
        for step in lifecycle.plan(self._on_this_clock(now), node_ids, stopping, self.load, now, joined):
            instance = self.cache.by_id.get(step.instance_id)
            if instance is not None:
                await self._carry_out(step, instance)
        await self.cache.refresh()
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
        for instance in self.cache.by_id.values():
            state = instance.state
            if isinstance(state, Draining):
                key = (instance.id, state.since)
                first = seen[key] = self.cache.drains_seen.get(key, mono)
                since = wall - (mono - first)
                state = msgspec.structs.replace(state, since=since, until=since + state.until - state.since)
                instance = msgspec.structs.replace(instance, state=state)
            instances.append(instance)
        self.cache.drains_seen = seen
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
            if await self.deployments.beyond_minimum(instance.model) <= 0:  # an admin's minimum stays: the expiry goes
                kept = msgspec.structs.replace(instance, expires_at=None)
                await self.store.update_instance(kept, expected=Ready, epoch=instance.epoch)
                return
            with contextlib.suppress(NotFound):  # settles first: another gateway may have just begun a stream on it
                await self.deployments.drain(iid, reason="expired (keep_alive)", settle=True)
        elif isinstance(step, lifecycle.Drain):
            with contextlib.suppress(NotFound):  # another gateway removed it in the meantime
                left = max(0.0, step.until - self._pass_at)  # what is left of it: this pass may have taken a while
                await self.deployments.drain(iid, reason=step.reason, grace=left, lower=False, settle=True)
        else:
            await self.deployments.remove(instance, f"{instance.model} {step.why}", kind="instance.drained")

    async def _fill_deployments(self) -> None:
        """Place the replicas deployments miss (``missing_replicas``), one gateway at a time per model."""
        deployments = await self.cache.read_deployments()
        if not self.auto_place:
            return
        for model in missing_replicas(deployments, self.cache.snapshot()):
            if not await self.store.claim(f"deploy:{model}", self.cache.holder, ttl=10.0):
                continue  # another gateway is on it
            await self.cache.refresh(force=True)
            if missing_replicas(await self.store.deployments(), list(self.cache.by_id.values())).get(model, 0) <= 0:
                continue
            try:
                deployment = next(d for d in await self.store.deployments() if d.model == model)
                async with self.deployments.placing():
                    created = await self.deployments.create(
                        model, context=deployment.context, reason=f"deployment: {deployment.replicas} replicas"
                    )
            except Exception as exc:  # no room, the model left the catalog: say so, try again next pass
                log.warning("cannot place a replica of %s: %s", model, exc)
                continue
            stale = next((i for i in self.cache.cached(model) if given_up(i)), None)
            if stale is not None:  # its substitute is placed: the record that said why it failed goes
                why = stale.state.reason if isinstance(stale.state, Failed) else ""
                await self.deployments.remove(
                    stale, f"{model}: {created.id} placed in place of {stale.id} ({why})", kind="instance.superseded"
                )

    async def _replace(self, instance: Instance, why: str) -> None:
        """Plan again on the nodes that remain, for the context it held: with the instance's own constraints if it
        still fits so, else with none. Written over the failed state and epoch read, in one step."""
        async with self.deployments.placing():
            await self._replace_placed(instance, why)

    async def _replace_placed(self, instance: Instance, why: str) -> None:
        candidates: list[Candidate] = []
        context = instance.placement.context or None
        try:
            if instance.strategy or instance.min_nodes:
                candidates = await self.deployments.preview(
                    instance.model, strategy=instance.strategy, min_nodes=instance.min_nodes, context=context
                )
            if not any(c.fits for c in candidates):
                candidates = await self.deployments.preview(instance.model, context=context)
        except Exception as exc:  # the model vanished from the catalog, no backend, ...
            candidates, why = [], f"{why}; cannot plan: {exc}"
        fitting = [c for c in candidates if c.fits]
        attempts = instance.attempts + 1
        if not fitting:
            given_up = msgspec.structs.replace(instance, attempts=MAX_ATTEMPTS)
            if await self.store.update_instance(given_up, expected=Failed, epoch=instance.epoch):
                await self.store.append_event(
                    "instance.unplaceable", no_fit_message(instance.model, candidates), instance_id=instance.id
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
