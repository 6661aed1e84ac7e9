"""The shared state store: ``RedisStore``, the ``StateStore`` (``gateway.cluster.store``) of several gateway
replicas and node agents, and the one Redis connection factory (``connect_redis``) every process uses. This module
owns every Redis key of the cluster state; the only other module that keeps keys is ``auth.keys`` (API keys and
rate-limit windows), listed here too. Every call is bounded by a timeout (``StoreUnavailable`` past it, and
``unavailable_at`` set); every compare-and-set is a Lua script.

Redis keys, all under ``prefix`` (default ``meshgate:``)::

    node:{node_id}       string  Node JSON, PX expiry = the heartbeat TTL (refreshed by every put_node)
    nodes                set     node ids; an id whose node key expired is removed lazily by the next read
    links                hash    field JSON ["src", "dst"] -> Link JSON
    instance:{id}        hash    record -> Instance JSON (runners left empty); state -> InstanceState JSON;
                                 updated_at -> float; runner:{node_id} -> RunnerStatus JSON (one per node,
                                 so two agents never overwrite each other)
    instances            set     instance ids
    events               stream  field e -> StoreEvent JSON, its id the stream id; XADD MAXLEN ~ 10000
    generation           int     bumped by every write that changes nodes, links or instances
    incarnation          string  a random token set (SET NX) by the first reader that finds none: a Redis that
                                 restarted empty (or was flushed) has a new one, and every process that knew the
                                 old one republishes or keeps what it knows (``StateStore.incarnation``)
    changes              pub/sub channel; messages "nodes" | "links" | "instances" (wake-ups only)
    cluster_secret       string  the secret runners and agents demand of callers; set once (SET NX), replaced only
                                 while provisional by the one running agents hold (``cluster_secret``)
    cluster_secret_provisional  string  "1" while the stored secret was made up by a process that held none
    deployments          hash    model -> Deployment JSON (desired replicas; a write bumps the generation and
                                 publishes "instances")
    loads                hash    field "{instance_id} {gateway_id}" -> LoadReport JSON; each gateway rewrites its
                                 fields every ~0.25 s; fields older than ``LOAD_STALE`` are ignored and, past
                                 ``LOAD_FORGET``, deleted by the next reader (no generation bump, no wake-up); age
                                 is by the reader's clock: since it last saw the field's stamp change
    claim:{name}         string  a short lease (SET NX PX) so that one gateway of many carries out a decision
    file:{id}, files, batch:{id}, batches, batches:active, batch:{id}:lines|pending|claims|results|counts
                         batch jobs, their files and lines claimed once (``redis_batches.RedisBatchStore``)
    keys                 hash    key id -> ApiKey JSON (``auth.keys.RedisAccounts``)
    window:{name}:{slot} string  a rate-limit counter, expiring after two windows (``auth.keys.RedisAccounts``)
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from meshgate.backends.placement import InstanceId, Link, Node, NodeId
from meshgate.gateway.cluster.records import (
    Deployment,
    Instance,
    InstanceState,
    LoadReport,
    RunnerStatus,
    StoreEvent,
    state_tag,
)
from meshgate.gateway.cluster.store import (
    KINDS,
    MAX_EVENTS,
    LoadAges,
    Watchers,
    deployment_json,
    encode,
    ends_json,
    event_json,
    instance_json,
    link_json,
    node_json,
    runner_json,
    state_json,
)
from meshgate.protocols.model import StoreUnavailable

__all__ = ["STORE_TIMEOUT", "RedisStore", "connect_redis"]

log = logging.getLogger(__name__)
T = TypeVar("T")


# Every script ends by bumping the generation (KEYS[gen]) and publishing its kind on the channel (ARGV[1]).
_BUMP = "redis.call('INCR', KEYS[{gen}]) redis.call('PUBLISH', ARGV[1], '{kind}')"
# KEYS: nodes index, links hash, generation, node:{id}...  ARGV: channel, force ("1": delete), id...
# Drops the given nodes whose key is gone (or every given node when forced), and their links.
_DROP_NODES = (
    """
local gone, n = {}, 0
for i = 4, #KEYS do
  local deleted = 0
  if ARGV[2] == '1' then deleted = redis.call('DEL', KEYS[i]) end
  if redis.call('EXISTS', KEYS[i]) == 0 and (redis.call('SREM', KEYS[1], ARGV[i - 1]) + deleted) > 0 then
    gone[ARGV[i - 1]] = true
    n = n + 1
  end
