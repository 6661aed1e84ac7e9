"""API key records and the sliding-window counters behind rate limits, in memory or in Redis.

Keys are stored hashed (``ApiKey.digest``: SHA-256 of the key, which is random and long, so a fast hash is
enough); the key itself is shown once, when it is made. Without Redis the records live in
``<data_dir>/keys.json`` (mode 0600) so they survive a restart; with Redis every gateway shares them.

**Sealed.** The first key made seals the accounts: from then on auth stays on (``sealed()``), whether or not any key
is left. Revoking the last key, a FLUSHDB, Redis restarting without persistence or a failover to an empty replica
never opens the gateway: with Redis the seal is kept twice, in Redis (``auth``) and in a file of the gateway's
own (``<data_dir>/sealed/<store>``, see ``open_accounts``), and a gateway that finds it in one puts it back in the
other. Only an operator removing both (and ``keys.json``'s ``sealed`` without Redis) opens it again. A gateway
that never saw the seal (a key made on another gateway just before Redis restarted empty) cannot tell an empty
store's "no key ever" from a lost one: when the store's incarnation (``cluster.store``'s ``incarnation`` key) is
not the one it saw before, it answers 503 (retry) for ``SEAL_SETTLE`` seconds (``Emptied``): every gateway that
knew the seal puts it back within ``guard.SEAL_EVERY`` (``KeyRing.keep_seal``). A store still unsealed after that
never had a key (an open cluster): it stays open.

Limits count with a sliding window over two fixed windows (the previous window's count weighted by how much of
it still overlaps the last ``window`` seconds, plus the current one): 3 requests at :59 and 3 at :00 are 6 in
the last minute, not 3 and 3. Each counted name holds two small counters that expire; the memory version also
caps how many names it keeps, so random callers cannot grow it without bound.

    Redis keys (under the store's prefix; listed with every other key in ``store``):
    keys                 hash    key id -> ApiKey JSON
    auth                 string  "sealed" once any key has been made; never removed by meshgate
    incarnation          string  read only: the cluster store's (``RedisStore.incarnation``)
    window:{name}:{slot} string  a counter, expiring after two windows
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, Protocol

import msgspec
from redis.exceptions import RedisError

from meshgate.gateway.cluster.redis_store import STORE_TIMEOUT, connect_redis
from meshgate.protocols.model import Priority, StoreUnavailable

__all__ = ["ApiKey", "Accounts", "MemoryAccounts", "RedisAccounts", "Scope", "open_accounts", "retry_after"]

log = logging.getLogger("meshgate.auth")

Scope = Literal["inference", "admin"]


class ApiKey(msgspec.Struct, frozen=True, kw_only=True):
    """A stored key: never the key itself, only its digest."""

    id: str
    name: str
    scope: Scope = "inference"
    models: tuple[str, ...] = ()  # the models it may use; empty: all
    rpm: int = 0  # requests per minute; 0: the gateway's MESHGATE_RATE_LIMIT
    tpm: int = 0  # prompt + generated tokens per minute; 0: no limit
    created: float = 0.0
    digest: str = ""
    tenant: str = ""  # whose cached prompts its requests share (``""``: its own, no other key's)
    priority: Priority | None = None  # its requests' class when they send no service_tier (None: the setting's)
    weight: float = 1.0  # its share of the slots within its class, against other keys (``serving.admission``)


class Accounts(Protocol):
    async def put_key(self, key: ApiKey) -> None: ...
    async def get_key(self, key_id: str) -> ApiKey | None: ...
    async def keys(self) -> list[ApiKey]: ...
    async def delete_key(self, key_id: str) -> bool: ...
    async def sealed(self) -> bool:
        """Whether any key has ever been made here (then auth is on for good; see the module docstring)."""
        ...

    async def window(self, name: str, amount: int, limit: int, window: float = 60.0) -> tuple[bool, float]:
        """Count ``amount`` on ``name`` unless that takes the last ``window`` seconds past ``limit`` (0: no
        limit, always counted). Returns (counted, the count in the window before this amount)."""
        ...

    async def close(self) -> None: ...


def open_accounts(
    redis: str | None, data_dir: str, prefix: str = "meshgate:", *, timeout: float = STORE_TIMEOUT
) -> Accounts:
    """The key store of a gateway with these settings: Redis when it has one (its seal remembered in
    ``<data_dir>/sealed/``, one file per Redis and prefix), else ``<data_dir>/keys.json``."""
    if not redis:
        return MemoryAccounts(Path(data_dir) / "keys.json")
    where = hashlib.sha256(f"{redis} {prefix}".encode()).hexdigest()[:16]
    return RedisAccounts(redis, prefix, seal=Path(data_dir) / "sealed" / where, timeout=timeout)


def _write_private(path: Path, data: bytes) -> None:
    """``data`` to ``path`` (mode 0600), atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _slot(window: float, now: float) -> tuple[int, float]:
    """The current fixed window's number and how much of the previous one still overlaps (0..1]."""
    slot = math.floor(now / window)
    return slot, 1.0 - (now - slot * window) / window


