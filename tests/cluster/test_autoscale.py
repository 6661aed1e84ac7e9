"""Autoscaling without processes: ``decide`` and ``observe`` as tables, then the executor on the in-memory store
(two gateways' executors on one store: one acts) and the deployment's bounds."""

from __future__ import annotations

import asyncio

import pytest

from meshgate.gateway.cluster.autoscale import (
    Autoscaler,
    History,
    Hold,
    Policy,
    ScaleDown,
    ScaleUp,
    decide,
    observe,
)
from meshgate.gateway.cluster.instances import InstanceManager
from meshgate.gateway.cluster.loads import ReplicaLoad
from meshgate.gateway.cluster.records import Deployment, Draining, Ready, Starting
from meshgate.gateway.cluster.store import MemoryStore
from meshgate.protocols.model import InvalidRequest, NotFound
from tests.cluster.test_replicas import _manager, _ready, node
from tests.cluster.test_store import instance as stored_instance

NOW = 1000.0
POLICY = Policy(up_wait=10.0, down_idle=300.0, cooldown=30.0)
A, B = stored_instance("a", model="m", state=Ready()), stored_instance("b", model="m", state=Ready())
WAITING = {"a": ReplicaLoad(running=4, queued=3), "b": ReplicaLoad(running=4)}


def _deployment(**kw: object) -> Deployment:
    return Deployment(**{"model": "m", "replicas": 2, "min_replicas": 1, "max_replicas": 3, **kw})  # type: ignore[arg-type]


# (case, deployment fields, instances, loads, history, room, expected: (kind, instance id, words in the reason))
DECIDE = [
    ("sustained waiting", {}, [A, B], WAITING, History({"m": 985.0}), None, (ScaleUp, None, "for 15.0s")),
    ("a short spike", {}, [A, B], WAITING, History({"m": 995.0}), None, None),
    ("at max", {"max_replicas": 2}, [A, B], WAITING, History({"m": 980.0}), None, (Hold, None, "max_replicas (2)")),
    ("cooldown", {"scaled_at": 990.0}, [A, B], WAITING, History({"m": 980.0}), None, (Hold, None, "cooldown 30s")),
    ("no room", {}, [A, B], WAITING, History({"m": 980.0}), {"m": False}, (Hold, None, "no node has room")),
    (
        "one drains, its node stopping (a rolling restart)",
        {},
        [A, B, stored_instance("c", model="m", state=Draining(since=990.0, until=1020.0, replaced=True))],
        WAITING,
        History({"m": 980.0}),
        None,
        (Hold, None, "node is stopping"),
    ),
    (
        "one placed, not yet stored",
        {"replicas": 3},
        [A, B],
        WAITING,
        History({"m": 980.0}),
        None,
        (Hold, None, "coming up"),
    ),
    (
        "one starting",
        {},
        [A, stored_instance("b", model="m", state=Starting())],
        WAITING,
        History({"m": 980.0}),
        None,
        (Hold, None, "coming up"),
    ),
    (
        "idle past the threshold",
        {},
        [A, B],
        {},
        History({}, {"a": 900.0, "b": 600.0}),
        None,
        (ScaleDown, "b", "idle for 400s"),
    ),
    ("idle, not long enough", {}, [A, B], {}, History({}, {"a": 900.0, "b": 800.0}), None, None),
    (
        "the idle one, never the busy one",
        {},
        [A, B],
        {"b": ReplicaLoad(running=1)},
        History({}, {"a": 600.0, "b": 500.0}),  # b's history is stale: its load says busy
        None,
        (ScaleDown, "a", "replica a idle"),
    ),
    (
        "busy: never down",
        {},
        [A, B],
        {"a": ReplicaLoad(queued=1), "b": ReplicaLoad(running=2)},
        History({}, {"a": 0.0, "b": 0.0}),
        None,
        None,
    ),
    ("at min", {"min_replicas": 2}, [A, B], {}, History({}, {"a": 600.0}), None, (Hold, None, "min_replicas (2)")),
    ("idle, cooling down", {"scaled_at": 980.0}, [A, B], {}, History({}, {"a": 600.0}), None, (Hold, None, "cooldown")),
    (
        "requests wait: nothing goes",
        {},
        [A, B],
        {"a": ReplicaLoad(running=1, queued=1)},
        History({"m": 999.0}, {"b": 600.0}),
        None,
        None,
    ),
    (
        "above max: the idle one, at once",
        {"max_replicas": 1, "scaled_at": 999.0},
        [A, B],
        {"a": ReplicaLoad(running=1)},
        History({}, {"b": 999.0}),
        None,
        (ScaleDown, "b", "above max_replicas (1)"),
    ),
    (
        "above max, all busy: the least loaded drains",
        {"max_replicas": 1},
        [A, B],
        {"a": ReplicaLoad(running=3), "b": ReplicaLoad(queued=1)},
        History(),
        None,
        (ScaleDown, "b", "above max_replicas (1)"),
    ),
    (
        "a draining replica counts for nothing",
        {"max_replicas": 1, "replicas": 1},
        [A, stored_instance("b", model="m", state=Draining(since=990.0, until=1020.0, reason="deleted"))],
        {"b": ReplicaLoad(running=2)},
        History(),
        None,
        None,
    ),
    (
        "waiting while one drains: up, for the one that leaves",
        {"replicas": 1},
        [A, stored_instance("b", model="m", state=Draining(since=990.0, until=1020.0, reason="node b"))],
        {"a": ReplicaLoad(running=4, queued=2), "b": ReplicaLoad(running=4)},
        History({"m": 980.0}),
        None,
        (ScaleUp, None, "on 1 replica(s)"),
    ),
]


