"""``RedisBatchStore``: the ``batch_store.BatchStore`` of several gateways, in the cluster's Redis.

Every step that reads and writes a line's state is one Lua script (atomic on the server), and leases are timed by
Redis's own clock (``TIME``), so no two gateways ever both hold a line or both write its result. Keys, under the
store's prefix (listed with every other key in ``redis_store``)::

    file:{id}             hash    record -> FileRecord JSON; content -> the file's bytes
    files                 zset    file ids, scored by creation time
    batch:{id}            hash    record -> Job JSON; epoch -> int (``update_job`` compares and bumps it)
    batches               zset    job ids, scored by creation time
    batches:active        set     ids of jobs whose status is in ``ACTIVE`` (what the workers poll)
    batch:{id}:lines      hash    line index -> the line's JSON ({"custom_id", ...body})
    batch:{id}:pending    list    indexes not yet claimed, next first
    batch:{id}:claims     hash    index -> "{holder}|{deadline ms, Redis clock}"
    batch:{id}:results    hash    index -> LineResult JSON
    batch:{id}:counts     hash    outcome -> lines done with it

Imports msgspec, redis and the cluster's store modules; nothing imports this but the gateway.
"""

from __future__ import annotations

import math

import msgspec

from meshgate.gateway.cluster.batch_store import (
    ACTIVE,
    FileRecord,
    Job,
    LineResult,
    Outcome,
    Progress,
    encode,
    file_json,
    job_json,
    result_json,
)
from meshgate.gateway.cluster.redis_store import STORE_TIMEOUT, _bounded, connect_redis

__all__ = ["RedisBatchStore"]

_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)"

# KEYS: pending, claims, lines  ARGV: holder, lease ms
_CLAIM = (
    _NOW
    + """
local index = redis.call('LPOP', KEYS[1])
if not index then return false end
redis.call('HSET', KEYS[2], index, ARGV[1] .. '|' .. (now + tonumber(ARGV[2])))
return {index, redis.call('HGET', KEYS[3], index)}
"""
)

# KEYS: claims  ARGV: index, holder, lease ms
_RENEW = (
    _NOW
    + """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held or string.sub(held, 1, #ARGV[2] + 1) ~= ARGV[2] .. '|' then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. '|' .. (now + tonumber(ARGV[3])))
return 1
"""
)

