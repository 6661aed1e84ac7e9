"""Who is calling, what they may do, and how much: API keys with scopes, and rate limits, as one Litestar guard.

Every route handler says what it needs in its ``opt`` (router or handler): ``scope`` is ``"public"`` (the
Ollama probes: ``/``, ``/api/version``), ``"inference"`` (generation, model listings) or ``"admin"`` (the
cluster API, model create/copy/delete/pull, keys); a handler that says nothing needs ``admin``, so a new route
cannot be left open by forgetting. ``limited`` marks the generation endpoints the rate limits count.

Keys: the bootstrap keys from the environment (``MESHGATE_API_KEYS``, admin) and keys made with
``meshgate keys create`` / ``POST /keys`` (stored hashed, ``gateway.auth.keys``), presented as
``Authorization: Bearer <key>`` or ``x-api-key``. Auth is on as soon as any key exists, and stays on for good
once one has (the accounts are sealed, ``gateway.auth.keys``): a store that loses its keys (restarted empty,
flushed, failed over, the last key revoked) leaves every route but the public ones closed until a bootstrap key
is presented; it never opens them. Before any key, every route is open (the gateway binds to loopback unless
told otherwise, see ``gateway.cli.commands``). Every presented
credential is tried (constant-time comparisons); the first valid one names the caller, so a valid key beside a
made-up ``Authorization`` header still counts against its own key.

Limits: per key, ``rpm`` requests per minute (else ``MESHGATE_RATE_LIMIT``) and ``tpm`` tokens per minute;
callers without a valid key are counted by client address only (whatever they send), with
``MESHGATE_RATE_LIMIT``. Windows slide (``gateway.auth.keys``) and live in the state store's Redis when
there is one, so every gateway shares them.

While Redis is away (``StoreUnavailable``): a key this gateway checked against the store within ``KEY_GRACE``
seconds is still taken as it was (a key revoked meanwhile works that long here; revoking is immediate whenever
the store answers), any other key gets the 503; the rate-limit windows count in this gateway's memory instead, so
limits hold per gateway, and the usage spent then counts there too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from meshgate.gateway.auth.keys import Accounts, ApiKey, MemoryAccounts, Scope, retry_after
from meshgate.protocols.model import (
    AuthenticationFailed,
    PermissionDenied,
    Priority,
    RateLimited,
    StoreUnavailable,
    Usage,
)

__all__ = ["Caller", "KeyRing", "authorize", "caller_of"]

KEY_PREFIX = "mg"
KEY_GRACE = 60.0
"""Seconds a key checked against the store is still taken as it was while the store does not answer."""
SEAL_EVERY = 2.0
"""Seconds between a gateway's background checks of the seal (``KeyRing.keep_seal``)."""


@dataclass(frozen=True)
class Caller:
    """A request's caller: ``bucket`` names its line in the queue and its rate-limit windows."""

    bucket: str  # "key:<id>", "boot:<n>" or "addr:<client address>"
    scope: Scope | None = None  # None: no valid key
    models: frozenset[str] = frozenset()  # the models it may use; empty: all
    rpm: int = 0
    tpm: int = 0
    tenant: str = ""  # the prompt-cache scope of its requests: keys of one tenant share cached prompts
    priority: Priority | None = None  # its key's class for requests that send no service_tier (None: the setting's)
    weight: float = 1.0  # its key's share of the slots within a class

    def may_use(self, model: str) -> bool:
        """A model outside the key's list is answered as unknown (as OpenAI does), never as forbidden."""
        return not self.models or model in self.models


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def mint(
    name: str,
    scope: Scope = "inference",
    models: tuple[str, ...] = (),
    rpm: int = 0,
    tpm: int = 0,
    tenant: str = "",
    priority: Priority | None = None,
    weight: float = 1.0,
) -> tuple[str, ApiKey]:
    """A new key (``mg_<id>_<secret>``, shown once) and the record to store (its digest, not the key)."""
    key_id = secrets.token_hex(6)
    key = f"{KEY_PREFIX}_{key_id}_{secrets.token_urlsafe(24)}"
    return key, ApiKey(
        id=key_id,
        name=name,
        scope=scope,
        models=models,
        rpm=rpm,
        tpm=tpm,
        created=time.time(),
        digest=digest(key),
        tenant=tenant,
        priority=priority,
        weight=weight,
    )


