"""InstanceManager on a MemoryStore: the ranking policy hook, creation, failure and re-placement, no processes."""

from __future__ import annotations

import time

import pytest

from meshgate.backends.placement import Node, NodeId
from meshgate.gateway.cluster import lifecycle
from meshgate.gateway.cluster.instances import InstanceManager
from meshgate.gateway.cluster.lifecycle import MAX_ATTEMPTS
from meshgate.gateway.cluster.records import Draining, Failed, Ready, RunnerStatus, Starting
from meshgate.gateway.cluster.store import MemoryStore
from meshgate.gateway.http.runtime import _rank
from meshgate.gateway.serving.catalog import Catalog
from meshgate.plugins.hookspecs import hookimpl
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from meshgate.protocols.model import NoCapacity
from tests import scripted_plugin


def node(name: str, flops: float, memory: int = 8 << 30) -> Node:
    return Node(
        id=NodeId(name), name=name, memory_total=memory, memory_available=memory, flops=flops, heartbeat_at=time.time()
    )


@pytest.fixture
async def manager(request):
    store = MemoryStore()
    await store.put_node(node("fast", 5e10), ttl=60)
    await store.put_node(node("slow", 1e10), ttl=60)
    pm = build_plugin_manager(
        Settings(disabled_plugins=("llama_cpp",)), extra=[scripted_plugin, *getattr(request, "param", [])]
    )
    catalog = Catalog([scripted_plugin.ScriptedSource()])
    catalog.refresh()
    backend = scripted_plugin.ScriptedBackend()
    m = InstanceManager(
        store, [backend], resolve=catalog.resolve, choose=pm.hook.meshgate_choose_backend, rank=_rank(pm)
    )
    yield m
    await store.close()


async def test_default_policy_prefers_the_faster_node(manager):
    candidates = await manager.preview("scripted")
    assert [c.shards[0].node_id for c in candidates if c.fits][:2] == ["fast", "slow"]


class PreferSlow:
    @hookimpl
    def meshgate_rank_candidates(self, candidates, topology):
        return sorted(candidates, key=lambda c: c.shards[0].node_id != "slow")


@pytest.mark.parametrize("manager", [[PreferSlow()]], indirect=True)
async def test_a_plugin_ranking_policy_decides(manager):
    assert (await manager.preview("scripted"))[0].shards[0].node_id == "slow"
    instance = await manager.create("scripted")
    assert instance.placement.shards[0].node_id == "slow" and isinstance(instance.state, Starting)


async def test_ready_when_every_runner_reports_then_replaced_when_its_node_leaves(manager):
    instance = await manager.create("scripted", nodes=["fast"])
    await manager.store.update_runner(instance.id, RunnerStatus(node_id=NodeId("fast"), state="ready", url="x"))
    await manager.refresh()
    await manager.reconcile()
    assert isinstance((await manager.store.get_instance(instance.id)).state, Ready)
    await manager.store.remove_node(NodeId("fast"))
    await manager.refresh()
    await manager.reconcile()
    failed = await manager.store.get_instance(instance.id)
    assert isinstance(failed.state, Failed) and "fast left" in failed.state.reason
    await manager.refresh()
    await manager.reconcile()
    moved = await manager.store.get_instance(instance.id)
    assert isinstance(moved.state, Starting) and moved.placement.shards[0].node_id == "slow"
    assert moved.epoch == 1 and moved.runners == {}
    kinds = [e.kind for e in await manager.store.events()]
    assert kinds == ["instance.placed", "instance.ready", "instance.failed", "instance.replaced"]


async def test_nothing_fits_gives_the_reason(manager):
    with pytest.raises(NoCapacity) as exc:
        await manager.create("scripted-huge")
    assert "fits nowhere" in exc.value.message and "GiB" in exc.value.message


