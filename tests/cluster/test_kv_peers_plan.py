"""Which runners a KV tier may fetch from, and when the gateway tells them to warm: plain functions and one
``KvTiers`` over fakes (no runner, no store)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from meshgate.backends.placement import Link, NodeId
from meshgate.gateway.cluster.kv_tiers import SAME_NODE, WARM, KvTiers, peer_lists
from meshgate.gateway.cluster.records import Draining, Instance, Ready, RunnerStatus
from meshgate.gateway.cluster.replicas import Replicas
from tests.cluster.test_store import instance

HEALTH = {"status": "ok", "kv_tier": {"ram_bytes": 1, "ram_budget": 2}}


def _placed(instance_id: str, node: str, state: object = None) -> Instance:
    status = RunnerStatus(node_id=NodeId(node), state="ready", url=f"http://{node}/{instance_id}")
    return instance(instance_id, nodes=(node,), state=state or Ready(), runners={node: status})


def test_peers_are_the_other_replicas_of_the_model_with_the_link_to_each():
    a, b, c = _placed("i1", "a"), _placed("i2", "b"), _placed("i3", "a")
    other_model = instance("i4", nodes=("b",), state=Ready(), model="other")
    links = [Link(src=NodeId("a"), dst=NodeId("b"), latency=0.002, bandwidth=1e8)]
    lists = peer_lists([a, b, c, other_model], links)
    assert lists["i1"] == [
        {"url": "http://b/i2", "bandwidth": 1e8, "latency": 0.002, "node": "b"},
        {"url": "http://a/i3", "bandwidth": SAME_NODE, "latency": 0.0, "node": "a"},
    ]
    assert lists["i2"][0] == {"url": "http://a/i1", "bandwidth": 0.0, "latency": 0.0, "node": "a"}, "not measured"
    assert "i4" not in lists or lists["i4"] == [], "another model's runner is never a peer"


async def test_a_new_replica_warms_from_a_peer_and_a_draining_one_hands_its_sessions_over():
    view = [_placed("i1", "a"), _placed("i2", "b")]
    told: list[tuple[str, str, dict]] = []

    async def health_of(_instance: Instance) -> dict:
        return HEALTH

    async def tell(target: Instance, action: str, body: dict) -> None:
        told.append((target.id, action, body))

    tiers = KvTiers(lambda: view, health_of, tell=tell)
    await tiers.poll()
    expected = [("i1", "peers"), ("i1", "warm"), ("i2", "peers"), ("i2", "warm")]
    assert sorted((i, action) for i, action, _ in told) == expected
    assert {body["count"] for _, action, body in told if action == "warm"} == {WARM}
    assert {i: body["node"] for i, action, body in told if action == "peers"} == {"i1": "a", "i2": "b"}
    told.clear()
    await tiers.poll()
    assert told == [], "nothing changed: nobody is told again"

    view[1] = _placed("i2", "b", Draining())
    view.append(_placed("i3", "c"))
    await tiers.poll()
    warm = sorted((i, body["url"]) for i, action, body in told if action == "warm")
    assert ("i1", "http://b/i2") in warm and ("i3", "http://b/i2") in warm, "the staying replicas take i2's sessions"
    assert ("i3", "http://a/i1") in warm, "the new replica warms from a peer"
    told.clear()
    await tiers.poll()
    assert not [t for t in told if t[1] == "warm"], "a drain is handed over once"


async def test_routing_learns_which_replicas_tiers_hold_a_prefix_from_their_health():
    view = [_placed("i1", "a"), _placed("i2", "b")]
    key = bytes.fromhex("00112233aabbccdd")
    answers = {"i1": {"kv_tier": {**HEALTH["kv_tier"], "prefixes": [key.hex(), "not hex"]}}, "i2": HEALTH}

    async def health_of(target: Instance) -> dict:
        return answers[target.id]

    tiers = KvTiers(lambda: view, health_of)
    await tiers.poll()
    assert tiers.holding(key) == {"i1"} and tiers.holding(b"other") == frozenset()
    view.pop(0)  # i1 went away
    await tiers.poll()
    assert tiers.holding(key) == frozenset()


async def test_a_new_replica_takes_no_traffic_while_it_warms_unless_it_is_the_only_one():
    view = [_placed("i1", "a")]
    warming = {"i2": 1}

    async def health_of(target: Instance) -> dict:
        return {"kv_tier": {**HEALTH["kv_tier"], "warming": warming.get(target.id, 0)}}

    async def tell(target: Instance, action: str, body: dict) -> None:
        pass

    tiers = KvTiers(lambda: view, health_of, tell=tell)
    await tiers.poll()
    assert tiers.cold({"i1"}) == set(), "the first replica has no peer to warm from"
    view.append(_placed("i2", "b"))
    await tiers.poll()
    assert tiers.cold({"i1", "i2"}) == {"i2"}, "told to warm from i1: cold until its runner says it is done"

    cache = SimpleNamespace(store=None, cached=lambda model: view)
    replicas = Replicas(cache, deployments=None, load=lambda i: {"i1": 5, "i2": 0}[i])  # type: ignore[arg-type]
    replicas.cold = tiers.cold
    assert replicas._pick("m", None, None).id == "i1", "the warm replica, though busier"
    alone = Replicas(SimpleNamespace(store=None, cached=lambda model: view[1:]), deployments=None)  # type: ignore[arg-type]
    alone.cold = tiers.cold
    assert alone._pick("m", None, None).id == "i2", "the only ready replica serves, warm or not"
    warming["i2"] = 0
    for _ in range(200):  # the watcher looks every WATCH (0.5 s); a loaded box may take a few turns
        if not tiers.cold({"i2"}):
            break
        await asyncio.sleep(0.1)
    assert tiers.cold({"i1", "i2"}) == set(), "its runner finished warming: routing may send it work"
    assert replicas._pick("m", None, None).id == "i2", "now the less loaded one"
    await tiers.close()
