"""Defects the control plane's simulator (tests/sim) found, each pinned by a test of its own that failed before its
fix: a drain judged by another machine's clock, nodes failed for the store's outage, a runner's start lost with
a report the store did not take. In-process, on the memory store."""

from __future__ import annotations

import time

import msgspec

from meshgate.backends.base import InProcess
from meshgate.gateway.cluster import lifecycle
from meshgate.gateway.cluster.agent import NodeAgent
from meshgate.gateway.cluster.records import Draining, Failed, Ready
from meshgate.gateway.cluster.store import MemoryStore
from meshgate.protocols.model import StoreUnavailable
from tests import scripted_plugin
from tests.cluster.test_replicas import _manager, _ready, cluster, node

__all__ = ["cluster"]  # the fixture, shared with test_replicas


async def test_a_drain_another_gateway_began_ends_on_this_clock_not_on_the_writers(cluster, monkeypatch):
    """Seed 9: a gateway whose wall clock ran 5 s behind wrote ``Draining(since, until)``; another gateway read
    ``since`` as 5 s ago, thought the settle window over and the grace nearly so, and removed the replica with a
    stream on it. A drain now lasts its window from when this gateway first saw it."""
    monkeypatch.setattr(lifecycle, "SETTLE", 2.5)
    manager, busy = cluster
    a, b = await manager.deploy("scripted", replicas=2)
    await _ready(manager, a, b)
    behind = time.time() - 7.0  # the writer's clock: 7 s behind this one's; its grace is 8 s
    draining = Draining(since=behind, until=behind + 8.0, reason="deleted")
    assert await manager.store.set_state(a.id, draining, expected=Ready, epoch=a.epoch)
    await manager.refresh()
    await manager.reconcile()  # idle here: by the writer's stamps, settled 7 s ago
    assert isinstance((await manager.store.get_instance(a.id)).state, Draining), "settles on this clock first"
    busy[a.id] = 1
    monkeypatch.setattr(lifecycle, "SETTLE", 0.0)
    await manager.reconcile()  # by the stamps its grace ends in 1 s; here it has 8 s left
    assert isinstance((await manager.store.get_instance(a.id)).state, Draining)
    busy[a.id] = 0
    await manager.reconcile()
    assert await manager.store.get_instance(a.id) is None


async def test_a_node_the_store_let_lapse_while_it_was_away_is_not_failed_at_once():
    """Seeds 9, 51, 106, 1114: Redis away for longer than a node's time to live expired every node whose
    heartbeats could not reach it; the first reconcile pass after it came back failed all their replicas, and every
    stream on them resumed elsewhere. A node missing within a TTL of this gateway's failed call keeps its
    replicas; one still missing after that is gone."""
    store = MemoryStore()  # its ``unavailable_at`` set below, as a paused Redis's client sets it
    for name in ("n1", "n2"):
        await store.put_node(node(name), ttl=600)
    manager = await _manager(store, {})
    [a] = await manager.deploy("scripted", replicas=1, nodes=["n2"])
    await _ready(manager, a)
    await manager.reconcile()  # the nodes of a pass with the store there
    await store.remove_node(node("n2").id)  # lapsed during the outage
    store.unavailable_at = time.monotonic()
    await manager.reconcile()
    assert isinstance((await store.get_instance(a.id)).state, Ready), "a TTL to beat again"
    store.unavailable_at = time.monotonic() - manager.reconciler.node_ttl - 1
    await manager.reconcile()
    assert isinstance((await store.get_instance(a.id)).state, Failed)


class _FlakyReports(MemoryStore):
    """Refuses runner reports until ``fixed`` (the store away just as a runner came up)."""

    fixed = False

    async def update_runner(self, instance_id, status):  # type: ignore[no-untyped-def]
        if not self.fixed:
            raise StoreUnavailable()
        return await super().update_runner(instance_id, status)


async def test_a_runner_started_while_the_store_was_away_is_reported_once_it_is_back():
    """Seeds 5, 9, 11: the agent started a runner, its "ready" report met the outage, and the except path took the
    start for a failure: the runner ran, the instance stayed ``Starting`` for good and its deployment never
    converged. The agent now says again what the store did not take, at its next reconcile pass."""
    store = _FlakyReports()
    await store.put_node(node("n1"), ttl=600)
    manager = await _manager(store, {})
    [a] = await manager.deploy("scripted", replicas=1, nodes=["n1"])
    agent = NodeAgent(
        store,
        [scripted_plugin.ScriptedBackend()],
        manager.resolve,
        choose=lambda card, backends: backends[0],
        name="n1",
        flops=1e10,
        secret="s",
    )
    await agent._launch(await store.get_instance(a.id))
    assert isinstance(agent.launched[a.id][1], InProcess), "it runs"
    assert (await store.get_instance(a.id)).runners == {}  # nothing said yet
    store.fixed = True
    await agent.reconcile()
    runner = (await store.get_instance(a.id)).runners["n1"]
    assert (runner.state, runner.epoch) == ("ready", a.epoch)
    await manager.refresh()
    await manager.reconcile()
    assert isinstance((await store.get_instance(a.id)).state, Ready)
    assert msgspec.structs.asdict(runner)["url"] == InProcess.url
