"""Key records and sliding-window counters (``gateway.auth.keys``), in memory and in a real Redis."""

from __future__ import annotations

import json
import uuid

import pytest

from meshgate.gateway.auth import keys as accounts_module
from meshgate.gateway.auth.guard import digest, mint
from meshgate.gateway.auth.keys import MemoryAccounts, RedisAccounts


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
    assert secret not in path.read_text() and json.loads(path.read_text())[0]["digest"] == digest(secret)
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