@pytest.mark.parametrize(
    ("fields", "instances", "loads", "history", "room", "expected"),
    [case[1:] for case in DECIDE],
    ids=[case[0] for case in DECIDE],
)
def test_decide_is_a_table(fields, instances, loads, history, room, expected) -> None:
    actions = decide([_deployment(**fields)], instances, loads, NOW, POLICY, history, room)
    if expected is None:
        assert actions == []
        return
    kind, instance_id, words = expected
    [action] = actions
    assert type(action) is kind and action.model == "m" and words in action.reason
    if instance_id is not None:
        assert isinstance(action, ScaleDown) and action.instance_id == instance_id


def test_decisions_carry_the_figures_they_used() -> None:
    [up] = decide([_deployment()], [A, B], WAITING, NOW, POLICY, History({"m": 985.0}))
    assert up.figures == {
        "replicas": 2,
        "min_replicas": 1,
        "max_replicas": 3,
        "running": 8,
        "queued": 3,
        "waited_s": 15.0,
        "up_wait_s": 10.0,
    }
    [down] = decide([_deployment()], [A, B], {}, NOW, POLICY, History({}, {"a": 650.0}))
    assert (down.figures["idle_s"], down.figures["down_idle_s"], down.figures["replicas"]) == (350.0, 300.0, 2)


def test_observe_keeps_unbroken_runs_and_restarts_broken_ones() -> None:
    starting = stored_instance("c", model="m", state=Starting())
    first = observe(History(), [A, B, starting], {"a": ReplicaLoad(queued=1)}, 10.0)
    assert first == History({"m": 10.0}, {"b": 10.0})  # a starting replica is never idle
    second = observe(first, [A, B, starting], {"b": ReplicaLoad(queued=2)}, 11.0)
    assert second == History({"m": 10.0}, {"a": 11.0})  # still waiting (on b now); b's idle run broke
    third = observe(second, [A, B], {}, 12.0)
    assert third == History({}, {"a": 11.0, "b": 12.0})
    assert observe(third, [A, B], {"a": ReplicaLoad(queued=1)}, 13.0).waiting_since == {"m": 13.0}


# ------------------------------------------------------------------------------------------- the executor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def _gateways(store: MemoryStore, n: int, views: dict[str, ReplicaLoad], busy: dict[str, int], clock: Clock):
    managers: list[InstanceManager] = []
    scalers: list[Autoscaler] = []
    for _ in range(n):
        manager = await _manager(store, busy)
        managers.append(manager)
        scalers.append(Autoscaler(manager, POLICY, lambda i: views.get(i, ReplicaLoad()), clock=clock))
    return managers, scalers


async def _step(managers: list[InstanceManager], scalers: list[Autoscaler]) -> list[list]:
    for manager in managers:
        await manager.refresh()
    return list(await asyncio.gather(*(s.step() for s in scalers)))


@pytest.fixture
async def memory_store():
    store = MemoryStore()
    for name in ("n1", "n2", "n3"):
        await store.put_node(node(name), ttl=600)
    yield store
    await store.close()


async def test_two_gateways_one_scale_up_and_reconcile_places_it(memory_store) -> None:
    views: dict[str, ReplicaLoad] = {}
    clock = Clock()
    managers, scalers = await _gateways(memory_store, 2, views, {}, clock)
    [one] = await managers[0].deploy("scripted", replicas=1, max_replicas=3)
    await _ready(managers[0], one)
    views[one.id] = ReplicaLoad(running=2, queued=5)
    assert await _step(managers, scalers) == [[], []]  # waiting, not for long yet
    clock.now += 11
    done = await _step(managers, scalers)
    assert sorted(len(d) for d in done) == [0, 1]  # one gateway acts, the other holds off
    [deployment] = await memory_store.deployments()
    assert (deployment.replicas, deployment.scaled_at) == (2, clock.now)
    [event] = [e for e in await memory_store.events() if e.kind == "deployment.scaled_up"]
    assert "1 -> 2 replicas" in event.message and event.data is not None
    assert (event.data["queued"], event.data["waited_s"], event.data["max_replicas"]) == ("5", "11", "3")
    acted = managers[0] if done[0] else managers[1]
    await acted.reconcile()  # places the replica the deployment now asks for
    assert len(await memory_store.instances()) == 2
    clock.now += 11  # still waiting, but a replica is coming up: nothing more
    assert await _step(managers, scalers) == [[], []]