async def test_a_failing_runner_is_retried_a_bounded_number_of_times(manager):
    instance = await manager.create("scripted", nodes=["fast"])
    for _ in range(MAX_ATTEMPTS + 2):
        current = await manager.store.get_instance(instance.id)
        for shard in current.placement.shards:
            await manager.store.update_runner(
                instance.id, RunnerStatus(node_id=shard.node_id, state="failed", error="boom", epoch=current.epoch)
            )
        for _ in range(2):
            await manager.refresh()
            await manager.reconcile()
    final = await manager.store.get_instance(instance.id)
    assert isinstance(final.state, Failed) and final.attempts == MAX_ATTEMPTS


async def test_oll_15_a_ready_instance_past_its_expiry_is_deleted(manager, monkeypatch):
    """It settles first (``lifecycle.SETTLE``, 0 here): a stream another gateway began on it a moment ago, not yet
    in the shared load, finishes there."""
    monkeypatch.setattr(lifecycle, "SETTLE", 0.0)
    instance = await manager.create("scripted", nodes=["fast"])
    await manager.store.update_runner(instance.id, RunnerStatus(node_id=NodeId("fast"), state="ready", url="x"))
    await manager.refresh()
    await manager.reconcile()
    await manager.set_expiry("scripted", time.time() + 3600)
    await manager.reconcile()
    assert (await manager.store.get_instance(instance.id)).expires_at is not None  # not yet
    await manager.set_expiry("scripted", time.time() - 1)
    await manager.reconcile()
    draining = await manager.store.get_instance(instance.id)
    assert isinstance(draining.state, Draining) and draining.state.reason == "expired (keep_alive)"
    await manager.reconcile()
    assert await manager.store.get_instance(instance.id) is None and manager.cached("scripted") == []
    assert [e.kind for e in await manager.store.events()][-2:] == ["instance.draining", "instance.drained"]


async def test_an_instance_that_fitted_nowhere_is_placed_when_a_node_joins(manager):
    """Every node gone at once (one killed, the other restarting): the instance fails, fits nowhere and stops
    trying; a node that joins (back) gets it. It used to stay failed for good, its deployment a replica short."""
    instance = await manager.create("scripted", nodes=["fast"])
    await manager.reconcile()  # the nodes as they are now
    for name in ("fast", "slow"):
        await manager.store.remove_node(NodeId(name))
    for _ in range(3):
        await manager.refresh()
        await manager.reconcile()
    stuck = await manager.store.get_instance(instance.id)
    assert isinstance(stuck.state, Failed) and stuck.attempts == MAX_ATTEMPTS
    assert [e.kind for e in await manager.store.events()][-1] == "instance.unplaceable"
    await manager.reconcile()
    assert isinstance((await manager.store.get_instance(instance.id)).state, Failed)  # no node: it keeps waiting
    await manager.store.put_node(node("slow", 1e10), ttl=60)
    await manager.refresh()
    await manager.reconcile()
    moved = await manager.store.get_instance(instance.id)
    assert isinstance(moved.state, Starting) and moved.placement.shards[0].node_id == "slow", moved


# ---------------------------------------------------------------------------- issue 37: state changes checked


async def _report(manager, instance, **status) -> None:
    """Every shard's runner reports ``status`` for the instance's current epoch; one reconcile pass follows."""
    current = await manager.store.get_instance(instance.id)
    for shard in current.placement.shards:
        await manager.store.update_runner(
            instance.id, RunnerStatus(node_id=shard.node_id, epoch=current.epoch, **status)
        )
    await manager.refresh()
    await manager.reconcile()


async def _ready(manager, instance):
    """Report every shard's runner ready and let a pass promote it."""
    await _report(manager, instance, state="ready", url="x")
    return await manager.store.get_instance(instance.id)


async def _fail_runners(manager, instance):
    await _report(manager, instance, state="failed", error="boom")  # failed
    await manager.refresh()
    await manager.reconcile()  # re-placed


