"""Replicas without processes: deployments, anti-affinity, context sizes without eviction, routing by shared load,
the store's deployment/load/lease records (on MemoryStore and RedisStore) and slot sizing from memory."""

from __future__ import annotations

import asyncio
import time

import pytest

from meshgate.backends.placement import ModelSpec, Node, NodeId
from meshgate.gateway.cluster import lifecycle
from meshgate.gateway.cluster.instances import InstanceManager, missing_replicas
from meshgate.gateway.cluster.loads import LoadBoard
from meshgate.gateway.cluster.planner import MAX_SEQUENCES, auto_sequences
from meshgate.gateway.cluster.records import Deployment, Draining, LoadReport, RunnerStatus
from meshgate.gateway.cluster.routing import Routing
from meshgate.gateway.cluster.store import LOAD_STALE, MemoryStore, StateStore
from meshgate.gateway.http.runtime import _rank
from meshgate.gateway.serving.admission import Admission
from meshgate.gateway.serving.catalog import Catalog
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from meshgate.protocols.model import NoCapacity
from tests import scripted_plugin
from tests.cluster.test_store import instance as stored_instance


def node(name: str, memory: int = 8 << 30) -> Node:
    return Node(id=NodeId(name), name=name, memory_total=memory, memory_available=memory, heartbeat_at=time.time())


async def _manager(store: StateStore, loads: dict[str, int] | None = None, **kw) -> InstanceManager:
    pm = build_plugin_manager(Settings(disabled_plugins=("llama_cpp",)), extra=[scripted_plugin])
    catalog = Catalog([scripted_plugin.ScriptedSource()])
    catalog.refresh()
    busy = loads if loads is not None else {}
    return InstanceManager(
        store,
        [scripted_plugin.ScriptedBackend()],
        resolve=catalog.resolve,
        choose=pm.hook.meshgate_choose_backend,
        rank=_rank(pm),
        load=lambda instance_id: busy.get(instance_id, 0),
        **kw,
    )


@pytest.fixture
async def cluster():
    store = MemoryStore()
    for name in ("n1", "n2", "n3"):
        await store.put_node(node(name), ttl=600)
    busy: dict[str, int] = {}
    manager = await _manager(store, busy)
    yield manager, busy
    await store.close()


async def _ready(manager: InstanceManager, *instances) -> None:
    for i in instances:
        for shard in i.placement.shards:
            await manager.store.update_runner(i.id, RunnerStatus(node_id=shard.node_id, state="ready", url="x"))
    await manager.refresh()
    await manager.reconcile()


async def test_replicas_spread_over_distinct_nodes_and_say_why_when_they_share(cluster):
    manager, _ = cluster
    placed = await manager.deploy("scripted", replicas=3)
    assert len({i.placement.shards[0].node_id for i in placed}) == 3
    assert all(i.note is None for i in placed)
    [deployment] = await manager.store.deployments()
    assert (deployment.model, deployment.replicas) == ("scripted", 3)
    fourth = (await manager.deploy("scripted", replicas=1))[0]
    assert fourth.note is not None and "no node without a replica" in fourth.note
    assert (await manager.store.deployments())[0].replicas == 4
    assert "shares" in (await manager.store.events())[-1].message


async def test_deleting_a_replica_lowers_the_deployment_and_reconcile_fills_a_lost_one(cluster):
    manager, _ = cluster
    a, b = await manager.deploy("scripted", replicas=2)
    await manager.delete(a.id)
    assert (await manager.store.deployments())[0].replicas == 1
    await manager.store.delete_instance(b.id)  # lost behind the manager's back (say, a store edited by hand)
    await manager.refresh()
    await manager.reconcile()
    assert [i.model for i in await manager.store.instances()] == ["scripted"]
    assert "deployment: 1 replicas" in (await manager.store.events())[-1].message
    await manager.delete((await manager.store.instances())[0].id)
    assert await manager.store.deployments() == []


def test_missing_replicas_is_a_table() -> None:
    deployments = [Deployment(model="a", replicas=3), Deployment(model="b", replicas=1), Deployment(model="c")]
    instances = [stored_instance("i1", model="m"), stored_instance("i2", model="m")]
    assert missing_replicas(deployments, instances) == {"a": 3, "b": 1, "c": 1}
    assert missing_replicas([Deployment(model="m", replicas=2)], instances) == {}
    assert missing_replicas([Deployment(model="m", replicas=3)], instances) == {"m": 1}


async def test_a_smaller_num_ctx_is_served_by_an_existing_replica(cluster):
    manager, _ = cluster
    card = manager.resolve("scripted")
    replicas = await manager.deploy("scripted", replicas=2, context=4096)
    await _ready(manager, *replicas)
    for _ in range(5):
        got = await manager.acquire(card, context=2048)
        assert got.id in {r.id for r in replicas}
    assert {i.id for i in await manager.store.instances()} == {r.id for r in replicas}, "nothing evicted"


