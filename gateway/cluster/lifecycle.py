"""The instance lifecycle rule: what one reconcile pass does to each instance, as a pure function.

``plan(instances, nodes, load, now, joined)`` returns the ``Step``s a pass takes, in order, from what the store
shows (each instance's state and runner reports, the live nodes and which of them drain) and the shared load; it
reads and writes nothing, so it is tested as a table. ``InstanceManager.reconcile`` carries the steps out, each a
compare-and-set on the instance's state, so two gateways planning the same step act once. Per instance, the
first rule that holds:

1. **Draining**: ``Remove`` it when a node or runner of it is gone, at the end of its grace (what still runs
   resumes elsewhere), or once nothing runs or queues on it for ``SETTLE`` seconds after the drain began.
2. **Starting or ready on a draining node**: ``Drain`` a ready one until the node's ``draining_until`` (its
   deployment keeps its count, so a replacement is placed elsewhere); ``Fail`` one still starting (re-placed).
3. **Ready past its keep-alive** (``expires_at``): ``Expire`` it once no gateway runs or queues anything on it.
4. **Starting or ready with a node gone or a runner failed** (for its epoch): ``Fail`` it.
5. **Starting with every shard's runner ready**: ``Promote`` it.
6. **Failed**: ``Replace`` it while it has tries left (``MAX_ATTEMPTS``), or with fresh tries once a node joins
   (it fitted nowhere; the new node may hold it).

The node agent's rule is here too: ``shard_plan`` says which runner processes of a node to ``Launch``, to ``Stop``
(their instance is gone, failed, re-placed with a new epoch, or moved off the node) and which have ``Died`` (to
be reported failed, once per epoch; the gateway then re-places the instance). ``NodeAgent.reconcile`` carries it
out.

Imports msgspec, ``backends.placement`` (ids) and the cluster records only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Set

import msgspec

from meshgate.backends.placement import InstanceId, NodeId
from meshgate.gateway.cluster.records import Draining, Failed, Instance, Ready, Starting

__all__ = [
    "MAX_ATTEMPTS",
    "SETTLE",
    "Drain",
    "Expire",
    "Fail",
    "Promote",
    "Remove",
    "Replace",
    "Died",
    "Launch",
    "ShardStep",
    "Step",
    "Stop",
    "all_ready",
    "placed_on",
    "plan",
    "problem",
    "shard_plan",
]

MAX_ATTEMPTS = 3
"""Re-placements tried for a failed instance before it says why it fits nowhere."""

SETTLE = 2.5
"""Seconds a drain lasts at least: every gateway's load report has counted what it routed to the replica before
it saw the drain. An idle gateway publishes and reads the shared load once a second (``loads.IDLE_PERIOD``), so a
stream it began just before the drain reaches another gateway's view up to about two seconds later."""


class Remove(msgspec.Struct, frozen=True, tag="remove"):
    """Delete a draining instance; ``why`` goes to the ``instance.drained`` event."""

    instance_id: InstanceId
    why: str


class Drain(msgspec.Struct, frozen=True, tag="drain"):
    """Drain a ready instance until ``until`` without lowering its deployment (its node is stopping)."""

    instance_id: InstanceId
    reason: str
    until: float


class Fail(msgspec.Struct, frozen=True, tag="fail"):
    """Set ``Failed(reason)`` if the state is still ``expected`` (``"starting"`` or ``"ready"``)."""

    instance_id: InstanceId
    reason: str
    expected: str


class Expire(msgspec.Struct, frozen=True, tag="expire"):
    """Delete an idle ready instance whose keep-alive has passed, lowering its deployment."""

    instance_id: InstanceId


class Promote(msgspec.Struct, frozen=True, tag="promote"):
    """Every runner reported ready for the instance's epoch: ``Starting`` -> ``Ready``."""

    instance_id: InstanceId


class Replace(msgspec.Struct, frozen=True, tag="replace"):
    """Plan a failed instance again on the nodes that remain; ``fresh``: with its tries reset (a node joined)."""

    instance_id: InstanceId
    why: str
    fresh: bool = False


Step = Remove | Drain | Fail | Expire | Promote | Replace


def plan(
    instances: Iterable[Instance],
    nodes: Set[NodeId],
    stopping: Mapping[NodeId, float],
    load: Callable[[str], int],
    now: float,
    joined: bool = False,
) -> list[Step]:
    """The steps of one reconcile pass (see the module docstring). ``nodes``: the live nodes; ``stopping``: the
    draining ones and when each stops; ``load``: generations running plus queued on an instance, on every
    gateway; ``joined``: a node joined since the last pass."""
    steps: list[Step] = []
    for instance in instances:
        step = _step(instance, nodes, stopping, load, now, joined)
        if step is not None:
            steps.append(step)
    return steps


