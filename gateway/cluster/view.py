"""The cached view of the cluster's instances, as one gateway sees them (``InstanceCache``).

Every role of the gateway's control plane (``deployments``, ``replicas``, ``reconcile``) reads instances from here
and writes them to the store. The view is read again only when the store's generation moved (``refresh``; the hot
path asks at every request, a read costs one ``GET`` when nothing changed), and kept whole across a store that
restarted empty: after every read it keeps, ``republished`` asks the store's incarnation, and puts back what this
gateway knew when it is new (``recovery``). ``changed`` wakes the reconcile loop.

Imports the records, the store's interface and ``recovery``.
"""

from __future__ import annotations

import asyncio
import math
import time

from meshgate.backends.placement import InstanceId
from meshgate.gateway.cluster.records import Deployment, Failed, Instance
from meshgate.gateway.cluster.recovery import Incarnation, republish
from meshgate.gateway.cluster.store import StateStore

__all__ = ["InstanceCache"]


class InstanceCache:
    """Every instance as this gateway last read them (``by_id``), and the deployments as it last read them."""

    def __init__(self, store: StateStore, holder: str) -> None:
        self.store = store
        self.holder = holder  # this gateway, as the holder of store leases and in the audit stream
        self.by_id: dict[str, Instance] = {}
        self.deployments: list[Deployment] = []  # as the last reconcile pass read them (``recovery.republish``)
        self.changed = asyncio.Event()  # the instances changed: reconcile now
        self.drains_seen: dict[tuple[str, float], float] = {}  # (instance, its drain's since) -> first seen here
        self.emptied_at = -math.inf  # monotonic time this gateway found the store restarted empty
        self._generation = -1
        self._incarnation = Incarnation(store)

    async def refresh(self, force: bool = False) -> None:
        """Read every instance again if the store's generation moved (always when ``force``)."""
        generation = await self.store.generation()
        if force or generation != self._generation:
            found = await self.store.instances()
            if await self.republished():  # the store restarted empty, maybe since that read: what it has now
                found = await self.store.instances()
            self._generation = generation
            self.by_id = {i.id: i for i in found}

    async def republished(self) -> bool:
        """Whether the store restarted empty since this gateway last looked, and it put back what it knew then
        (``recovery``): its replicas serve on, instead of being placed anew beside their running runners. Asked
        after every read the cache keeps (the view, the deployments), so an empty read never replaces them."""
        incarnation = await self._incarnation.new()
        if incarnation is None:
            return False
        await republish(self.store, self.deployments, self.by_id.values(), self.holder)
        self._incarnation.accept(incarnation)
        self.emptied_at = time.monotonic()  # no node is in it until its next heartbeat: as if it had been away
        return True

    async def refresh_now(self) -> None:
        """Read every instance again now."""
        await self.refresh(force=True)

    async def read_deployments(self) -> list[Deployment]:
        """Every deployment, read now and kept (checked against an empty restart, as ``refresh``)."""
        found = await self.store.deployments()
        if await self.republished():
            found = await self.store.deployments()
        self.deployments = found
        return found

    def remember(self, deployment: Deployment) -> None:
        """A deployment this gateway wrote: known at once, should the store lose it before the next read."""
        self.deployments = [*(d for d in self.deployments if d.model != deployment.model), deployment]

    def forget(self, model: str) -> None:
        self.deployments = [d for d in self.deployments if d.model != model]

    async def watch(self) -> None:
        """Wake the reconcile loop when the instances or deployments change. Node records change with every
        heartbeat (each node's, every second): a join, a drain or a departure is seen by the next periodic pass."""
        async for kind in self.store.watch():
            if kind == "instances":
                self.changed.set()

    def get(self, instance_id: InstanceId) -> Instance | None:
        return self.by_id.get(instance_id)

    def snapshot(self) -> list[Instance]:
        """Every instance as this gateway last read them."""
        return list(self.by_id.values())

    def ids(self) -> set[str]:
        """The ids of every instance in this gateway's view."""
        return set(self.by_id)

    def cached(self, model: str) -> list[Instance]:
        return [i for i in self.by_id.values() if i.model == model]

    def placed_memory(self) -> dict[str, int]:
        """Bytes per node the instances in this gateway's view take (or will, once loaded): every state but failed
        (whose runners are stopped)."""
        placed: dict[str, int] = {}
        for instance in self.by_id.values():
            if not isinstance(instance.state, Failed):
                for node_id, size in instance.placement.memory_per_node.items():
                    placed[node_id] = placed.get(node_id, 0) + size
        return placed