async def test_a_late_failure_report_of_a_replaced_epoch_leaves_the_new_placement(manager):
    instance = await manager.create("scripted", nodes=["fast"])
    first = await _ready(manager, instance)
    await _fail_runners(manager, instance)
    second = await _ready(manager, instance)
    assert isinstance(second.state, Ready) and second.epoch == first.epoch + 1
    await manager.report_unreachable(first, "connection refused")  # a stream on epoch 0 broke just now
    assert isinstance((await manager.store.get_instance(instance.id)).state, Ready)
    await manager.report_unreachable(second, "connection refused")  # the one it reached: fails
    assert isinstance((await manager.store.get_instance(instance.id)).state, Failed)


async def test_a_replica_that_came_up_gets_its_tries_back(manager):
    """Three failures over a replica's whole life, each followed by a good run, never leave it failed for good."""
    instance = await manager.create("scripted", nodes=["fast"])
    await _ready(manager, instance)
    for _ in range(MAX_ATTEMPTS + 1):
        await _fail_runners(manager, instance)
        current = await _ready(manager, instance)
        assert isinstance(current.state, Ready) and current.attempts == 0, current
    assert current.epoch == MAX_ATTEMPTS + 1


async def test_a_replica_failed_for_good_gets_a_substitute(manager):
    """A runner that fails on every try: its deployment places a substitute (the failed record goes, its reason
    in the event), instead of counting the failed record as a replica for ever."""
    [instance] = await manager.deploy("scripted", nodes=["fast"])
    await _ready(manager, instance)
    for _ in range(MAX_ATTEMPTS + 1):
        await _fail_runners(manager, instance)
    stuck = await manager.store.get_instance(instance.id)
    if stuck is not None:  # the pass that gave up may already have placed the substitute
        await manager.refresh()
        await manager.reconcile()
    assert await manager.store.get_instance(instance.id) is None
    [substitute] = manager.cached("scripted")
    assert substitute.id != instance.id and isinstance(substitute.state, Starting)
    event = [e for e in await manager.store.events() if e.kind == "instance.superseded"][-1]
    assert instance.id in event.message and "boom" in event.message


async def test_a_replaced_replica_keeps_its_context(manager):
    [instance] = await manager.deploy("scripted", nodes=["fast"], context=8192)
    assert instance.placement.context == 8192
    await _ready(manager, instance)
    await _fail_runners(manager, instance)
    moved = await manager.store.get_instance(instance.id)
    assert isinstance(moved.state, Starting) and moved.epoch == 1
    assert moved.placement.context == 8192


async def test_an_expiry_written_after_another_gateway_failed_the_replica_never_revives_it(manager):
    """The read-modify-write of ``set_expiry`` with another gateway's write in between (the store's reply to the
    read is the last moment it was ready): the failure stands, nothing is written over it."""
    instance = await manager.create("scripted", nodes=["fast"])
    await _ready(manager, instance)
    store, read = manager.store, manager.store.get_instance

    async def read_then_other_gateway_fails_it(instance_id):
        found = await read(instance_id)
        store.get_instance = read  # once
        await store.set_state(instance_id, Failed(reason="runner unreachable: x"), expected=Ready)
        return found

    store.get_instance = read_then_other_gateway_fails_it
    await manager.set_expiry("scripted", time.time() + 60)
    got = await store.get_instance(instance.id)
    assert isinstance(got.state, Failed) and got.expires_at is None, got


async def test_placements_never_overcommit_a_node_whose_report_lags(manager):
    """Issue 37, 11: a node capped at 3 GiB (``--memory``) reports 3 GiB available however much is placed, and
    an uncapped node's report lags until runners load; placements one after another each saw the memory from
    before. Now what is placed counts: a second 2 GiB model does not fit where the first took the room."""
    await manager.store.remove_node(NodeId("slow"))
    await manager.store.put_node(node("fast", 5e10, memory=3 << 30), ttl=60)
    await manager.refresh()
    first = await manager.create("scripted-big")
    assert first.placement.memory_per_node["fast"] > 2 << 30
    with pytest.raises(NoCapacity):
        await manager.create("scripted-big")
    assert len(manager.cached("scripted-big:latest")) == 1