async def test_a_bigger_num_ctx_places_a_replica_beside_the_others_never_instead(cluster):
    manager, _ = cluster
    card = manager.resolve("scripted")
    small = await manager.deploy("scripted", replicas=1, context=256)
    await _ready(manager, *small)
    big = await manager.acquire(card, context=8192)  # held to the model's own 1024
    assert big.placement.context == 1024 and big.id != small[0].id
    assert {i.id for i in await manager.store.instances()} == {small[0].id, big.id}
    await _ready(manager, big)
    assert (await manager.acquire(card, context=1000)).id == big.id  # found again, not placed again
    assert (await manager.acquire(card, context=128)).id in {small[0].id, big.id}
    [deployment] = await manager.store.deployments()
    # a fixed-size deployment grows with it: the small replica is no extra for the autoscaler to take when idle
    assert (deployment.replicas, deployment.min_replicas, deployment.max_replicas) == (2, 2, 2)
    await manager.delete(big.id)
    [deployment] = await manager.store.deployments()
    assert (deployment.replicas, deployment.min_replicas, deployment.max_replicas) == (1, 1, 1)


async def test_without_automatic_placement_the_largest_replica_serves(cluster):
    manager, _ = cluster
    small = await manager.deploy("scripted", replicas=1, context=256)
    await _ready(manager, *small)
    manager.replicas.auto_place = False
    assert (await manager.acquire(manager.resolve("scripted"), context=1024)).id == small[0].id


async def test_no_room_for_a_bigger_replica_serves_on_the_largest(cluster):
    manager, _ = cluster
    placed = await manager.deploy("scripted", replicas=1, context=256)
    await _ready(manager, *placed)
    for name in ("n1", "n2", "n3"):
        await manager.store.put_node(node(name, memory=1 << 20), ttl=600)  # no room for anything more
    got = await manager.acquire(manager.resolve("scripted"), context=1024)
    assert got.id == placed[0].id and len(await manager.store.instances()) == 1
    await manager.store.delete_instance(placed[0].id)
    await manager.refresh()
    with pytest.raises(NoCapacity):
        await manager.acquire(manager.resolve("scripted"), context=1024)


async def test_requests_go_to_the_less_loaded_replica_and_a_prefix_keeps_its_replica(cluster):
    manager, busy = cluster
    card = manager.resolve("scripted")
    a, b = await manager.deploy("scripted", replicas=2)
    await _ready(manager, a, b)
    busy[a.id] = 5
    assert {(await manager.acquire(card, routing=Routing())).id for _ in range(10)} == {b.id}
    busy.clear()
    key = Routing(key=b"conversation-1")
    home = {(await manager.acquire(card, routing=key)).id for _ in range(10)}
    assert len(home) == 1
    busy[home.pop()] = 10  # the prefix's replica carries more than its bounded share: the request spills
    assert (await manager.acquire(card, routing=key)).id != (a.id if busy.get(a.id) else b.id)
    assert {rule for (_, rule) in manager.routed} >= {"least_loaded", "affinity", "spill"}


async def test_expiry_waits_while_any_gateway_has_work_on_the_replica(cluster, monkeypatch):
    monkeypatch.setattr(lifecycle, "SETTLE", 0.0)  # an expired replica drains for it first (another gateway's stream)
    manager, busy = cluster
    one = await manager.acquire(manager.resolve("scripted"))  # placed by a request: keep_alive may unload it
    await _ready(manager, one)
    await manager.set_expiry("scripted", time.time() - 1)
    busy[one.id] = 1
    await manager.reconcile()
    assert await manager.store.get_instance(one.id) is not None
    busy.clear()
    await manager.reconcile()
    assert isinstance((await manager.store.get_instance(one.id)).state, Draining)
    await manager.reconcile()
    assert await manager.store.get_instance(one.id) is None and await manager.store.deployments() == []


# ------------------------------------------------------------------------------------------- the store's records


async def test_deployments_put_list_delete(store: StateStore) -> None:
    generation = await store.generation()
    await store.put_deployment(Deployment(model="b", replicas=2, max_replicas=4))
    await store.put_deployment(Deployment(model="a", replicas=1, context=2048))
    assert [d.model for d in await store.deployments()] == ["a", "b"]
    assert await store.generation() > generation
    assert (await store.deployments())[1].max_replicas == 4
    assert await store.delete_deployment("a") and not await store.delete_deployment("a")
    assert [d.model for d in await store.deployments()] == ["b"]