end
if n == 0 then return 0 end
for _, field in ipairs(redis.call('HKEYS', KEYS[2])) do
  local ends = cjson.decode(field)
  if gone[ends[1]] or gone[ends[2]] then redis.call('HDEL', KEYS[2], field) end
end
"""
    + _BUMP.format(gen=3, kind="nodes")
    + " redis.call('PUBLISH', ARGV[1], 'links') return n"
)

# KEYS: instance:{id}, instances index, generation  ARGV: channel, id, then the record's field, value pairs
# Creates the instance unless a record of its id exists (``put_instance(if_absent=True)``).
_PUT_NEW_INSTANCE = (
    """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('SADD', KEYS[2], ARGV[2])
"""
    + _BUMP.format(gen=3, kind="instances")
    + " return 1"
)

# KEYS: instance:{id}, generation  ARGV: channel, field, value
_UPDATE_RUNNER = (
    """
if redis.call('HEXISTS', KEYS[1], 'record') == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
"""
    + _BUMP.format(gen=2, kind="instances")
    + " return 1"
)

# KEYS: instance:{id}, generation  ARGV: channel, expected tag ('' = any), state JSON, updated_at, epoch ('' = any)
_SET_STATE = (
    """
local current = redis.call('HGET', KEYS[1], 'state')
if not current then return 0 end
if ARGV[2] ~= '' and cjson.decode(current)['state'] ~= ARGV[2] then return 0 end
if ARGV[5] ~= '' and (cjson.decode(redis.call('HGET', KEYS[1], 'record'))['epoch'] or 0) ~= tonumber(ARGV[5]) then
  return 0
end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'updated_at', ARGV[4])
"""
    + _BUMP.format(gen=2, kind="instances")
    + " return 1"
)


# KEYS: instance:{id}, generation  ARGV: channel, expected tag, expected epoch, record JSON, state JSON,
# updated_at, "1" to replace the runner reports, then field, value pairs of the new ones
_UPDATE_INSTANCE = (
    """
local record = redis.call('HGET', KEYS[1], 'record')
local current = redis.call('HGET', KEYS[1], 'state')
if not record or not current then return 0 end
if cjson.decode(current)['state'] ~= ARGV[2] then return 0 end
if (cjson.decode(record)['epoch'] or 0) ~= tonumber(ARGV[3]) then return 0 end
if ARGV[7] == '1' then
  for _, field in ipairs(redis.call('HKEYS', KEYS[1])) do
    if string.sub(field, 1, 7) == 'runner:' then redis.call('HDEL', KEYS[1], field) end
  end
  for i = 8, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
redis.call('HSET', KEYS[1], 'record', ARGV[4], 'state', ARGV[5], 'updated_at', ARGV[6])
"""
    + _BUMP.format(gen=2, kind="instances")
    + " return 1"
)


# KEYS: cluster_secret, cluster_secret_provisional  ARGV: proposed, held ("1": the caller's runners demand it)
_SECRET = """
local stored = redis.call('GET', KEYS[1])
if not stored or (ARGV[2] == '1' and stored ~= ARGV[1] and redis.call('EXISTS', KEYS[2]) == 1) then
  redis.call('SET', KEYS[1], ARGV[1])
  if ARGV[2] == '1' then redis.call('DEL', KEYS[2]) else redis.call('SET', KEYS[2], '1') end
  return ARGV[1]
end
if ARGV[2] == '1' and stored == ARGV[1] then redis.call('DEL', KEYS[2]) end
return stored
"""

# KEYS: claim:{name}  ARGV: holder. Deletes the lease only where the holder still has it.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

STORE_TIMEOUT = 2.0
"""Seconds one store call may take by default (``Settings.store_timeout``)."""

POOL_SIZE = 128
"""Connections one client (``connect_redis``) opens to Redis at most; more concurrent calls wait for one."""


def connect_redis(url: str, timeout: float = STORE_TIMEOUT) -> aioredis.Redis:
    """A client of the Redis at ``url`` (``redis://host:6379/0``), as every meshgate process opens it. Every
    connect and every reply is bounded by ``timeout`` seconds (a paused or black-holed Redis fails a call then,
    never hangs it); a pooled connection that broke (Redis restarted) is retried on a new one, three times with a
    short backoff, before an error. A timeout is not retried: the call has had its time.

    At most ``POOL_SIZE`` connections at once; a call beyond them waits for one, within ``timeout``
    (redis-py's plain pool refuses the 101st concurrent call at once with ``MaxConnectionsError``: a 503 under
    load, seen with 256 streams on one gateway of ``serve --workers``)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        url,
        max_connections=POOL_SIZE,
        timeout=timeout,  # waiting for a free connection
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(ExponentialBackoff(cap=0.25, base=0.05), 3, supported_errors=(RedisConnectionError,)),
        retry_on_error=[RedisConnectionError],
        health_check_interval=10,
    )
    return aioredis.Redis.from_pool(pool)