def _step(
    instance: Instance,
    nodes: Set[NodeId],
    stopping: Mapping[NodeId, float],
    load: Callable[[str], int],
    now: float,
    joined: bool,
) -> Step | None:
    state, iid = instance.state, instance.id
    if isinstance(state, Draining):
        busy = load(iid)
        lost = problem(instance, nodes)
        if lost:
            return Remove(iid, f"drained ({state.reason}): {lost}")
        if now >= state.until:
            left = f"its grace ended with {busy} running or queued; they resume elsewhere"
            return Remove(iid, f"drained ({state.reason}): {left}")
        if not busy and now - state.since >= SETTLE:
            return Remove(iid, f"drained ({state.reason}): its streams finished in {now - state.since:.1f}s")
        return None
    if isinstance(state, Failed):
        if instance.attempts < MAX_ATTEMPTS:
            return Replace(iid, state.reason)
        return Replace(iid, state.reason, fresh=True) if joined else None
    leaving = [s.node_id for s in instance.placement.shards if s.node_id in stopping]
    if leaving:
        reason = f"node {leaving[0]} is draining"
        if isinstance(state, Ready):
            return Drain(iid, reason, stopping[leaving[0]])
        return Fail(iid, reason, "starting")
    if isinstance(state, Ready) and instance.expires_at is not None and instance.expires_at <= now:
        return None if load(iid) else Expire(iid)  # still serving (on some gateway): it expires once idle
    lost = problem(instance, nodes)
    if lost:
        return Fail(iid, lost, "ready" if isinstance(state, Ready) else "starting")
    if isinstance(state, Starting) and all_ready(instance):
        return Promote(iid)
    return None


def problem(instance: Instance, nodes: Set[NodeId]) -> str | None:
    """Why the instance cannot serve: a node of it left, or a runner of its epoch failed; None if neither."""
    for shard in instance.placement.shards:
        if shard.node_id not in nodes:
            return f"node {shard.node_id} left the cluster"
        status = instance.runners.get(shard.node_id)
        if status is not None and status.epoch == instance.epoch and status.state == "failed":
            return f"runner on {shard.node_id} failed: {status.error or 'unknown error'}"
    return None


def all_ready(instance: Instance) -> bool:
    """Every shard's runner reported ready for the instance's epoch."""
    return all(
        (s := instance.runners.get(shard.node_id)) is not None and s.state == "ready" and s.epoch == instance.epoch
        for shard in instance.placement.shards
    )


# ------------------------------------------------------------------------------------------- a node's runners


class Stop(msgspec.Struct, frozen=True, tag="stop"):
    """Stop the runner of ``instance_id`` (of ``epoch``) here: its instance no longer wants it."""

    instance_id: InstanceId
    epoch: int


class Died(msgspec.Struct, frozen=True, tag="died"):
    """The runner of ``instance`` here exited on its own: clean up after it and report it failed."""

    instance: Instance
    epoch: int


class Launch(msgspec.Struct, frozen=True, tag="launch"):
    """Start this node's shard of ``instance``."""

    instance: Instance


ShardStep = Stop | Died | Launch


def placed_on(instance: Instance, node: NodeId) -> bool:
    """Whether ``instance`` wants a runner on ``node``: a shard of it is there and it has not failed."""
    return not isinstance(instance.state, Failed) and any(s.node_id == node for s in instance.placement.shards)


def shard_plan(
    node: NodeId,
    stored: Iterable[Instance],
    running: Mapping[str, tuple[int, bool]],
    starting: Set[str],
    failed: Set[tuple[str, int]],
) -> list[ShardStep]:
    """What ``node``'s agent does in one pass. ``running``: instance id -> (epoch, alive) of each runner it
    launched; ``starting``: instances whose runner is being launched; ``failed``: (instance id, epoch) already
    reported failed, never launched again (the gateway re-places them with a new epoch)."""
    wanted: dict[str, Instance] = {i.id: i for i in stored if placed_on(i, node)}
    steps: list[ShardStep] = []
    for instance_id, (epoch, alive) in running.items():
        found = wanted.get(instance_id)
        if found is None or found.epoch != epoch:
            steps.append(Stop(InstanceId(instance_id), epoch))
        elif not alive:
            steps.append(Died(found, epoch))
    for instance_id, instance in wanted.items():
        if instance_id not in running and instance_id not in starting and (instance_id, instance.epoch) not in failed:
            steps.append(Launch(instance))
    return steps