def retry_after(count: float, amount: int, limit: int, window: float = 60.0) -> float:
    """Seconds until ``amount`` more fits under ``limit``, roughly (the previous window's share fades linearly)."""
    over = count + amount - limit
    return max(1.0, min(window, math.ceil(window * over / max(limit, 1))))


class MemoryAccounts:
    """One process's keys (persisted to ``path`` when given: ``{"sealed": bool, "keys": [...]}``; a plain list
    of keys, the format before the seal, reads as sealed when it holds any) and counters (at most ``max_names``
    names)."""

    def __init__(self, path: Path | None = None, max_names: int = 100_000) -> None:
        self.path = path
        self.max_names = max_names
        self._keys: dict[str, ApiKey] = {}
        self._sealed = False
        self._windows: OrderedDict[str, tuple[int, int, int]] = OrderedDict()  # name -> (slot, previous, current)
        if path is not None and path.exists():
            saved = json.loads(path.read_text() or "[]")
            items = saved if isinstance(saved, list) else saved.get("keys", [])
            for item in items:
                key = msgspec.convert(item, ApiKey)
                self._keys[key.id] = key
            self._sealed = bool(self._keys) or (isinstance(saved, dict) and saved.get("sealed") is True)

    def _save(self) -> None:
        if self.path is not None:
            saved = {"sealed": self._sealed, "keys": list(self._keys.values())}
            _write_private(self.path, msgspec.json.encode(saved))

    async def put_key(self, key: ApiKey) -> None:
        self._keys[key.id] = key
        self._sealed = True
        self._save()

    async def sealed(self) -> bool:
        return self._sealed

    async def get_key(self, key_id: str) -> ApiKey | None:
        return self._keys.get(key_id)

    async def keys(self) -> list[ApiKey]:
        return sorted(self._keys.values(), key=lambda k: k.created)

    async def delete_key(self, key_id: str) -> bool:
        gone = self._keys.pop(key_id, None) is not None
        if gone:
            self._save()
        return gone

    async def window(self, name: str, amount: int, limit: int, window: float = 60.0) -> tuple[bool, float]:
        slot, share = _slot(window, time.time())
        old_slot, previous, current = self._windows.pop(name, (slot, 0, 0))
        if old_slot != slot:  # moved on: the current window became the previous one (or both are stale)
            previous, current = (current if old_slot == slot - 1 else 0), 0
        count = previous * share + current
        counted = not limit or count + amount <= limit
        self._windows[name] = (slot, previous, current + amount if counted else current)  # most recent last
        while len(self._windows) > self.max_names:  # the least recently counted names go first
            self._windows.popitem(last=False)
        return counted, count

    async def close(self) -> None:
        return None


# KEYS: current window, previous window. ARGV: share of the previous, amount, limit, expiry (ms).
_WINDOW = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
local count = tonumber(redis.call('GET', KEYS[2]) or '0') * tonumber(ARGV[1]) + current
local amount, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
if limit > 0 and count + amount > limit then return {0, tostring(count)} end
if amount > 0 then
  redis.call('INCRBY', KEYS[1], amount)
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return {1, tostring(count)}
"""


@contextlib.contextmanager
def _reachable() -> Iterator[None]:
    """Redis down past the client's retries: a 503 the client may retry, not an internal error."""
    try:
        yield
    except (RedisError, OSError) as exc:  # its text names the Redis address: the log has it, the client does not
        log.warning("key store unreachable: %r", exc)
        raise StoreUnavailable("the key and limit store is unreachable; retry shortly") from exc