async def test_scale_down_removes_the_idle_replica_never_one_with_requests(memory_store) -> None:
    views: dict[str, ReplicaLoad] = {}
    busy: dict[str, int] = {}
    clock = Clock()
    [manager], [scaler] = await _gateways(memory_store, 1, views, busy, clock)
    a, b, c = await manager.deploy("scripted", replicas=3, min_replicas=1)
    await _ready(manager, a, b, c)
    views[b.id] = ReplicaLoad(running=1)
    await _step([manager], [scaler])
    clock.now += 301
    busy[a.id] = 1  # a request was just routed to a: the view has not seen it yet
    views[c.id] = ReplicaLoad(running=1)
    assert await _step([manager], [scaler]) == [[]]
    assert len(await memory_store.instances()) == 3
    busy.clear()
    [[down]] = await _step([manager], [scaler])
    assert isinstance(down, ScaleDown) and down.instance_id == a.id
    # it drains (settles) rather than going at once: another gateway may have just begun a stream on it
    assert {i.id for i in await memory_store.instances() if not isinstance(i.state, Draining)} == {b.id, c.id}
    [deployment] = await memory_store.deployments()
    assert (deployment.replicas, deployment.min_replicas, deployment.scaled_at) == (2, 1, clock.now)
    [event] = [e for e in await memory_store.events() if e.kind == "deployment.scaled_down"]
    assert event.instance_id == a.id and "idle for 301s" in (event.data or {})["reason"]
    views.clear()
    assert await _step([manager], [scaler]) == [[]]  # b and c idle from now
    clock.now += 301
    assert len((await _step([manager], [scaler]))[0]) == 1  # one at a time
    clock.now += 400
    assert await _step([manager], [scaler]) == [[]]  # at min_replicas
    assert len([i for i in await memory_store.instances() if not isinstance(i.state, Draining)]) == 1


async def test_bounds_of_new_deployments_and_changing_them(memory_store) -> None:
    manager = await _manager(memory_store, {}, max_replicas=4)
    [one] = await manager.deploy("scripted")
    [d] = await memory_store.deployments()
    assert (d.replicas, d.min_replicas, d.max_replicas) == (1, 1, 4)  # MESHGATE_MAX_REPLICAS
    await manager.deploy("scripted", replicas=2)
    [d] = await memory_store.deployments()
    assert (d.replicas, d.min_replicas, d.max_replicas) == (3, 1, 4)
    assert (await manager.set_bounds("scripted", None, 2)).max_replicas == 2  # lowered below the replicas it has
    [d] = await memory_store.deployments()
    assert (d.replicas, d.min_replicas, d.max_replicas) == (3, 1, 2)  # the extra one goes once idle
    await manager.delete(one.id)
    [d] = await memory_store.deployments()
    assert (d.replicas, d.max_replicas) == (2, 2)  # a deletion never widens the lowered max back
    with pytest.raises(InvalidRequest, match=r"min_replicas \(3\) is above max_replicas \(2\)"):
        await manager.set_bounds("scripted", 3, None)
    raised = await manager.set_bounds("scripted", 3, 3)
    assert (raised.replicas, raised.min_replicas) == (3, 3)
    await manager.reconcile()  # places the replica min_replicas now asks for
    assert len(await memory_store.instances()) == 3
    assert [e.kind for e in await memory_store.events()].count("deployment.bounds") == 2
    with pytest.raises(NotFound):
        await manager.set_bounds("other", 1, 2)
    for instance in await memory_store.instances():
        await manager.delete(instance.id)
    assert await memory_store.deployments() == []
    fixed = await _manager(memory_store, {})  # MESHGATE_MIN_REPLICAS / MAX_REPLICAS: 1 and 1
    await fixed.deploy("scripted", replicas=2)  # N placed at once, no bounds: stays N
    [d] = await memory_store.deployments()
    assert (d.replicas, d.min_replicas, d.max_replicas) == (2, 2, 2)


async def test_a_scale_up_beside_a_draining_replica_counts_only_those_that_serve(memory_store) -> None:
    """Issue 37, 10: ``decide`` leaves draining replicas out and the executor counted them, so a scale-up during
    a deletion's drain asked for one replica too many (1 serving + 1 draining -> 3)."""
    views: dict[str, ReplicaLoad] = {}
    busy: dict[str, int] = {}
    clock = Clock()
    [manager], [scaler] = await _gateways(memory_store, 1, views, busy, clock)
    a, b = await manager.deploy("scripted", replicas=2, min_replicas=1, max_replicas=3)
    await _ready(manager, a, b)
    busy[b.id] = 1  # a stream still runs on b: the deletion drains it
    assert await manager.delete(b.id) is not None
    views[a.id] = ReplicaLoad(running=2, queued=5)
    await _step([manager], [scaler])  # waiting starts
    clock.now += 11
    [done] = await _step([manager], [scaler])
    assert [type(x) for x in done] == [ScaleUp]
    [deployment] = await memory_store.deployments()
    assert deployment.replicas == 2, deployment