def _bounded(cls: type[T]) -> type[T]:
    """Every public coroutine method of ``cls`` raises ``StoreUnavailable`` (a 503 with ``retry-after``, no
    address in its message) where Redis fails, times out or refuses the connection; the log keeps the details."""
    for name, method in list(vars(cls).items()):
        if name.startswith("_") or not inspect.iscoroutinefunction(method):
            continue

        def guarded(method: Callable[..., Awaitable[object]] = method, name: str = name) -> Callable[..., object]:
            @functools.wraps(method)
            async def call(*args: object, **kwargs: object) -> object:
                store: Any = args[0]
                began = time.monotonic()
                try:
                    found = await method(*args, **kwargs)
                except (RedisError, OSError) as exc:
                    log.warning("state store call %s failed: %r", name, exc)
                    store.unavailable_at = time.monotonic()
                    raise StoreUnavailable() from exc
                if time.monotonic() - began > store.timeout / 2:  # it answered, late: it was away meanwhile
                    store.unavailable_at = time.monotonic()
                return found

            return call

        setattr(cls, name, guarded())
    return cls


@_bounded
class RedisStore:
    """The shared store at ``url`` (``redis://host:6379/0``), keys under ``prefix``; reconnects by itself; every
    call bounded by ``timeout`` seconds (``StoreUnavailable`` past it)."""

    def __init__(self, url: str, prefix: str = "meshgate:", *, timeout: float = STORE_TIMEOUT) -> None:
        self.prefix = prefix
        self.timeout = timeout
        self.unavailable_at = -math.inf
        self._r = connect_redis(url, timeout)
        self._channel = prefix + "changes"
        self._drop_nodes = self._r.register_script(_DROP_NODES)
        self._update_runner = self._r.register_script(_UPDATE_RUNNER)
        self._put_new_instance = self._r.register_script(_PUT_NEW_INSTANCE)
        self._set_state = self._r.register_script(_SET_STATE)
        self._update_instance = self._r.register_script(_UPDATE_INSTANCE)
        self._secret_script = self._r.register_script(_SECRET)
        self._release = self._r.register_script(_RELEASE)
        self._ages = LoadAges()
        self._watchers = Watchers()
        self._listener: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    async def _write(self, kind: str, *ops: Callable[[aioredis.client.Pipeline], object]) -> list[object]:
        """Run ``ops`` in one MULTI/EXEC with the generation bump and the wake-up."""
        async with self._r.pipeline(transaction=True) as pipe:
            for op in ops:
                op(pipe)
            pipe.incr(self._key("generation"))
            pipe.publish(self._channel, kind)
            return await pipe.execute()

    async def _gc_nodes(self, node_ids: list[str], *, force: bool = False) -> int:
        keys = [self._key("nodes"), self._key("links"), self._key("generation")]
        keys += [self._key("node", node_id) for node_id in node_ids]
        return int(await self._drop_nodes(keys=keys, args=[self._channel, "1" if force else "0", *node_ids]))

    async def _live(self) -> dict[str, bytes]:
        ids = sorted(i.decode() for i in await self._r.smembers(self._key("nodes")))
        values = await self._r.mget([self._key("node", i) for i in ids]) if ids else []
        gone = [i for i, value in zip(ids, values, strict=True) if value is None]
        if gone:
            await self._gc_nodes(gone)
        return {i: value for i, value in zip(ids, values, strict=True) if value is not None}

    async def put_node(self, node: Node, ttl: float) -> None:
        await self._write(
            "nodes",
            lambda p: p.set(self._key("node", node.id), encode(node), px=max(1, round(ttl * 1000))),
            lambda p: p.sadd(self._key("nodes"), node.id),
        )

    async def nodes(self) -> list[Node]:
        return [node_json.decode(value) for value in (await self._live()).values()]

    async def remove_node(self, node_id: NodeId) -> bool:
        return await self._gc_nodes([node_id], force=True) > 0

    async def put_link(self, link: Link) -> None:
        await self._write("links", lambda p: p.hset(self._key("links"), encode((link.src, link.dst)), encode(link)))

    async def links(self) -> list[Link]:
        live = await self._live()
        stored = await self._r.hgetall(self._key("links"))
        ends = sorted((ends_json.decode(field), value) for field, value in stored.items())
        return [link_json.decode(value) for (src, dst), value in ends if src in live and dst in live]

    async def put_instance(self, inst: Instance, *, if_absent: bool = False) -> bool:
        key = self._key("instance", inst.id)
        fields = {
            "record": encode(msgspec.structs.replace(inst, runners={})),
            "state": encode(inst.state),
            "updated_at": repr(inst.updated_at).encode(),
            **{f"runner:{node_id}": encode(status) for node_id, status in inst.runners.items()},
        }
        if if_absent:
            keys = [key, self._key("instances"), self._key("generation")]
            pairs = [part for field, value in fields.items() for part in (field, value)]
            return bool(await self._put_new_instance(keys=keys, args=[self._channel, inst.id, *pairs]))
        await self._write(
            "instances",
            lambda p: p.delete(key),
            lambda p: p.hset(key, mapping=fields),
            lambda p: p.sadd(self._key("instances"), inst.id),
        )
        return True

    @staticmethod
    def _decode_instance(fields: dict[bytes, bytes]) -> Instance | None:
        if b"record" not in fields:
            return None
        runners = {k[7:].decode(): runner_json.decode(v) for k, v in fields.items() if k.startswith(b"runner:")}
        return msgspec.structs.replace(
            instance_json.decode(fields[b"record"]),
            state=state_json.decode(fields[b"state"]),
            updated_at=float(fields[b"updated_at"]),
            runners=runners,
        )

    async def get_instance(self, instance_id: InstanceId) -> Instance | None:
        return self._decode_instance(await self._r.hgetall(self._key("instance", instance_id)))

    async def instances(self) -> list[Instance]:
        ids = [i.decode() for i in await self._r.smembers(self._key("instances"))]
        async with self._r.pipeline(transaction=False) as pipe:
            for instance_id in ids:
                pipe.hgetall(self._key("instance", instance_id))
            found = [self._decode_instance(fields) for fields in await pipe.execute()]
        return sorted((i for i in found if i is not None), key=lambda i: (i.created_at, i.id))

    async def delete_instance(self, instance_id: InstanceId) -> bool:
        deleted, *_ = await self._write(
            "instances",
            lambda p: p.delete(self._key("instance", instance_id)),
            lambda p: p.srem(self._key("instances"), instance_id),
        )
        return bool(deleted)

    async def update_runner(self, instance_id: InstanceId, status: RunnerStatus) -> bool:
        keys = [self._key("instance", instance_id), self._key("generation")]
        args = [self._channel, f"runner:{status.node_id}", encode(status)]
        return bool(await self._update_runner(keys=keys, args=args))

    async def set_state(
        self, instance_id: InstanceId, state: InstanceState, *, expected: type | None = None, epoch: int | None = None
    ) -> bool:
        keys = [self._key("instance", instance_id), self._key("generation")]
        tag = "" if expected is None else state_tag(expected)
        args = [self._channel, tag, encode(state), repr(time.time()), "" if epoch is None else str(epoch)]
        return bool(await self._set_state(keys=keys, args=args))

    async def update_instance(self, inst: Instance, *, expected: type, epoch: int, runners: bool = False) -> bool:
        keys = [self._key("instance", inst.id), self._key("generation")]
        args: list[str | bytes] = [
            self._channel,
            state_tag(expected),
            str(epoch),
            encode(msgspec.structs.replace(inst, runners={})),
            encode(inst.state),
            repr(inst.updated_at),
            "1" if runners else "0",
        ]
        if runners:
            for node_id, status in inst.runners.items():
                args += [f"runner:{node_id}", encode(status)]
        return bool(await self._update_instance(keys=keys, args=args))

    async def append_event(
        self,
        kind: str,
        message: str,
        *,
        instance_id: str | None = None,
        node_id: str | None = None,
        data: dict[str, str] | None = None,
    ) -> StoreEvent:
        event = StoreEvent("", time.time(), kind, instance_id, node_id, message, data)
        event_id = await self._r.xadd(self._key("events"), {"e": encode(event)}, maxlen=MAX_EVENTS, approximate=True)
        return msgspec.structs.replace(event, id=event_id.decode())

    async def events(self, since: str | None = None, count: int = 100) -> list[StoreEvent]:
        entries = await self._r.xrange(self._key("events"), "-" if since is None else f"({since}", "+", count=count)
        return [
            msgspec.structs.replace(event_json.decode(fields[b"e"]), id=entry_id.decode())
            for entry_id, fields in entries or []
        ]

    async def generation(self) -> int:
        return int(await self._r.get(self._key("generation")) or 0)

    async def incarnation(self) -> str:
        key = self._key("incarnation")
        found = await self._r.get(key)
        if found is None:  # an empty store (new, or restarted without its data): the first reader names it
            await self._r.set(key, uuid.uuid4().hex, nx=True)
            found = await self._r.get(key)
        return found.decode() if found is not None else ""

    async def cluster_secret(self, proposed: str, *, held: bool = False) -> str:
        keys = [self._key("cluster_secret"), self._key("cluster_secret_provisional")]
        return (await self._secret_script(keys=keys, args=[proposed, "1" if held else "0"])).decode()

    async def put_deployment(self, deployment: Deployment, *, if_absent: bool = False) -> bool:
        key, value = self._key("deployments"), encode(deployment)
        if if_absent:
            written, *_ = await self._write("instances", lambda p: p.hsetnx(key, deployment.model, value))
            return bool(written)
        await self._write("instances", lambda p: p.hset(key, deployment.model, value))
        return True

    async def deployments(self) -> list[Deployment]:
        stored = await self._r.hgetall(self._key("deployments"))
        return [deployment_json.decode(v) for _, v in sorted(stored.items())]

    async def delete_deployment(self, model: str) -> bool:
        deleted, *_ = await self._write("instances", lambda p: p.hdel(self._key("deployments"), model))
        return bool(deleted)

    async def put_loads(self, gateway_id: str, reports: dict[str, LoadReport], gone: Iterable[str] = ()) -> None:
        key = self._key("loads")
        async with self._r.pipeline(transaction=False) as pipe:
            if reports:
                pipe.hset(key, mapping={f"{i} {gateway_id}": encode(r) for i, r in reports.items()})
            fields = [f"{i} {gateway_id}" for i in gone]
            if fields:
                pipe.hdel(key, *fields)
            await pipe.execute()

    async def loads(self) -> dict[str, list[LoadReport]]:
        stored = await self._r.hgetall(self._key("loads"))
        found, forget = self._ages.fresh((k.decode(), v) for k, v in stored.items())
        if forget:
            await self._r.hdel(self._key("loads"), *forget)
        return found

    async def claim(self, name: str, holder: str, ttl: float) -> bool:
        key = self._key("claim", name)
        px = max(1, round(ttl * 1000))
        if await self._r.set(key, holder, nx=True, px=px):
            return True
        if (await self._r.get(key) or b"").decode() != holder:
            return False
        await self._r.pexpire(key, px)  # its holder renews it
        return True

    async def release(self, name: str, holder: str) -> bool:
        return bool(await self._release(keys=[self._key("claim", name)], args=[holder]))

    def watch(self) -> AsyncIterator[str]:
        return self._watchers.stream(self._ready)

    def _ready(self) -> Awaitable[object]:
        if self._listener is None:
            self._listener = asyncio.create_task(self._listen(), name="meshgate-store-changes")
        return self._subscribed.wait()  # the listener retries until subscribed; close() sets it too

    async def _listen(self) -> None:
        """Fan the changes channel out to the watchers; on every (re)subscription wake them for every kind."""
        delay = 0.05
        while not self._watchers.closed:
            pubsub = self._r.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                while True:
                    message = await pubsub.get_message(timeout=None) or {}
                    if message.get("type") == "subscribe":
                        self._watchers.notify(*KINDS)
                        self._subscribed.set()
                        delay = 0.05
                    elif message.get("type") == "message":
                        self._watchers.notify(message["data"].decode())
            except Exception as exc:  # a lost connection, or a bad message: the wake-ups must go on
                log.warning(
                    "store change feed lost (%r); resubscribing in %.2fs",
                    exc,
                    delay,
                    exc_info=not isinstance(exc, RedisError | OSError),
                )
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def close(self) -> None:
        self._watchers.close()
        self._subscribed.set()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
        await self._r.aclose()
