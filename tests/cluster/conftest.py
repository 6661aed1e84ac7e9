"""Fixtures for the cluster tests: one real ``redis-server`` per session, and a store per test in each flavour.

``store`` runs each test twice, on ``MemoryStore`` and on ``RedisStore`` (a fresh key prefix per test on the
session's server); ``peer`` is a second client of the same state (the same object for memory, a second
connection for Redis), for tests of concurrent writers.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from meshgate.gateway.cluster.redis_store import RedisStore
from meshgate.gateway.cluster.store import MemoryStore, StateStore
from tests.cluster.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
def store_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:8]}:"


@pytest.fixture
async def store(store_kind: str, prefix: str, request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    if store_kind == "memory":
        s: StateStore = MemoryStore()
    else:
        s = RedisStore(request.getfixturevalue("redis_server").url, prefix=prefix)
    yield s
    await s.close()


@pytest.fixture
async def peer(
    store: StateStore, store_kind: str, prefix: str, request: pytest.FixtureRequest
) -> AsyncIterator[StateStore]:
    if store_kind == "memory":
        yield store
        return
    s = RedisStore(request.getfixturevalue("redis_server").url, prefix=prefix)
    yield s
    await s.close()
