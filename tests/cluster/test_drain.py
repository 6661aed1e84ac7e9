"""Drain without processes: a deleted, scaled-down or node-stopped replica takes no new request at once, keeps
serving what runs on it, and goes when that is done or its grace ends (``InstanceManager.drain``, on the
in-memory store with scripted load)."""

from __future__ import annotations

import time

import msgspec
import pytest

from meshgate.gateway.cluster import lifecycle
from meshgate.gateway.cluster.autoscale import Autoscaler, Policy, ScaleDown
from meshgate.gateway.cluster.loads import ReplicaLoad
from meshgate.gateway.cluster.records import Draining, Failed, Starting
from meshgate.gateway.cluster.routing import Routing
from meshgate.protocols.model import BackendUnavailable
from tests.cluster.test_replicas import _ready, cluster, node

__all__ = ["cluster"]  # the fixture, shared with test_replicas


@pytest.fixture(autouse=True)
def no_settle(monkeypatch):
    monkeypatch.setattr(lifecycle, "SETTLE", 0.0)


async def _events(manager) -> list[str]:
    return [f"{e.kind}: {e.message}" for e in await manager.store.events()]


async def test_an_idle_replica_settles_then_goes(cluster):
    """Idle as this gateway sees it is not idle everywhere: another gateway may have begun a stream on it a moment
    ago, not yet in the shared load (the simulator found such streams cut). So a deleted replica drains for
    ``lifecycle.SETTLE`` (0 here) and goes at the next pass; ``grace=0`` deletes it at once."""
    manager, _ = cluster
    a, b, c = await manager.deploy("scripted", replicas=3)
    await _ready(manager, a, b, c)
    draining = await manager.delete(a.id)
    assert draining is not None and isinstance(draining.state, Draining)
    assert (await manager.store.deployments())[0].replicas == 2
    await manager.reconcile()
    assert await manager.delete(b.id, grace=0) is None
    assert [i.id for i in await manager.store.instances()] == [c.id]
    assert (await manager.store.deployments())[0].replicas == 1


async def test_a_busy_replica_takes_nothing_new_and_goes_once_its_streams_finish(cluster):
    manager, busy = cluster
    card = manager.resolve("scripted")
    a, b = await manager.deploy("scripted", replicas=2)
    await _ready(manager, a, b)
    busy[a.id] = 2
    draining = await manager.delete(a.id, grace=30)
    assert draining is not None and isinstance(draining.state, Draining)
    assert draining.state.until - draining.state.since == pytest.approx(30, abs=1)
    assert (await manager.store.deployments())[0].replicas == 1, "the deployment asks for one fewer at once"
    busy[b.id] = 9  # even far more loaded, the other replica takes every new request
    assert {(await manager.acquire(card, routing=Routing())).id for _ in range(5)} == {b.id}
    await manager.reconcile()
    assert isinstance((await manager.store.get_instance(a.id)).state, Draining), "kept while it serves"
    assert len(await manager.store.instances()) == 2, "and no replacement: the deployment was lowered"
    busy[a.id] = 0
    await manager.reconcile()
    assert await manager.store.get_instance(a.id) is None
    assert any("drained (deleted): its streams finished" in e for e in await _events(manager))


async def test_the_grace_period_ends_a_drain_whatever_still_runs(cluster):
    manager, busy = cluster
    a, b = await manager.deploy("scripted", replicas=2)
    await _ready(manager, a, b)
    busy[a.id] = 1
    assert await manager.delete(a.id) is not None
    again = await manager.delete(a.id, grace=0.05)  # deleted again, with a shorter grace: it ends sooner
    assert again is not None and again.state.until - time.time() < 1
    time.sleep(0.1)
    await manager.reconcile()
    assert await manager.store.get_instance(a.id) is None
    assert any("grace ended with 1 running or queued; they resume elsewhere" in e for e in await _events(manager))


async def test_waiting_for_a_draining_replica_is_an_error_the_dispatcher_retries(cluster):
    manager, busy = cluster
    [a] = await manager.deploy("scripted", replicas=1)
    await _ready(manager, a)
    busy[a.id] = 1
    await manager.delete(a.id, grace=30)
    with pytest.raises(BackendUnavailable, match="draining"):
        await manager.wait_ready(a.id, timeout=1)


