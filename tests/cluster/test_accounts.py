"""Key records and sliding-window counters (``gateway.auth.keys``), in memory and in a real Redis."""

from __future__ import annotations

import asyncio
import json
import uuid

import msgspec
import pytest
import redis.asyncio as redis

from meshgate.gateway.auth import keys as accounts_module
from meshgate.gateway.auth.guard import digest, mint
from meshgate.gateway.auth.keys import MemoryAccounts, RedisAccounts, open_accounts
from meshgate.gateway.cluster.redis_store import RedisStore
from meshgate.protocols.model import StoreUnavailable


@pytest.fixture(params=["memory", "redis"])
async def pair(request, tmp_path):
    """Two clients of the same accounts (two gateways): one object in memory, two connections on Redis."""
    if request.param == "memory":
        one = MemoryAccounts(tmp_path / "keys.json")
        yield one, one
        return
    url = request.getfixturevalue("redis_server").url
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    one, two = RedisAccounts(url, prefix), RedisAccounts(url, prefix)
    yield one, two
    await one.close()
    await two.close()


def at(monkeypatch, seconds: float) -> None:
    monkeypatch.setattr(accounts_module.time, "time", lambda: seconds)


async def test_keys_are_stored_hashed_and_shared(pair):
    one, two = pair
    secret, record = mint("alice", "inference", ("scripted",), rpm=5)
    await one.put_key(record)
    got = await two.get_key(record.id)
    assert got == record and got.digest == digest(secret)
    assert secret not in repr(await two.keys())
    assert await two.delete_key(record.id) and await one.get_key(record.id) is None
    assert not await one.delete_key(record.id)


async def test_memory_keys_survive_a_restart_in_a_private_file(tmp_path):
    path = tmp_path / "keys.json"
    secret, record = mint("bob", "admin")
    await MemoryAccounts(path).put_key(record)
    assert await MemoryAccounts(path).get_key(record.id) == record
    assert secret not in path.read_text() and json.loads(path.read_text())["keys"][0]["digest"] == digest(secret)
    assert path.stat().st_mode & 0o777 == 0o600


async def test_the_window_slides_across_the_minute(pair, monkeypatch):
    """3 at :59 and 3 at :00 are 6 in the last minute: with a limit of 3, the second three are refused."""
    one, two = pair
    at(monkeypatch, 6000 * 60 + 59.0)
    assert [(await one.window("requests:x", 1, 3))[0] for _ in range(3)] == [True, True, True]
    at(monkeypatch, 6001 * 60 + 0.5)
    assert not (await two.window("requests:x", 1, 3))[0], "the previous minute still counts"
    at(monkeypatch, 6001 * 60 + 45.0)  # 3 x 0.25 of the previous minute remain
    assert (await one.window("requests:x", 1, 3))[0]
    at(monkeypatch, 6003 * 60)
    counted, count = await two.window("requests:x", 1, 3)
    assert counted and count == 0, "two minutes on, nothing is left"


async def test_a_refused_hit_is_not_counted_and_amounts_add(pair, monkeypatch):
    one, two = pair
    at(monkeypatch, 7000 * 60 + 1.0)
    assert (await one.window("tokens:k", 40, 0)) == (True, 0.0)
    assert (await two.window("tokens:k", 50, 100)) == (True, 40.0)
    assert (await one.window("tokens:k", 20, 100)) == (False, 90.0)
    assert (await two.window("tokens:k", 0, 0)) == (True, 90.0)


async def test_memory_counters_are_bounded():
    accounts = MemoryAccounts(max_names=100)
    for i in range(3000):
        await accounts.window(f"requests:addr:10.0.{i // 256}.{i % 256}", 1, 5)
    assert len(accounts._windows) == 100


async def test_the_first_key_seals_the_accounts_for_good(pair):
    """Auth fails closed (issue 37, 1): revoking the last key leaves the accounts sealed."""
    one, two = pair
    assert not await one.sealed() and not await two.sealed()
    _, record = mint("carol", "inference")
    await one.put_key(record)
    assert await two.sealed()
    await two.delete_key(record.id)
    assert await two.keys() == [] and await one.sealed() and await two.sealed()