SEAL_SETTLE = 5.0
"""Seconds a gateway that holds no seal answers 503 after finding the store restarted empty."""


class Emptied:
    """What a gateway that holds no seal makes of a store that is not the one it saw (``incarnation``, a token the
    cluster store keeps; a store restarted empty has another): it cannot tell "no key ever" from a lost seal, so
    for ``SEAL_SETTLE`` seconds ``check`` raises ``StoreUnavailable`` (a 503, retried), while the gateways that
    knew the seal put it back; a store still unsealed then never had a key, and is taken as it is."""

    def __init__(self) -> None:
        self.known: object = None
        self.since: float | None = None

    def check(self, incarnation: object, sealed: bool) -> None:
        if sealed or self.known is None or incarnation == self.known:
            self.known, self.since = incarnation or self.known, None
            return
        now = time.monotonic()
        if self.since is None:
            self.since = now
            log.warning(
                "the state store restarted empty: auth waits %gs for a gateway to restore its seal", SEAL_SETTLE
            )
        if now - self.since < SEAL_SETTLE:
            raise StoreUnavailable("the key store restarted empty; retry shortly")
        log.warning("the state store restarted empty and no gateway restored a seal: no key was ever made; auth off")
        self.known, self.since = incarnation, None


class RedisAccounts:
    """Keys and counters in Redis at ``url``, shared by every gateway; ``seal``: this gateway's own copy of the
    seal (a file), kept where Redis cannot lose it."""

    def __init__(
        self, url: str, prefix: str = "meshgate:", *, seal: Path | None = None, timeout: float = STORE_TIMEOUT
    ) -> None:
        self.prefix = prefix
        self.seal = seal
        self._r = connect_redis(url, timeout)
        self._window = self._r.register_script(_WINDOW)
        self._emptied = Emptied()

    async def put_key(self, key: ApiKey) -> None:
        self._remember_seal()
        with _reachable():
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.hset(self.prefix + "keys", key.id, msgspec.json.encode(key))
                pipe.set(self.prefix + "auth", "sealed")
                await pipe.execute()

    async def sealed(self) -> bool:
        """Sealed in Redis (or keys stored there from before the seal) or in this gateway's file; whichever lost
        it gets it back. Sealed too when the store is not the one this gateway first saw (it restarted empty)."""
        remembered = self.seal is not None and self.seal.exists()
        with _reachable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.exists(self.prefix + "auth").hlen(self.prefix + "keys").get(self.prefix + "incarnation")
                in_store, stored_keys, incarnation = await pipe.execute()
            if remembered and not in_store:
                log.warning("the key store lost its seal (emptied or restarted empty): auth stays on; sealing it again")
                await self._r.set(self.prefix + "auth", "sealed")
            elif stored_keys and not in_store:
                await self._r.set(self.prefix + "auth", "sealed")
        sealed = remembered or bool(in_store) or bool(stored_keys)
        if sealed and not remembered:
            self._remember_seal()
        self._emptied.check(incarnation, sealed)
        return sealed

    def _remember_seal(self) -> None:
        if self.seal is not None and not self.seal.exists():
            _write_private(self.seal, b"sealed\n")

    async def get_key(self, key_id: str) -> ApiKey | None:
        with _reachable():
            raw = await self._r.hget(self.prefix + "keys", key_id)
        return msgspec.json.decode(raw, type=ApiKey) if raw else None

    async def keys(self) -> list[ApiKey]:
        with _reachable():
            raw = await self._r.hvals(self.prefix + "keys")
        return sorted((msgspec.json.decode(r, type=ApiKey) for r in raw), key=lambda k: k.created)

    async def delete_key(self, key_id: str) -> bool:
        with _reachable():
            return bool(await self._r.hdel(self.prefix + "keys", key_id))

    async def window(self, name: str, amount: int, limit: int, window: float = 60.0) -> tuple[bool, float]:
        slot, share = _slot(window, time.time())
        base = f"{self.prefix}window:{name}:"
        with _reachable():
            counted, count = await self._window(
                keys=[f"{base}{slot}", f"{base}{slot - 1}"], args=[repr(share), amount, limit, int(window * 2000)]
            )
        return bool(counted), float(count)

    async def close(self) -> None:
        await self._r.aclose()
