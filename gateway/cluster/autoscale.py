"""Autoscaling: a pure decision over the observed cluster, and the executor that carries it out.

The rule, per deployment (a model's desired replicas, bounded by its ``min_replicas`` and ``max_replicas``):

- **Up.** When requests of the model have waited for a slot (some replica's queue was never empty) for
  ``Policy.up_wait`` seconds without a break, add one replica, while the model has fewer than ``max_replicas``,
  none of its replicas is still coming up, no scaling of it happened within ``Policy.cooldown`` seconds, and
  some node has room for one more. A short spike (a queue that empties sooner) adds nothing.
- **Down.** When a ready replica has run and queued nothing for ``Policy.down_idle`` seconds (the keep-alive),
  no request of the model waits, more than ``min_replicas`` exist and the cooldown has passed, remove that
  replica (the one idle longest). A replica with a request running or queued is never removed for idleness.
- **Above max.** A model with more ready replicas than ``max_replicas`` (the bound was lowered) loses one at
  once, the least loaded (``ScaleDown.busy``): it drains, so its streams finish first (or resume elsewhere).
  Replicas still starting do not count here: one is stored a moment before the deployment that asks for it.
- Replicas draining are on their way out: they count for nothing. While one drains because its node stops
  (``Draining.replaced``: its replacement is placed elsewhere) its model does not scale up: a rolling restart
  under load would otherwise add replicas it no longer needs once the restart is over.
- Every other case where a bound, the cooldown or room stopped a change is a ``Hold`` with its reason: shown to
  tests and logs, never acted on.

``observe(history, instances, loads, now)`` folds one observation into ``History`` (since when each model has
had requests waiting, since when each ready replica has been idle); ``decide(...)`` is a pure function of the
deployments, instances, loads, that history, the time and the ``Policy``, returning ``Action``s that carry
their reason and the figures they used. Both are tested as tables.

``Autoscaler`` is the executor, run by each gateway's reconcile loop (``reconcile.Reconciler.scale``). It acts on
a model only while it holds the store lease ``deploy:{model}`` (the one that placing missing replicas takes),
and decides again on fresh state under it, so two gateways never both carry out one decision; the deployment's
``scaled_at`` (in the store) makes the cooldown cluster-wide. Up raises the deployment's ``replicas`` and lets
the reconcile loop (``reconcile.Reconciler``) place the replica; down lowers it and drains the instance
(``deployments.Deployments.drain``: deleted at once when idle). Each action appends ``deployment.scaled_up`` or
``deployment.scaled_down`` to ``/events`` with its reason and figures.

The executor sees the instances through ``Scaling``, the narrow port it needs (``InstanceManager`` is one).

Imports the standard library, msgspec, ``backends.placement`` (ids, candidates) and the gateway's cluster
records, loads and store interface; nothing imports it but the runtime that wires it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import msgspec

from meshgate.backends.placement import Candidate, InstanceId
from meshgate.gateway.cluster.loads import ReplicaLoad
from meshgate.gateway.cluster.records import Deployment, Draining, Instance, Ready
from meshgate.gateway.cluster.store import StateStore
from meshgate.protocols.model import NotFound

__all__ = [
    "Action", "Autoscaler", "History", "Hold", "Policy", "ScaleDown", "ScaleUp", "Scaling", "decide", "observe",
]  # fmt: skip

log = logging.getLogger("meshgate.autoscale")

Figures = dict[str, float]


class Policy(msgspec.Struct, frozen=True, kw_only=True):
    """Thresholds, in seconds (``MESHGATE_SCALE_UP_WAIT``, ``MESHGATE_SCALE_DOWN_IDLE``,
    ``MESHGATE_SCALE_COOLDOWN``)."""

    up_wait: float = 10.0
    down_idle: float = 300.0
    cooldown: float = 30.0


class ScaleUp(msgspec.Struct, frozen=True, tag="scale_up"):
    model: str
    reason: str
    figures: Figures


class ScaleDown(msgspec.Struct, frozen=True, tag="scale_down"):
    """Remove ``instance_id``; ``busy``: even with requests on it (above ``max_replicas``), by draining."""

    model: str
    instance_id: InstanceId
    reason: str
    figures: Figures
    busy: bool = False


class Hold(msgspec.Struct, frozen=True, tag="hold"):
    """A change was called for but a bound, the cooldown or a lack of room stopped it."""

    model: str
    reason: str
    figures: Figures


Action = ScaleUp | ScaleDown | Hold


class History(msgspec.Struct, frozen=True):
    """What one observation cannot show: since when (Unix seconds, unbroken) each model has had requests waiting
    for a slot, and each ready replica has been idle."""

    waiting_since: dict[str, float] = msgspec.field(default_factory=dict)
    idle_since: dict[str, float] = msgspec.field(default_factory=dict)


_NONE = ReplicaLoad()


def _idle(load: ReplicaLoad) -> bool:
    return load.running == 0 and load.queued == 0


def observe(history: History, instances: Sequence[Instance], loads: Mapping[str, ReplicaLoad], now: float) -> History:
    """``history`` with one more observation folded in (a run that breaks starts again at its next sighting)."""
    queued: dict[str, int] = {}
    for i in instances:
        queued[i.model] = queued.get(i.model, 0) + loads.get(i.id, _NONE).queued
    return History(
        waiting_since={m: history.waiting_since.get(m, now) for m, q in queued.items() if q > 0},
        idle_since={
            i.id: history.idle_since.get(i.id, now)
            for i in instances
            if isinstance(i.state, Ready) and _idle(loads.get(i.id, _NONE))
        },
    )


def decide(
    deployments: Sequence[Deployment],
    instances: Sequence[Instance],
    loads: Mapping[str, ReplicaLoad],
    now: float,
    policy: Policy,
    history: History,
    room: Mapping[str, bool] | None = None,
) -> list[Action]:
    """At most one action per deployment (see the module docstring for the rule). ``room``: whether one more
    replica of a model fits on some node, where known; a model it leaves out is taken to fit (the executor
    checks before it acts, and decides again)."""
    actions: list[Action] = []
    for d in deployments:
        mine = [i for i in instances if i.model == d.model and not isinstance(i.state, Draining)]
        draining = any(i.model == d.model and isinstance(i.state, Draining) and i.state.replaced for i in instances)
        action = _decide_one(d, mine, loads, now, policy, history, (room or {}).get(d.model, True), draining)
        if action is not None:
            actions.append(action)
    return actions


def _decide_one(
    d: Deployment,
    mine: Sequence[Instance],
    loads: Mapping[str, ReplicaLoad],
    now: float,
    policy: Policy,
    history: History,
    room: bool,
    draining: bool = False,
) -> Action | None:
    count = len(mine)
    running = sum(loads.get(i.id, _NONE).running for i in mine)
    queued = sum(loads.get(i.id, _NONE).queued for i in mine)
    base: Figures = {
        "replicas": count,
        "min_replicas": d.min_replicas,
        "max_replicas": d.max_replicas,
        "running": running,
        "queued": queued,
    }
    ready = [i for i in mine if isinstance(i.state, Ready)]
    if len(ready) > d.max_replicas:  # the bound was lowered: drain the least loaded, busy or not
        # (ready ones only: a replica just placed is stored a moment before the deployment that asks for it)
        def load_of(i: Instance) -> int:
            load = loads.get(i.id, _NONE)
            return load.running + load.queued

        extra = min(ready, key=load_of)
        figures = base | {"load": float(load_of(extra))}
        why = f"{len(ready)} ready replicas, above max_replicas ({d.max_replicas})"
        return ScaleDown(d.model, extra.id, why, figures, busy=True)
    cooling = now - d.scaled_at < policy.cooldown
    since = history.waiting_since.get(d.model)
    if since is not None:
        waited = now - since
        if waited < policy.up_wait:
            return None  # a spike, so far
        figures = base | {"waited_s": round(waited, 1), "up_wait_s": policy.up_wait}
        why = f"{queued} request(s) waited for a slot for {waited:.1f}s (threshold {policy.up_wait:g}s)"
        if count >= d.max_replicas:
            return Hold(d.model, f"{why}, but it has max_replicas ({d.max_replicas})", figures)
        if d.replicas > count or any(not isinstance(i.state, Ready) for i in mine):
            return Hold(d.model, f"{why}; a replica is still coming up", figures)
        if draining:
            return Hold(d.model, f"{why}; a replica's node is stopping (its replacement takes its load)", figures)
        if cooling:
            return Hold(d.model, f"{why}; scaled {now - d.scaled_at:.0f}s ago (cooldown {policy.cooldown:g}s)", figures)
        if not room:
            return Hold(d.model, f"{why}, but no node has room for another replica", figures)
        return ScaleUp(d.model, f"{why} on {count} replica(s)", figures)
    idle: list[tuple[float, InstanceId]] = sorted(
        (history.idle_since[i.id], i.id)
        for i in mine
        if i.id in history.idle_since and isinstance(i.state, Ready) and _idle(loads.get(i.id, _NONE))
    )
    if not idle:
        return None
    first, instance_id = idle[0]
    idle_for = now - first
    if idle_for < policy.down_idle:
        return None
    figures = base | {"idle_s": round(idle_for, 1), "down_idle_s": policy.down_idle}
    why = f"replica {instance_id} idle for {idle_for:.0f}s (threshold {policy.down_idle:g}s)"
    if count <= d.min_replicas:
        return Hold(d.model, f"{why}, but it has min_replicas ({d.min_replicas})", figures)
    if cooling:
        return Hold(d.model, f"{why}; scaled {now - d.scaled_at:.0f}s ago (cooldown {policy.cooldown:g}s)", figures)
    return ScaleDown(d.model, instance_id, f"{why}, {count} replicas > min_replicas ({d.min_replicas})", figures)


class Scaling(Protocol):
    """What the autoscaler needs of the instances: the store and this gateway's name in its leases, the cached
    instances and each one's load as this gateway routes it, a fresh read, a deployment lowered by one replica, a
    drain, and a preview of where another replica would go."""

    store: StateStore
    holder: str
    load: Callable[[str], int]

    def snapshot(self) -> list[Instance]: ...

    async def refresh(self) -> None: ...

    async def lower(self, model: str, without: str) -> None: ...

    async def drain(self, instance_id: InstanceId, *, reason: str, lower: bool, settle: bool) -> object: ...

    async def preview(self, model: str, *, context: int | None = None) -> list[Candidate]: ...


class Autoscaler:
    """Carries out ``decide`` in one gateway: call ``step`` once per reconcile pass (``InstanceManager.scale``)."""

    def __init__(
        self,
        manager: Scaling,
        policy: Policy,
        view: Callable[[str], ReplicaLoad],
        *,
        clock: Callable[[], float] = time.time,
        lease: float = 10.0,
    ) -> None:
        self.manager = manager
        self.policy = policy
        self.view = view  # instance id -> its load across every gateway (``LoadBoard.view``)
        self.clock = clock
        self.lease = lease
        self.history = History()

    def _observed(self) -> tuple[list[Instance], dict[str, ReplicaLoad]]:
        instances = self.manager.snapshot()
        return instances, {i.id: self.view(i.id) for i in instances}

    async def step(self) -> list[Action]:
        """Observe, decide and act on each decision this gateway wins the lease for. Returns what it did."""
        instances, loads = self._observed()
        now = self.clock()
        self.history = observe(self.history, instances, loads, now)
        store = self.manager.store
        done: list[Action] = []
        for action in decide(await store.deployments(), instances, loads, now, self.policy, self.history):
            if isinstance(action, Hold):
                log.debug("autoscale %s: %s", action.model, action.reason)
                continue
            if not await store.claim(f"deploy:{action.model}", self.manager.holder, ttl=self.lease):
                continue  # another gateway decides for this model now
            acted = await self._carry_out(action)
            if acted is not None:
                done.append(acted)
        return done

    async def _carry_out(self, first: Action) -> Action | None:
        """Decide again for ``first.model`` on fresh state (with room checked for a scale-up); act if it holds."""
        manager, store = self.manager, self.manager.store
        await manager.refresh()
        instances, loads = self._observed()
        deployment = next((d for d in await store.deployments() if d.model == first.model), None)
        if deployment is None:
            return None
        room = {first.model: await self._room(deployment)} if isinstance(first, ScaleUp) else None
        now = self.clock()
        again = decide([deployment], instances, loads, now, self.policy, self.history, room)
        action = again[0] if again else None
        if isinstance(action, ScaleUp):  # from the replicas that serve: never the draining ones (an overshoot)
            count = sum(1 for i in instances if i.model == action.model and not isinstance(i.state, Draining))
            await store.put_deployment(msgspec.structs.replace(deployment, replicas=count + 1, scaled_at=now))
            message = f"{action.model}: {count} -> {count + 1} replicas: {action.reason}"
            await store.append_event("deployment.scaled_up", message, data=_data(action))
            return action
        if isinstance(action, ScaleDown):
            if manager.load(action.instance_id) and not action.busy:
                return None  # a request was routed to it meanwhile: idle it is not
            await manager.lower(action.model, without=action.instance_id)
            current = next((d for d in await store.deployments() if d.model == action.model), None)
            if current is not None:
                await store.put_deployment(msgspec.structs.replace(current, scaled_at=now))
            count = sum(1 for i in instances if i.model == action.model and not isinstance(i.state, Draining))
            message = f"{action.model}: {count} -> {count - 1} replicas: {action.reason}"
            await store.append_event(
                "deployment.scaled_down", message, instance_id=action.instance_id, data=_data(action)
            )
            with contextlib.suppress(NotFound):  # gone meanwhile
                await manager.drain(action.instance_id, reason="scaled down", lower=False, settle=True)
            return action
        return None

    async def _room(self, deployment: Deployment) -> bool:
        try:
            candidates = await self.manager.preview(deployment.model, context=deployment.context)
        except Exception as exc:  # the model left the catalog, no backend: no room, and say why in the log
            log.warning("cannot plan another replica of %s: %s", deployment.model, exc)
            return False
        return any(c.fits for c in candidates)


def _data(action: ScaleUp | ScaleDown) -> dict[str, str]:
    return {"reason": action.reason, **{k: f"{v:g}" for k, v in action.figures.items()}}