async def test_memory_accounts_stay_sealed_across_a_restart_with_no_key_left(tmp_path):
    path = tmp_path / "keys.json"
    accounts = MemoryAccounts(path)
    _, record = mint("dave", "admin")
    await accounts.put_key(record)
    await accounts.delete_key(record.id)
    assert await MemoryAccounts(path).sealed()
    path.write_text(json.dumps([json.loads(msgspec.json.encode(record))]))  # a keys.json from before the seal
    assert await MemoryAccounts(path).sealed()


async def test_a_flushed_redis_is_sealed_again_from_the_gateways_own_copy(redis_server, tmp_path):
    """The store restarted empty (FLUSHDB): a gateway that saw the seal keeps auth on and puts the seal back, so a
    gateway started afterwards (with no file of its own) sees it too."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    first = open_accounts(redis_server.url, str(tmp_path / "a"), prefix)
    _, record = mint("erin", "admin")
    await first.put_key(record)
    client = redis.Redis.from_url(redis_server.url)
    try:
        for key in await client.keys(f"{prefix}*"):
            await client.delete(key)
    finally:
        await client.aclose()
    later = open_accounts(redis_server.url, str(tmp_path / "b"), prefix)
    try:
        assert await first.keys() == [] and await first.sealed()
        assert await later.sealed()  # sealed again in Redis by the first gateway
    finally:
        await first.close()
        await later.close()


async def _empty(client, prefix: str, store: RedisStore) -> None:
    """Redis restarted empty: nothing under ``prefix``, and a new incarnation (named by its first reader)."""
    for key in await client.keys(f"{prefix}*"):
        await client.delete(key)
    await store.incarnation()


async def test_a_gateway_that_never_saw_the_seal_waits_for_it_after_an_empty_restart(redis_server, tmp_path):
    """A key made on one gateway, then Redis restarted empty before another gateway asked: that one cannot tell the
    empty store's "no key ever" from a lost seal, since the store is not the one it knew (its incarnation). It
    answers 503 (``StoreUnavailable``) until the gateway that knew the seal puts it back, then keeps auth on."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    store = RedisStore(redis_server.url, prefix)
    await store.incarnation()  # the cluster store names the store when a gateway starts
    maker = open_accounts(redis_server.url, str(tmp_path / "a"), prefix)
    other = open_accounts(redis_server.url, str(tmp_path / "b"), prefix)
    client = redis.Redis.from_url(redis_server.url)
    try:
        assert not await other.sealed()  # no key yet: open
        await maker.put_key(mint("frank", "admin")[1])
        await _empty(client, prefix, store)
        with pytest.raises(StoreUnavailable):
            await other.sealed()
        assert await maker.sealed()  # its own copy of the seal: put back (``KeyRing.keep_seal`` asks every 2 s)
        assert await other.sealed()
    finally:
        await client.aclose()
        await store.close()
        await maker.close()
        await other.close()


async def test_an_open_cluster_stays_open_after_an_empty_restart_once_no_seal_comes_back(
    redis_server, tmp_path, monkeypatch
):
    """No key was ever made: after ``SEAL_SETTLE`` seconds of 503s no gateway has put a seal back, so the empty
    store is taken as it is, and the gateway serves openly again (an operator's trusted-network setup)."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    store = RedisStore(redis_server.url, prefix)
    await store.incarnation()
    gateway = open_accounts(redis_server.url, str(tmp_path / "a"), prefix)
    client = redis.Redis.from_url(redis_server.url)
    try:
        monkeypatch.setattr(accounts_module, "SEAL_SETTLE", 0.5)  # 5 s as shipped
        assert not await gateway.sealed()
        await _empty(client, prefix, store)
        with pytest.raises(StoreUnavailable):
            await gateway.sealed()
        await asyncio.sleep(0.6)
        assert not await gateway.sealed()
        assert not await gateway.sealed()  # and from then on
    finally:
        await client.aclose()
        await store.close()
        await gateway.close()