async def test_loads_from_two_gateways_and_stale_ones_dropped(store: StateStore, peer: StateStore) -> None:
    now = time.time()
    await store.put_loads("gw1", {"i1": LoadReport(running=2, queued=1, at=now)})
    await peer.put_loads("gw2", {"i1": LoadReport(running=1, at=now), "i2": LoadReport(queued=3, at=now)})
    await peer.put_loads("gw3", {"i2": LoadReport(running=9, at=now - LOAD_STALE - 1)})  # stopped publishing
    loads = await store.loads()
    assert sorted((r.running, r.queued) for r in loads["i1"]) == [(1, 0), (2, 1)]
    assert [(r.running, r.queued) for r in loads["i2"]] == [(0, 3)]
    await peer.put_loads("gw2", {}, gone=["i1", "i2"])
    assert "i2" not in await store.loads() and len((await store.loads())["i1"]) == 1


async def test_a_lease_has_one_holder_until_it_lapses(store: StateStore, peer: StateStore) -> None:
    assert await store.claim("deploy:m", "gw1", ttl=5.0)
    assert not await peer.claim("deploy:m", "gw2", ttl=5.0)
    assert await store.claim("deploy:m", "gw1", ttl=0.5)  # its holder keeps it, for as long as it asks now
    await asyncio.sleep(0.6)
    assert await peer.claim("deploy:m", "gw2", ttl=5.0)
    assert not await store.claim("deploy:m", "gw1", ttl=5.0)


async def test_two_load_boards_see_each_others_load_and_tokens_per_second() -> None:
    store = MemoryStore()
    one, two = Admission(parallel=2), Admission(parallel=2)
    board1, board2 = LoadBoard(store, one), LoadBoard(store, two)
    held = [one.enter("i1", "x"), one.enter("i1", "y"), one.enter("i1", "z")]  # two run, one waits
    await board1.sync()
    await board2.sync()
    assert board2.load("i1") == 3 and board1.load("i1") == 3  # the other's as published, its own live
    two.enter("i1", "w")
    assert board2.load("i1") == 4 and board2.view("i1").running == 3 and board2.view("i1").queued == 1
    board1.tally("i1").tokens += 50
    await board1.sync()
    await asyncio.sleep(0.2)
    board1.tally("i1").tokens += 50
    await board1.sync()
    await board2.sync()
    assert board2.view("i1").tokens_per_s > 50
    board2.routed("i1")  # routed, not yet in the queue (its model loading, its prompt being counted): load
    assert board2.load("i1") == 5
    board2.settled("i1")
    assert board2.load("i1") == 4
    for ticket in held:
        ticket.release()
    await board1.close()
    await board2.sync()
    assert board2.load("i1") == 1, "a closed gateway's load is withdrawn"
    await store.close()


# ------------------------------------------------------------------------------------------- slots from memory


def test_slots_are_sized_from_the_smallest_nodes_memory() -> None:
    spec = ModelSpec(
        name="m", n_layers=18, hidden_size=640, n_heads=4, n_kv_heads=1, head_dim=256, context_length=32768,
        layer_bytes=5 << 20,
    )  # fmt: skip
    per_sequence = spec.kv_bytes(4096)
    assert auto_sequences(spec, 4096, [node("a", 64 << 30)]) == MAX_SEQUENCES
    assert auto_sequences(spec, 4096, [node("a", per_sequence * 4 * 5)]) == 5  # a quarter holds 5
    assert auto_sequences(spec, 4096, [node("a", 64 << 30), node("b", per_sequence * 4 * 2)]) == 2
    assert auto_sequences(spec, 4096, [node("a", 1 << 20)]) == 1
    assert auto_sequences(spec, 4096, []) == 1


async def test_load_freshness_holds_across_skewed_clocks(store: StateStore, peer: StateStore) -> None:
    """Issue 37, 13: freshness compared another machine's wall clock with this one's. A gateway 60 s behind that
    publishes all along is fresh; one 60 s ahead that stopped publishing goes stale within ``LOAD_STALE``."""
    behind, ahead = time.time() - 60, time.time() + 60
    await peer.put_loads("slow-clock", {"i1": LoadReport(running=1, at=behind)})
    await peer.put_loads("fast-clock", {"i2": LoadReport(running=2, at=ahead)})
    await store.loads()  # first sight: dated by the stamps (a guess)
    for step in range(1, 6):  # 2.5 s: the slow clock keeps publishing, the fast one has stopped
        await asyncio.sleep(0.5)
        await peer.put_loads("slow-clock", {"i1": LoadReport(running=1, at=behind + step * 0.5)})
        loads = await store.loads()
        assert [r.running for r in loads.get("i1", [])] == [1], (step, loads)
    assert "i2" not in await store.loads()
