"""A Redis that stalls or goes away (issue 37, 2): every store call fails within the store's timeout as a 503 the
client may retry (``StoreUnavailable``), never hangs, never carries Redis' address; keys checked just before are
still taken, and rate limits count in the gateway meanwhile. A real ``redis-server``, paused with SIGSTOP."""

from __future__ import annotations

import asyncio
import time
import uuid
from types import SimpleNamespace

import pytest

from meshgate.backends.placement import InstanceId
from meshgate.gateway.auth.guard import KeyRing, mint
from meshgate.gateway.auth.keys import RedisAccounts
from meshgate.gateway.cluster.redis_store import RedisStore
from meshgate.protocols.model import StoreUnavailable
from tests.cluster.redis_server import RedisServer

TIMEOUT = 0.5


@pytest.fixture
def server(tmp_path):
    with RedisServer(tmp_path / "redis") as s:
        yield s
        s.resume()  # never leave it stopped for stop() to wait on


async def _fails_fast(call, server) -> StoreUnavailable:
    began = time.monotonic()
    with pytest.raises(StoreUnavailable) as failed:
        await asyncio.wait_for(call, 10)
    assert time.monotonic() - began < TIMEOUT + 1.5  # the timeout, a retry's backoff at most: no hang
    assert str(server.port) not in failed.value.message and "127.0.0.1" not in failed.value.message
    assert failed.value.status == 503 and failed.value.retry_after > 0
    return failed.value


async def test_a_paused_redis_fails_each_store_call_within_its_timeout(server):
    store = RedisStore(server.url, f"t-{uuid.uuid4().hex[:6]}:", timeout=TIMEOUT)
    try:
        assert await store.instances() == []
        server.pause()
        await _fails_fast(store.instances(), server)
        await _fails_fast(store.get_instance(InstanceId("x")), server)
        await _fails_fast(store.generation(), server)
        server.resume()
        assert await asyncio.wait_for(store.instances(), 5) == []  # the connection recovers by itself
    finally:
        server.resume()
        await store.close()


async def test_a_redis_that_is_gone_fails_fast_too(server):
    store = RedisStore(server.url, f"t-{uuid.uuid4().hex[:6]}:", timeout=TIMEOUT)
    try:
        await store.generation()
        server.stop(kill=True)
        await _fails_fast(store.nodes(), server)
    finally:
        await store.close()


async def test_keys_checked_just_before_the_outage_are_still_served(server):
    accounts = RedisAccounts(server.url, f"t-{uuid.uuid4().hex[:6]}:", timeout=TIMEOUT)
    ring = KeyRing(accounts)
    key, record = mint("alice", "inference", rpm=2)
    unseen, other = mint("bob", "inference")
    await accounts.put_key(record)
    await accounts.put_key(other)
    connection = SimpleNamespace(headers={"authorization": f"Bearer {key}"}, client=None)
    try:
        assert (await ring.identify(connection)).bucket == f"key:{record.id}"
        assert await ring.enabled()
        server.pause()
        caller = await asyncio.wait_for(ring.identify(connection), 5)  # served from the record checked just now
        assert caller.bucket == f"key:{record.id}" and caller.rpm == 2
        await ring.admit(caller)  # rate limits count in this gateway meanwhile: 2 a minute
        await ring.admit(caller)
        with pytest.raises(Exception, match="rate limit"):
            await ring.admit(caller)
        stranger = SimpleNamespace(headers={"authorization": f"Bearer {unseen}"}, client=None)
        await _fails_fast(ring.identify(stranger), server)  # never checked: 503, not let in, not refused
    finally:
        server.resume()
        await accounts.close()


async def test_the_store_says_when_it_was_away_or_slow(server):
    """``RedisStore.unavailable_at``: the gateway keeps the nodes a stalled store let lapse for a TTL after it
    (``InstanceManager``). A call that failed marks it; so does one that answered past half the timeout (found by
    the simulator, seed 1739: a 2.4 s stall under a 2 s timeout, every call late but none failed, and every node
    failed as gone)."""
    store = RedisStore(server.url, f"t-{uuid.uuid4().hex[:6]}:", timeout=TIMEOUT)
    try:
        await store.generation()
        assert store.unavailable_at == float("-inf")
        server.pause()
        asyncio.get_running_loop().call_later(0.4, server.resume)  # late, within the timeout
        before = time.monotonic()
        await store.generation()
        assert store.unavailable_at >= before
        server.pause()
        failed_at = time.monotonic()
        await _fails_fast(store.generation(), server)
        assert store.unavailable_at >= failed_at
    finally:
        server.resume()
        await store.close()
