"""Defects the simulator must find, planted on purpose (``python -m tests.sim --plant NAME``): each undoes one fix
it led to, so a test can show the checks fail when the control plane is wrong (tests/sim/test_simulator.py)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator

from meshgate.gateway.auth.guard import KeyRing
from meshgate.gateway.cluster.deployments import Deployments
from meshgate.gateway.cluster.view import InstanceCache


@contextlib.asynccontextmanager
async def _unleased(self: Deployments) -> AsyncIterator[None]:
    async with self._create_lock:  # only this gateway's own placements in turn, as before the lease
        yield


async def _cached_seal(self: KeyRing) -> bool:
    if self._bootstrap or self._sealed:
        return True
    now = time.monotonic()
    checked, sealed = getattr(self, "_checked_seal", (-10.0, False))
    if now - checked > 1.0:  # asked at most once a second, as before
        sealed = await self.accounts.sealed()
        self._checked_seal = (now, sealed)  # type: ignore[attr-defined]
    self._sealed = sealed
    return sealed


async def _never_republished(self: InstanceCache) -> bool:
    return False  # a gateway that takes an empty store for the truth: its replicas are placed anew, runners stopped


PLANTS: dict[str, tuple[type, str, Callable]] = {
    "no-placing-lease": (Deployments, "placing", _unleased),  # two gateways fill one node twice over
    "seal-cached": (KeyRing, "enabled", _cached_seal),  # a second with auth off after another gateway's first key
    "no-republish": (InstanceCache, "republished", _never_republished),  # a store restarted empty loses it all
}


@contextlib.contextmanager
def planted(name: str | None) -> Iterator[None]:
    if name is None:
        yield
        return
    owner, attribute, defect = PLANTS[name]
    saved = getattr(owner, attribute)
    setattr(owner, attribute, defect)
    try:
        yield
    finally:
        setattr(owner, attribute, saved)