class KeyRing:
    """Resolves presented credentials against the bootstrap keys and the stored ones; applies the limits."""

    def __init__(self, accounts: Accounts, bootstrap: tuple[str, ...] = (), rate_limit: int = 0) -> None:
        self.accounts = accounts
        self._bootstrap = [digest(k) for k in bootstrap]
        self.rate_limit = rate_limit
        self._sealed = False  # seen sealed once: on for the life of this process, whatever the store says later
        self._checked: dict[str, tuple[ApiKey, float]] = {}  # key id -> (record, monotonic time the store gave it)
        self._local = MemoryAccounts(max_names=10_000)  # the windows while the store is away
        self._spending: set[asyncio.Task[None]] = set()

    async def enabled(self) -> bool:
        """Whether auth is on (then every non-public route needs a key): a bootstrap key, or accounts that are
        sealed (a key exists or once did). Asked of the accounts at every request until it is on (a key made on
        another gateway seals this one's next request too); then it stays on in this process. The accounts
        unreachable before that: ``StoreUnavailable`` (a 503)."""
        if self._bootstrap or self._sealed:
            return True
        self._sealed = await self.accounts.sealed()
        return self._sealed

    async def keep_seal(self, every: float = SEAL_EVERY) -> None:
        """For the gateway's life, in the background: ask the accounts every ``every`` seconds, so that a seal made
        on another gateway is known here within that even with no request meanwhile, and a seal the store lost
        (restarted empty) is put back by every gateway that knew it (``keys.RedisAccounts.sealed``, ``Emptied``)."""
        while True:
            await asyncio.sleep(every)
            with contextlib.suppress(StoreUnavailable):
                self._sealed = await self.accounts.sealed() or self._sealed

    async def identify(self, connection: ASGIConnection) -> Caller:
        for presented in _credentials(connection):
            found = await self._match(presented)
            if found is not None:
                return found
        return Caller(bucket=f"addr:{connection.client.host if connection.client else '-'}", rpm=self.rate_limit)

    async def _match(self, presented: str) -> Caller | None:
        hashed = digest(presented)
        boot = [hmac.compare_digest(hashed, known) for known in self._bootstrap]  # all compared, no early exit
        if any(boot):
            return Caller(bucket=f"boot:{boot.index(True)}", scope="admin", rpm=self.rate_limit, tenant="operator")
        parts = presented.split("_")
        if len(parts) < 3 or parts[0] != KEY_PREFIX:
            return None
        key = await self._lookup(parts[1])
        if key is None or not hmac.compare_digest(hashed, key.digest):
            return None
        return Caller(
            bucket=f"key:{key.id}",
            scope=key.scope,
            models=frozenset(key.models),
            rpm=key.rpm or self.rate_limit,
            tpm=key.tpm,
            tenant=f"tenant:{key.tenant}" if key.tenant else f"key:{key.id}",
            priority=key.priority,
            weight=key.weight,
        )

    async def _lookup(self, key_id: str) -> ApiKey | None:
        """The stored key ``key_id``; while the store does not answer, the record it gave within ``KEY_GRACE``."""
        try:
            key = await self.accounts.get_key(key_id)
        except StoreUnavailable:
            known = self._checked.get(key_id)
            if known is None or time.monotonic() - known[1] > KEY_GRACE:
                raise
            return known[0]
        now = time.monotonic()
        if key is None:
            self._checked.pop(key_id, None)
        else:
            self._checked[key_id] = (key, now)
            if len(self._checked) > 10_000:  # made-up ids never get here (no record): only real keys, bounded
                self._checked = {k: v for k, v in self._checked.items() if now - v[1] <= KEY_GRACE}
        return key

    async def _window(self, name: str, amount: int, limit: int) -> tuple[bool, float]:
        try:
            return await self.accounts.window(name, amount, limit)
        except StoreUnavailable:
            return await self._local.window(name, amount, limit)

    async def admit(self, caller: Caller) -> None:
        """Count one request against the caller's windows; ``RateLimited`` when a window is full."""
        if caller.tpm:
            _, spent = await self._window(f"tokens:{caller.bucket}", 0, 0)
            if spent >= caller.tpm:
                raise RateLimited(
                    f"token limit reached: {caller.tpm} tokens per minute; retry later",
                    retry_after=retry_after(spent, 1, caller.tpm),
                )
        if caller.rpm:
            counted, count = await self._window(f"requests:{caller.bucket}", 1, caller.rpm)
            if not counted:
                raise RateLimited(
                    f"rate limit reached: {caller.rpm} requests per minute; retry later",
                    retry_after=retry_after(count, 1, caller.rpm),
                )

    def meter(self, caller: Caller) -> Callable[[Usage], None]:
        """A callback that adds a finished stream's usage to the caller's token window (in the background)."""

        def spend(usage: Usage) -> None:
            task = asyncio.ensure_future(self.spend(caller, usage.prompt_tokens + usage.completion_tokens))
            self._spending.add(task)
            task.add_done_callback(self._spending.discard)

        return spend

    async def spend(self, caller: Caller, tokens: int) -> None:
        """Add a finished request's prompt and generated tokens to the caller's token window."""
        if caller.tpm and tokens > 0:
            await self._window(f"tokens:{caller.bucket}", tokens, 0)


def _credentials(connection: ASGIConnection) -> list[str]:
    """Every key the request presents: ``Authorization: Bearer`` and ``x-api-key`` (in that order)."""
    found = []
    bearer = connection.headers.get("authorization", "")
    if bearer[:7].lower() == "bearer " and bearer[7:].strip():
        found.append(bearer[7:].strip())
    api_key = connection.headers.get("x-api-key", "").strip()
    if api_key:
        found.append(api_key)
    return found[:2]


async def authorize(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """The guard on every route: the caller (on ``connection.state.caller``), its scope, then its limits."""
    needs = handler.opt.get("scope", "admin")
    if needs == "public":
        return
    ring: KeyRing = connection.app.state.keyring
    caller = await ring.identify(connection)
    connection.state.caller = caller
    if await ring.enabled():
        if caller.scope is None:
            raise AuthenticationFailed(
                "invalid or missing API key: pass it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
        if needs == "admin" and caller.scope != "admin":
            raise PermissionDenied("this endpoint needs an admin key; this key's scope is 'inference'")
    if handler.opt.get("limited"):
        await ring.admit(caller)


def caller_of(connection: ASGIConnection) -> Caller:
    """The caller ``authorize`` found for this request."""
    return connection.state.caller