async def test_a_draining_node_hands_its_replicas_to_the_others(cluster):
    manager, busy = cluster
    [ready] = await manager.deploy("scripted", replicas=1, nodes=["n1"])
    await _ready(manager, ready)
    [starting] = await manager.deploy("scripted", replicas=1, nodes=["n1"])
    busy[ready.id] = 3
    until = time.time() + 30
    await manager.store.put_node(msgspec.structs.replace(node("n1"), draining_until=until), ttl=600)
    await manager.refresh()
    await manager.reconcile()
    now = {i.id: i for i in await manager.store.instances()}
    # the node's drain ends 30 s after its last heartbeat (its clock may be off from this gateway's)
    assert isinstance(now[ready.id].state, Draining) and abs(now[ready.id].state.until - until) < 1
    assert "node n1 is draining" in now[ready.id].state.reason
    assert isinstance(now[starting.id].state, Failed | Starting), "the one starting there is re-placed"
    assert (await manager.store.deployments())[0].replicas == 2, "the node's replicas are still wanted"
    for _ in range(3):  # re-place the failed one, place the draining one's replacement
        await manager.refresh()
        await manager.reconcile()
    now = {i.id: i for i in await manager.store.instances()}
    live = [i for i in now.values() if not isinstance(i.state, Draining)]
    assert len(live) == 2 and all(s.node_id != "n1" for i in live for s in i.placement.shards)
    assert all(isinstance(i.state, Starting) for i in live)
    assert not any(c.shards[0].node_id == "n1" for c in await manager.preview("scripted")), "n1 takes nothing"
    busy[ready.id] = 0
    await manager.reconcile()
    assert ready.id not in {i.id for i in await manager.store.instances()}


async def test_a_replica_on_a_draining_node_drains_even_when_it_looks_idle(cluster, monkeypatch):
    """The shared load may not show yet a stream another gateway began on it a moment ago: a replica whose node
    stops drains for ``SETTLE`` seconds at least instead of being deleted at once (that stream would be cut)."""
    monkeypatch.setattr(lifecycle, "SETTLE", 0.2)
    manager, _ = cluster
    [a] = await manager.deploy("scripted", replicas=1, nodes=["n1"])
    await _ready(manager, a)
    await manager.store.put_node(msgspec.structs.replace(node("n1"), draining_until=time.time() + 30), ttl=600)
    await manager.refresh()
    await manager.reconcile()
    assert isinstance((await manager.store.get_instance(a.id)).state, Draining)
    time.sleep(0.25)
    await manager.refresh()
    await manager.reconcile()
    assert await manager.store.get_instance(a.id) is None
    assert any("drained (node n1 is draining): its streams finished" in e for e in await _events(manager))


async def test_a_drain_that_loses_the_race_to_another_gateway_leaves_the_replica_draining(cluster, monkeypatch):
    """Two gateways carry out one node's Drain: the second read the replica Ready, and its Ready -> Draining
    write fails because the first's won. It must not delete the replica (that cut a stream in the rolling-restart
    test on a fresh clone)."""
    manager, busy = cluster
    a, b = await manager.deploy("scripted", replicas=2)
    await _ready(manager, a, b)
    busy[a.id] = 1
    stale = await manager.store.get_instance(a.id)  # what the second gateway read: Ready
    first = await manager.drain(a.id, reason="node a is stopping", lower=False, settle=True)
    assert first is not None and isinstance(first.state, Draining)
    real = manager.store.get_instance
    reads: list[str] = []

    async def stale_first(instance_id):
        reads.append(instance_id)
        return stale if len(reads) == 1 else await real(instance_id)

    monkeypatch.setattr(manager.store, "get_instance", stale_first)
    second = await manager.drain(a.id, reason="node a is stopping", lower=False, settle=True)
    assert second is not None and isinstance(second.state, Draining)
    assert await real(a.id) is not None, "the replica was deleted under its stream"
    assert not any("deleted instance" in e for e in await _events(manager))


async def test_lowering_max_replicas_drains_the_least_loaded_busy_replica(cluster):
    manager, busy = cluster
    a, b = await manager.deploy("scripted", replicas=2, min_replicas=1, max_replicas=2)
    await _ready(manager, a, b)
    busy.update({a.id: 4, b.id: 1})
    views = {a.id: ReplicaLoad(running=4), b.id: ReplicaLoad(running=1)}
    scaler = Autoscaler(manager, Policy(), lambda i: views.get(i, ReplicaLoad()))
    await manager.set_bounds("scripted", None, 1)
    await manager.refresh()
    [down] = await scaler.step()
    assert isinstance(down, ScaleDown) and down.instance_id == b.id and down.busy
    assert isinstance((await manager.store.get_instance(b.id)).state, Draining), "its stream goes on"
    await manager.refresh()
    assert await scaler.step() == [], "a draining replica is not removed twice"
    busy[b.id] = 0
    await manager.reconcile()
    assert [i.id for i in await manager.store.instances()] == [a.id]
    assert (await manager.store.deployments())[0].replicas == 1