# KEYS: claims, results, pending  ARGV: index, holder
_RELEASE = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held or string.sub(held, 1, #ARGV[2] + 1) ~= ARGV[2] .. '|' then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
redis.call('LPUSH', KEYS[3], ARGV[1])
return 1
"""

# KEYS: claims, results, counts  ARGV: index, holder, result JSON, outcome
_FINISH = """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return 0 end
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held or string.sub(held, 1, #ARGV[2] + 1) ~= ARGV[2] .. '|' then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('HINCRBY', KEYS[3], ARGV[4], 1)
return 1
"""

# KEYS: claims, results, pending
_REQUEUE = (
    _NOW
    + """
local moved = 0
local claims = redis.call('HGETALL', KEYS[1])
for i = 1, #claims, 2 do
  local deadline = tonumber(string.match(claims[i + 1], '|(%d+)$'))
  if deadline <= now then
    redis.call('HDEL', KEYS[1], claims[i])
    if redis.call('HEXISTS', KEYS[2], claims[i]) == 0 then
      redis.call('LPUSH', KEYS[3], claims[i])
      moved = moved + 1
    end
  end
end
return moved
"""
)

# KEYS: pending, results, counts, lines  ARGV: outcome
_DRAIN = """
local drained = 0
local index = redis.call('LPOP', KEYS[1])
while index do
  if redis.call('HEXISTS', KEYS[2], index) == 0 then
    local line = cjson.decode(redis.call('HGET', KEYS[4], index))
    local custom_id = line['custom_id']
    if type(custom_id) ~= 'string' then custom_id = '' end
    local result = cjson.encode({index = tonumber(index), custom_id = custom_id, outcome = ARGV[1]})
    redis.call('HSET', KEYS[2], index, result)
    redis.call('HINCRBY', KEYS[3], ARGV[1], 1)
    drained = drained + 1
  end
  index = redis.call('LPOP', KEYS[1])
end
return drained
"""

# KEYS: batch:{id}, active set  ARGV: expected epoch, record JSON, id, active ("1"/"0")
_UPDATE_JOB = """
local epoch = redis.call('HGET', KEYS[1], 'epoch')
if not epoch or epoch ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'record', ARGV[2], 'epoch', tonumber(epoch) + 1)
if ARGV[4] == '1' then redis.call('SADD', KEYS[2], ARGV[3]) else redis.call('SREM', KEYS[2], ARGV[3]) end
return 1
"""


@_bounded
class RedisBatchStore:
    """Batches in the Redis at ``url``, keys under ``prefix``; every call bounded by ``timeout`` seconds."""

    def __init__(self, url: str, prefix: str = "meshgate:", *, timeout: float = STORE_TIMEOUT) -> None:
        self.prefix = prefix
        self.timeout = timeout
        self.unavailable_at = -math.inf
        self._r = connect_redis(url, timeout)
        self._claim = self._r.register_script(_CLAIM)
        self._renew = self._r.register_script(_RENEW)
        self._release = self._r.register_script(_RELEASE)
        self._finish = self._r.register_script(_FINISH)
        self._requeue = self._r.register_script(_REQUEUE)
        self._drain = self._r.register_script(_DRAIN)
        self._update = self._r.register_script(_UPDATE_JOB)

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def _line_keys(self, job_id: str, *names: str) -> list[str]:
        return [self._key("batch", job_id, name) for name in names]

    async def put_file(self, record: FileRecord, content: bytes) -> None:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(self._key("file", record.id), mapping={"record": encode(record), "content": content})
            pipe.zadd(self._key("files"), {record.id: record.created_at})
            await pipe.execute()

    async def get_file(self, file_id: str) -> FileRecord | None:
        raw = await self._r.hget(self._key("file", file_id), "record")
        return file_json.decode(raw) if raw else None

    async def file_content(self, file_id: str) -> bytes | None:
        return await self._r.hget(self._key("file", file_id), "content")

    async def files(self) -> list[FileRecord]:
        ids = await self._r.zrange(self._key("files"), 0, -1)
        if not ids:
            return []
        async with self._r.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hget(self._key("file", file_id.decode()), "record")
            found = await pipe.execute()
        return sorted((file_json.decode(r) for r in found if r), key=lambda f: (f.created_at, f.id))

    async def delete_file(self, file_id: str) -> bool:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.delete(self._key("file", file_id))
            pipe.zrem(self._key("files"), file_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)

    async def create_job(self, job: Job, lines: list[bytes], done: list[LineResult]) -> None:
        finished = {r.index for r in done}
        lines_key, pending, results, counts = self._line_keys(job.id, "lines", "pending", "results", "counts")
        tally: dict[str, int] = {}
        for r in done:
            tally[r.outcome] = tally.get(r.outcome, 0) + 1
        async with self._r.pipeline(transaction=True) as pipe:
            if lines:
                pipe.hset(lines_key, mapping=dict(enumerate(lines)))
            waiting = [i for i in range(len(lines)) if i not in finished]
            if waiting:
                pipe.rpush(pending, *waiting)
            if done:
                pipe.hset(results, mapping={r.index: encode(r) for r in done})
                pipe.hset(counts, mapping=tally)
            pipe.hset(self._key("batch", job.id), mapping={"record": encode(job), "epoch": job.epoch})
            pipe.zadd(self._key("batches"), {job.id: job.created_at})
            if job.status in ACTIVE:
                pipe.sadd(self._key("batches", "active"), job.id)
            await pipe.execute()

    async def get_job(self, job_id: str) -> Job | None:
        record, epoch = await self._r.hmget(self._key("batch", job_id), ["record", "epoch"])
        return msgspec.structs.replace(job_json.decode(record), epoch=int(epoch)) if record else None

    async def jobs(self) -> list[Job]:
        ids = await self._r.zrange(self._key("batches"), 0, -1)
        found = [await self.get_job(i.decode()) for i in ids]
        return sorted((j for j in found if j is not None), key=lambda j: (j.created_at, j.id))

    async def active(self) -> list[str]:
        return sorted(i.decode() for i in await self._r.smembers(self._key("batches", "active")))

    async def update_job(self, job: Job) -> bool:
        record = encode(msgspec.structs.replace(job, epoch=job.epoch + 1))
        active = "1" if job.status in ACTIVE else "0"
        keys = [self._key("batch", job.id), self._key("batches", "active")]
        return bool(await self._update(keys=keys, args=[str(job.epoch), record, job.id, active]))

    async def delete_job(self, job_id: str) -> bool:
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.delete(self._key("batch", job_id))
            pipe.delete(*self._line_keys(job_id, "lines", "pending", "claims", "results", "counts"))
            pipe.zrem(self._key("batches"), job_id)
            pipe.srem(self._key("batches", "active"), job_id)
            deleted, *_ = await pipe.execute()
        return bool(deleted)

    async def claim(self, job_id: str, holder: str, lease: float) -> tuple[int, bytes] | None:
        keys = self._line_keys(job_id, "pending", "claims", "lines")
        found = await self._claim(keys=keys, args=[holder, max(1, round(lease * 1000))])
        return (int(found[0]), found[1]) if found else None

    async def renew(self, job_id: str, index: int, holder: str, lease: float) -> bool:
        keys = self._line_keys(job_id, "claims")
        return bool(await self._renew(keys=keys, args=[index, holder, max(1, round(lease * 1000))]))

    async def release(self, job_id: str, index: int, holder: str) -> bool:
        keys = self._line_keys(job_id, "claims", "results", "pending")
        return bool(await self._release(keys=keys, args=[index, holder]))

    async def finish(self, job_id: str, result: LineResult, holder: str) -> bool:
        keys = self._line_keys(job_id, "claims", "results", "counts")
        return bool(await self._finish(keys=keys, args=[result.index, holder, encode(result), result.outcome]))

    async def requeue_expired(self, job_id: str) -> int:
        return int(await self._requeue(keys=self._line_keys(job_id, "claims", "results", "pending")))

    async def drain(self, job_id: str, outcome: Outcome) -> int:
        keys = self._line_keys(job_id, "pending", "results", "counts", "lines")
        return int(await self._drain(keys=keys, args=[outcome]))

    async def progress(self, job_id: str) -> Progress:
        pending, claims, counts = self._line_keys(job_id, "pending", "claims", "counts")
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.llen(pending).hlen(claims).hgetall(counts)
            waiting, claimed, done = await pipe.execute()
        return Progress(pending=waiting, claimed=claimed, done={k.decode(): int(v) for k, v in done.items()})

    async def results(self, job_id: str) -> list[LineResult]:
        found = await self._r.hvals(self._line_keys(job_id, "results")[0])
        return sorted((result_json.decode(r) for r in found), key=lambda r: r.index)

    async def close(self) -> None:
        await self._r.aclose()
