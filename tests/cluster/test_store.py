"""The state store, on ``MemoryStore`` and on ``RedisStore`` against a real ``redis-server``.

Every wait is bounded: polls with a deadline, ``asyncio.wait_for`` around every read of a watcher.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import pytest

from meshgate.backends.placement import Candidate, InstanceId, Link, Node, NodeId, Shard
from meshgate.gateway.cluster.records import (
    Draining,
    Failed,
    Instance,
    Ready,
    RunnerStatus,
    Starting,
    StoreEvent,
    state_tag,
)
from meshgate.gateway.cluster.redis_store import RedisStore
from meshgate.gateway.cluster.store import KINDS, MemoryStore, StateStore
from tests.cluster.redis_server import RedisServer

WAIT = 5.0


def node(node_id: str, **kw: object) -> Node:
    return Node(id=NodeId(node_id), name=f"host-{node_id}", memory_total=8 << 30, **kw)  # type: ignore[arg-type]


def link(src: str, dst: str, latency: float = 0.001) -> Link:
    return Link(src=NodeId(src), dst=NodeId(dst), latency=latency, bandwidth=1e9, measured_at=time.time())


def instance(instance_id: str = "i1", nodes: tuple[str, ...] = ("a", "b"), **kw: object) -> Instance:
    shards = tuple(
        Shard(node_id=NodeId(n), layer_start=i * 9, layer_end=(i + 1) * 9, weight_bytes=100)
        for i, n in enumerate(nodes)
    )
    placement = Candidate(
        id="c1",
        model="gemma3:270m",
        backend="llama_cpp",
        strategy="pipeline",
        context=4096,
        shards=shards,
        memory_per_node={n: 100 for n in nodes},
        tok_s=20.0,
    )
    now = time.time()
    fields: dict[str, object] = dict(
        id=InstanceId(instance_id),
        model="gemma3:270m",
        placement=placement,
        state=Starting(),
        created_at=now,
        updated_at=now,
    )
    fields.update(kw)
    return Instance(**fields)  # type: ignore[arg-type]


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met in {timeout}s")
        await asyncio.sleep(0.02)


async def next_kind(watch: AsyncIterator[str], timeout: float = WAIT) -> str:
    return await asyncio.wait_for(anext(watch), timeout)


async def drain_initial(watch: AsyncIterator[str]) -> None:
    """A new watcher first yields every kind once."""
    assert sorted([await next_kind(watch) for _ in KINDS]) == sorted(KINDS)


# ------------------------------------------------------------------------------------------------ nodes and links


async def test_protocol(store: StateStore) -> None:
    assert isinstance(store, StateStore)


async def test_nodes_register_refresh_and_remove(store: StateStore) -> None:
    assert await store.nodes() == []
    await store.put_node(node("b", cpu_count=4), ttl=30)
    await store.put_node(node("a"), ttl=30)
    assert [n.id for n in await store.nodes()] == ["a", "b"]
    assert (await store.nodes())[1] == node("b", cpu_count=4)
    await store.put_node(node("a", memory_available=123), ttl=30)  # a refresh replaces the record
    assert (await store.nodes())[0].memory_available == 123
    assert await store.remove_node(NodeId("a")) is True
    assert await store.remove_node(NodeId("a")) is False
    assert [n.id for n in await store.nodes()] == ["b"]


async def test_node_expires_without_heartbeat(store: StateStore) -> None:
    await store.put_node(node("short"), ttl=0.5)
    await store.put_node(node("long"), ttl=30)
    assert {n.id for n in await store.nodes()} == {"short", "long"}

    async def gone() -> bool:
        return [n.id for n in await store.nodes()] == ["long"]

    started = time.monotonic()
    await eventually(gone, timeout=3.0)
    assert time.monotonic() - started > 0.3


async def test_heartbeats_keep_a_node_alive(store: StateStore) -> None:
    deadline = time.monotonic() + 1.2
    while time.monotonic() < deadline:  # 0.5 s TTL, refreshed every 0.15 s, for more than twice the TTL
        await store.put_node(node("a"), ttl=0.5)
        assert [n.id for n in await store.nodes()] == ["a"]
        await asyncio.sleep(0.15)


async def test_links_follow_their_nodes(store: StateStore) -> None:
    for n in "abc":
        await store.put_node(node(n), ttl=30 if n != "c" else 0.5)
    await store.put_link(link("a", "b"))
    await store.put_link(link("b", "a"))
    await store.put_link(link("a", "c"))
    await store.put_link(link("a", "b", latency=0.002))  # a new measurement replaces the old one
    got = await store.links()
    assert [(x.src, x.dst) for x in got] == [("a", "b"), ("a", "c"), ("b", "a")]
    assert got[0].latency == 0.002

    async def c_gone() -> bool:
        return [(x.src, x.dst) for x in await store.links()] == [("a", "b"), ("b", "a")]

    await eventually(c_gone, timeout=3.0)
    await store.put_node(node("c"), ttl=30)  # c comes back: its old link was dropped with it
    assert [(x.src, x.dst) for x in await store.links()] == [("a", "b"), ("b", "a")]
    assert await store.remove_node(NodeId("b"))
    assert await store.links() == []
    await store.put_node(node("b"), ttl=30)
    assert await store.links() == []


async def test_link_put_before_its_node_appears_with_it(store: StateStore) -> None:
    await store.put_node(node("a"), ttl=30)
    await store.put_link(link("a", "b"))
    assert await store.links() == []
    await store.put_node(node("b"), ttl=30)
    assert [(x.src, x.dst) for x in await store.links()] == [("a", "b")]


# ------------------------------------------------------------------------------------------------ instances


async def test_instance_put_get_list_delete(store: StateStore) -> None:
    assert await store.get_instance(InstanceId("i1")) is None
    first = instance("i1", runners={"a": RunnerStatus(NodeId("a"), "starting")})
    await store.put_instance(first)
    second = instance("i2", nodes=("b",), state=Failed(reason="node b left"), epoch=2, attempts=1)
    await store.put_instance(second)
    assert await store.get_instance(InstanceId("i1")) == first
    assert await store.get_instance(InstanceId("i2")) == second
    assert [i.id for i in await store.instances()] == ["i1", "i2"]

    replaced = instance("i1", nodes=("b",), epoch=1)  # a re-placement replaces the record and its runners
    await store.put_instance(replaced)
    assert await store.get_instance(InstanceId("i1")) == replaced

    assert await store.delete_instance(InstanceId("i1")) is True
    assert await store.delete_instance(InstanceId("i1")) is False
    assert await store.get_instance(InstanceId("i1")) is None
    assert [i.id for i in await store.instances()] == ["i2"]


async def test_returned_records_are_copies(store: StateStore) -> None:
    await store.put_instance(instance("i1"))
    got = await store.get_instance(InstanceId("i1"))
    assert got is not None
    got.runners["x"] = RunnerStatus(NodeId("x"), "ready")
    assert (await store.get_instance(InstanceId("i1"))).runners == {}  # type: ignore[union-attr]


async def test_update_runner_from_two_writers(store: StateStore, peer: StateStore) -> None:
    await store.put_instance(instance("i1"))

    async def agent(s: StateStore, node_id: str) -> None:
        for step in range(40):
            state = "ready" if step == 39 else "starting"
            status = RunnerStatus(NodeId(node_id), state, url=f"http://{node_id}:{step}", pid=1000 + step)
            assert await s.update_runner(InstanceId("i1"), status)

    await asyncio.wait_for(asyncio.gather(agent(store, "a"), agent(peer, "b")), WAIT)
    got = await peer.get_instance(InstanceId("i1"))
    assert got is not None
    assert got.runners == {
        "a": RunnerStatus(NodeId("a"), "ready", "http://a:39", 1039),
        "b": RunnerStatus(NodeId("b"), "ready", "http://b:39", 1039),
    }
    assert isinstance(got.state, Starting)
    assert [i.runners.keys() for i in await store.instances()] == [{"a", "b"}]


async def test_update_runner_does_not_resurrect(store: StateStore) -> None:
    assert await store.update_runner(InstanceId("gone"), RunnerStatus(NodeId("a"), "failed", error="x")) is False
    assert await store.get_instance(InstanceId("gone")) is None
    assert await store.instances() == []


async def test_set_state_compare_and_set(store: StateStore, peer: StateStore) -> None:
    await store.put_instance(instance("i1", state=Ready()))
    before = (await store.get_instance(InstanceId("i1"))).updated_at  # type: ignore[union-attr]
    await store.update_runner(InstanceId("i1"), RunnerStatus(NodeId("a"), "ready"))

    # Two gateways see the same failure and both try to take the instance for re-placement: one wins.
    results = await asyncio.wait_for(
        asyncio.gather(
            store.set_state(InstanceId("i1"), Failed(reason="node b left"), expected=Ready),
            peer.set_state(InstanceId("i1"), Failed(reason="runner on b failed"), expected=Ready),
        ),
        WAIT,
    )
    assert sorted(results) == [False, True]
    got = await peer.get_instance(InstanceId("i1"))
    assert got is not None
    assert got.state == Failed(reason="node b left" if results[0] else "runner on b failed")
    assert got.updated_at >= before
    assert got.runners.keys() == {"a"}  # a state change keeps the runner reports

    assert await store.set_state(InstanceId("i1"), Starting(), expected=Ready) is False
    assert await store.set_state(InstanceId("i1"), Starting(), expected=Failed) is True
    assert await store.set_state(InstanceId("i1"), Draining()) is True  # unconditional
    assert isinstance((await store.get_instance(InstanceId("i1"))).state, Draining)  # type: ignore[union-attr]
    assert await store.set_state(InstanceId("nope"), Ready()) is False
    assert await store.get_instance(InstanceId("nope")) is None
    with pytest.raises(TypeError):
        await store.set_state(InstanceId("i1"), Ready(), expected=str)


async def test_a_state_change_from_a_superseded_epoch_is_refused(store: StateStore) -> None:
    """A late failure report about epoch 0 never fails the re-placed epoch 1."""
    await store.put_instance(instance("i1", state=Ready(), epoch=1))
    assert await store.set_state(InstanceId("i1"), Failed(reason="late"), expected=Ready, epoch=0) is False
    assert isinstance((await store.get_instance(InstanceId("i1"))).state, Ready)  # type: ignore[union-attr]
    assert await store.set_state(InstanceId("i1"), Failed(reason="now"), expected=Ready, epoch=1) is True


async def test_update_instance_writes_only_over_the_state_and_epoch_it_read(
    store: StateStore, peer: StateStore
) -> None:
    """The lost update of issue 37 (9): an expiry written from a read made before another gateway failed the
    instance must not put it back to ready, and nothing may re-create a deleted record."""
    await store.put_instance(instance("i1", state=Ready()))
    await store.update_runner(InstanceId("i1"), RunnerStatus(NodeId("a"), "ready", url="http://a"))
    read = await store.get_instance(InstanceId("i1"))
    assert read is not None
    assert await peer.set_state(InstanceId("i1"), Failed(reason="runner on a failed"), expected=Ready)
    stale = msgspec.structs.replace(read, expires_at=123.0)
    assert await store.update_instance(stale, expected=Ready, epoch=read.epoch) is False
    got = await store.get_instance(InstanceId("i1"))
    assert got is not None and got.state == Failed(reason="runner on a failed") and got.expires_at is None

    # the write the state allows: runner reports kept unless asked to replace them
    fresh = msgspec.structs.replace(got, expires_at=5.0, runners={})
    assert await store.update_instance(fresh, expected=Failed, epoch=0) is True
    got = await store.get_instance(InstanceId("i1"))
    assert got is not None and got.expires_at == 5.0 and got.runners.keys() == {"a"}
    moved = msgspec.structs.replace(got, state=Starting(), epoch=1, runners={}, placement=got.placement)
    assert await store.update_instance(moved, expected=Failed, epoch=0, runners=True) is True
    got = await store.get_instance(InstanceId("i1"))
    assert got is not None and got.runners == {} and got.epoch == 1 and isinstance(got.state, Starting)
    assert await store.update_instance(moved, expected=Starting, epoch=0) is False  # epoch 1 now

    await store.delete_instance(InstanceId("i1"))
    assert await store.update_instance(moved, expected=Starting, epoch=1) is False
    assert await store.get_instance(InstanceId("i1")) is None and await store.instances() == []


async def test_many_concurrent_compare_and_sets_one_winner(store: StateStore, peer: StateStore) -> None:
    await store.put_instance(instance("i1", state=Failed(reason="x")))
    calls = [s.set_state(InstanceId("i1"), Starting(), expected=Failed) for _ in range(10) for s in (store, peer)]
    assert sum(await asyncio.wait_for(asyncio.gather(*calls), WAIT)) == 1


def test_state_tags() -> None:
    assert [state_tag(s) for s in (Starting, Ready, Draining, Failed)] == ["starting", "ready", "draining", "failed"]
    assert state_tag(Failed(reason="x")) == "failed"


# ------------------------------------------------------------------------------------------------ events


async def test_events_append_and_read_in_order(store: StateStore) -> None:
    assert await store.events() == []
    appended = [
        await store.append_event(
            "instance.placed",
            f"placed {i}",
            instance_id="i1",
            node_id="a",
            data={"placement": '{"id":"c1"}', "n": str(i)},
        )
        for i in range(5)
    ]
    assert all(isinstance(e, StoreEvent) for e in appended)
    assert len({e.id for e in appended}) == 5
    got = await store.events()
    assert got == appended
    assert [e.message for e in got] == [f"placed {i}" for i in range(5)]
    assert got[0].kind == "instance.placed" and got[0].data == {"placement": '{"id":"c1"}', "n": "0"}
    assert await store.events(since=appended[1].id) == appended[2:]
    assert await store.events(since=appended[1].id, count=2) == appended[2:4]
    assert await store.events(since=appended[-1].id) == []
    assert await store.events(count=1) == appended[:1]
    bare = await store.append_event("node.joined", "node a joined")
    assert (bare.instance_id, bare.node_id, bare.data) == (None, None, None)


# ------------------------------------------------------------------------------------------------ changes


async def test_generation_and_watch(store: StateStore, peer: StateStore) -> None:
    watch = peer.watch()
    try:
        await drain_initial(watch)
        gen = await store.generation()

        async def wrote(write: Awaitable[object], kind: str) -> None:
            nonlocal gen
            await write
            assert await next_kind(watch) == kind
            assert await store.generation() > gen
            gen = await store.generation()

        await wrote(store.put_node(node("a"), ttl=30), "nodes")
        await wrote(store.put_node(node("b"), ttl=30), "nodes")
        await wrote(store.put_link(link("a", "b")), "links")
        await wrote(store.put_instance(instance("i1")), "instances")
        await wrote(store.update_runner(InstanceId("i1"), RunnerStatus(NodeId("a"), "ready")), "instances")
        await wrote(store.set_state(InstanceId("i1"), Ready()), "instances")
        await wrote(store.delete_instance(InstanceId("i1")), "instances")
        await store.remove_node(NodeId("b"))
        assert {await next_kind(watch), await next_kind(watch)} == {"nodes", "links"}

        await store.append_event("x", "audit only")  # not state: no generation, no wake-up
        assert await store.set_state(InstanceId("gone"), Ready()) is False  # nothing written
        assert await store.generation() > 0 and await store.generation() == gen + 1
        with pytest.raises(TimeoutError):
            await next_kind(watch, timeout=0.3)
    finally:
        await watch.aclose()  # type: ignore[attr-defined]


async def test_expiry_is_announced_when_noticed(store: StateStore, peer: StateStore) -> None:
    await store.put_node(node("a"), ttl=0.3)
    watch = peer.watch()
    try:
        await drain_initial(watch)
        await asyncio.sleep(0.5)
        gen = await store.generation()
        assert await store.nodes() == []  # the read notices the expiry and tells everyone
        assert await store.generation() == gen + 1
        assert {await next_kind(watch), await next_kind(watch)} == {"nodes", "links"}
    finally:
        await watch.aclose()  # type: ignore[attr-defined]


async def test_watchers_coalesce_and_end_on_close(store_kind: str, prefix: str, request: pytest.FixtureRequest) -> None:
    s = MemoryStore() if store_kind == "memory" else RedisStore(request.getfixturevalue("redis_server").url, prefix)
    watches = [s.watch(), s.watch()]
    for w in watches:
        await drain_initial(w)
    for i in range(20):
        await s.put_node(node(f"n{i}"), ttl=30)
    await s.put_link(link("n0", "n1"))  # delivered after every "nodes" message (one channel keeps order)
    while await next_kind(watches[0]) != "links":  # once the first watcher has it, so has the second
        pass
    assert [await next_kind(watches[1]), await next_kind(watches[1])] == ["nodes", "links"]  # 20 writes, 1 wake
    for w in watches:
        with pytest.raises(TimeoutError):
            await next_kind(w, timeout=0.2)
    await s.close()
    for w in watches:
        with pytest.raises(StopAsyncIteration):
            await next_kind(w)
    assert [k async for k in s.watch()] == []


# ------------------------------------------------------------------------------------------------ Redis only


async def test_two_redis_clients_share_state(redis_server: RedisServer, prefix: str) -> None:
    one, two = RedisStore(redis_server.url, prefix), RedisStore(redis_server.url, prefix)
    other = RedisStore(redis_server.url, prefix + "other:")
    try:
        await one.put_node(node("a"), ttl=30)
        await one.put_link(link("a", "a"))
        await one.put_instance(instance("i1"))
        await two.update_runner(InstanceId("i1"), RunnerStatus(NodeId("a"), "ready"))
        event = await two.append_event("instance.placed", "placed")
        assert [n.id for n in await two.nodes()] == ["a"]
        assert len(await two.links()) == 1
        assert (await one.get_instance(InstanceId("i1"))).runners.keys() == {"a"}  # type: ignore[union-attr]
        assert await one.events() == [event]
        assert await one.generation() == await two.generation() > 0
        assert await other.nodes() == [] and await other.instances() == [] and await other.events() == []
        assert await other.generation() == 0
    finally:
        for s in (one, two, other):
            await s.close()


async def test_redis_keys_live_under_the_prefix(redis_server: RedisServer, prefix: str) -> None:
    import redis.asyncio as aioredis

    s = RedisStore(redis_server.url, prefix)
    r = aioredis.Redis.from_url(redis_server.url)
    try:
        await s.put_node(node("a"), ttl=30)
        await s.put_link(link("a", "a"))
        await s.put_instance(instance("i1"))
        await s.update_runner(InstanceId("i1"), RunnerStatus(NodeId("a"), "ready"))
        await s.append_event("k", "m")
        keys = sorted(k.decode() for k in await r.keys(prefix + "*"))
        assert keys == [
            prefix + k for k in ("events", "generation", "instance:i1", "instances", "links", "node:a", "nodes")
        ]
        assert 0 < await r.pttl(prefix + "node:a") <= 30_000
        assert await r.ttl(prefix + "instance:i1") == -1  # placement records never expire
        fields = await r.hgetall(prefix + "instance:i1")
        assert set(fields) == {b"record", b"state", b"updated_at", b"runner:a"}
        assert fields[b"state"] == b'{"state":"starting"}'
    finally:
        await s.close()
        await r.aclose()


async def test_instances_survive_a_redis_restart_with_aof(tmp_path, prefix: str) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(tmp_path / "aof", appendonly=True)
    try:
        s = RedisStore(server.url, prefix)
        inst = instance("i1", state=Ready(), epoch=1)
        await s.put_instance(inst)
        await s.update_runner(InstanceId("i1"), RunnerStatus(NodeId("a"), "ready", "http://a:1", 42, epoch=1))
        await s.put_link(link("a", "b"))
        event = await s.append_event("instance.placed", "placed", instance_id="i1")
        gen = await s.generation()
        expected = await s.get_instance(InstanceId("i1"))
        assert expected is not None and expected.runners["a"].pid == 42

        server.restart(kill=True)  # a crash, not a clean shutdown

        async def back() -> bool:  # the old client reconnects by itself
            try:
                return await s.get_instance(InstanceId("i1")) == expected
            except Exception:
                return False

        await eventually(back, timeout=10.0)
        await s.close()
        fresh = RedisStore(server.url, prefix)
        try:
            assert await fresh.instances() == [expected]
            assert await fresh.events() == [event]
            assert await fresh.generation() == gen
            assert await fresh.set_state(InstanceId("i1"), Draining(), expected=Ready)  # scripts reload
        finally:
            await fresh.close()
    finally:
        server.stop()


async def test_watch_resyncs_after_redis_restart(tmp_path, prefix: str) -> None:  # type: ignore[no-untyped-def]
    server = RedisServer(tmp_path / "restart")
    s = RedisStore(server.url, prefix)
    watch = s.watch()
    try:
        await drain_initial(watch)
        server.restart()
        seen = set()
        while seen != set(KINDS):  # everything may have changed while the feed was down
            seen.add(await next_kind(watch, timeout=10.0))
        await s.put_instance(instance("i1"))
        assert await next_kind(watch) == "instances"
    finally:
        await watch.aclose()  # type: ignore[attr-defined]
        await s.close()
        server.stop()
