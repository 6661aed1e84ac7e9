"""Instances: the gateway's side of the control plane, put together from its roles.

``InstanceManager`` builds and starts the roles, each in a module of its own, and hands each caller the part it
needs through a narrow typed port (``serving.dispatch.Replicas``, ``autoscale.Scaling``, the cluster routes):

* ``view.InstanceCache``: the cached view of every instance (read again only when the store says something
  changed, and kept whole across a store that restarted empty: ``recovery``);
* ``deployments.Deployments``: planning, placing under the store's lease, each model's deployment, drain,
  delete, expiry;
* ``replicas.Replicas``: the request path: the replica for each request (routed on the shared load, placed when
  there is none), waiting for it, failing one that cannot be reached;
* ``reconcile.Reconciler``: the loop that carries out the lifecycle's steps, autoscaling (``scale``) and the
  replicas deployments miss.

A model may have several instances, its **replicas**; the desired count is its ``Deployment`` in the store, so
every gateway and a restarted one agree on it. Compare-and-set on state and epoch keeps two gateways from acting
twice.

Imports the roles; the runtime wires it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Sequence

from meshgate.backends.base import Backend, ModelCard
from meshgate.gateway.cluster.deployments import Deployments, given_up
from meshgate.gateway.cluster.reconcile import Reconciler, missing_replicas
from meshgate.gateway.cluster.replicas import Replicas
from meshgate.gateway.cluster.store import StateStore
from meshgate.gateway.cluster.view import InstanceCache

__all__ = ["InstanceManager", "given_up", "missing_replicas"]


class InstanceManager:
    """The control plane's roles (``cache``, ``deployments``, ``replicas``, ``reconciler``), built and started."""

    def __init__(
        self,
        store: StateStore,
        backends: Sequence[Backend],
        *,
        resolve: Callable[[str], ModelCard],
        choose: Callable[..., Backend | None],
        rank: Callable | None = None,
        auto_place: bool = True,
        context: Callable[[Backend, ModelCard], int | None] | None = None,
        reconcile_every: float = 0.5,
        load: Callable[[str], int] = lambda instance_id: 0,
        holder: str | None = None,
        routing: str = "affinity",
        on_route: Callable[[str], None] = lambda instance_id: None,
        min_replicas: int = 1,
        max_replicas: int = 1,
        drain_grace: float = 30.0,
        node_ttl: float = 3.0,
    ) -> None:
        self.store = store
        self.resolve = resolve  # model name -> its card (the catalog's)
        self.holder = holder or uuid.uuid4().hex[:12]  # this gateway, as the holder of store leases
        self.load = load  # instance id -> generations running + queued on it, every gateway's (``loads``)
        self.cache = InstanceCache(store, self.holder)
        self.deployments = Deployments(
            self.cache,
            backends,
            resolve=resolve,
            choose=choose,
            rank=rank,
            context=context,
            load=load,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            drain_grace=drain_grace,
        )
        self.replicas = Replicas(
            self.cache, self.deployments, auto_place=auto_place, load=load, routing=routing, on_route=on_route
        )
        self.reconciler = Reconciler(
            self.cache,
            self.deployments,
            auto_place=auto_place,
            load=load,
            reconcile_every=reconcile_every,
            node_ttl=node_ttl,
        )
        self._tasks: list[asyncio.Task] = []
        # What its callers use, each from the role that does it (the ports: ``serving.dispatch.Replicas``,
        # ``autoscale.Scaling``; the cluster routes and tests use the rest).
        self.refresh, self.snapshot, self.ids = self.cache.refresh_now, self.cache.snapshot, self.cache.ids
        self.cached, self.placed_memory = self.cache.cached, self.cache.placed_memory
        self.acquire, self.wait_ready = self.replicas.acquire, self.replicas.wait_ready
        self.report_unreachable = self.replicas.report_unreachable
        d = self.deployments
        self.topology, self.preview, self.create, self.deploy = d.topology, d.preview, d.create, d.deploy
        self.set_bounds, self.beyond_minimum, self.delete = d.set_bounds, d.beyond_minimum, d.delete
        self.drain = d.drain
        self.lower, self.unload, self.keep, self.set_expiry = d.lower, d.unload, d.keep, d.set_expiry
        self.reconcile = self.reconciler.reconcile

    async def start(self) -> None:
        await self.cache.refresh(force=True)
        self._tasks = [
            asyncio.create_task(self.cache.watch(), name="instances-watch"),
            asyncio.create_task(self.reconciler.run(), name="instances-reconcile"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ------------------------------------------------------------------------------------------- reconcile

    @property
    def scale(self) -> Callable[[], Awaitable[object]] | None:
        """Autoscaling, once per reconcile pass (``autoscale.Autoscaler.step``)."""
        return self.reconciler.scale

    @scale.setter
    def scale(self, step: Callable[[], Awaitable[object]] | None) -> None:
        self.reconciler.scale = step

    @property
    def replacements(self) -> dict[str, int]:
        """Instances this gateway re-placed, by model (``/metrics``)."""
        return self.reconciler.replacements

    @property
    def routed(self) -> dict[tuple[str, str], int]:
        """Requests routed, by model and routing rule (``/metrics``)."""
        return self.replicas.routed
