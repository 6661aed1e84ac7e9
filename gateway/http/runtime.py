"""Assemble the control plane for a process from settings and plugins: the store, the catalog, backends, the
instance manager and (embedded, or as ``meshgate node``) the node agent.

Both ``create_app`` and ``meshgate node`` use it, so a gateway and an agent see the same backends and models.

It also settles the cluster secret that runners and agents demand of callers (``backends.runner.secret``): the
operator's ``MESHGATE_CLUSTER_SECRET``, else the one in the state store (with Redis, the first process to start
stores its random one and every later gateway and agent reads it; in memory, this process's random one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pluggy

from meshgate.backends.base import Backend, ModelCard, ModelSource
from meshgate.backends.registry import ModelRegistry
from meshgate.backends.runner import secret as cluster_secret
from meshgate.gateway.batches.worker import BatchWorker
from meshgate.gateway.cluster.agent import NodeAgent
from meshgate.gateway.cluster.autoscale import Autoscaler, Policy
from meshgate.gateway.cluster.batch_store import BatchStore, MemoryBatchStore
from meshgate.gateway.cluster.instances import InstanceManager
from meshgate.gateway.cluster.kv_tiers import KvTiers
from meshgate.gateway.cluster.loads import LoadBoard
from meshgate.gateway.cluster.planner import default_rank
from meshgate.gateway.cluster.redis_batches import RedisBatchStore
from meshgate.gateway.cluster.redis_store import RedisStore
from meshgate.gateway.cluster.store import MemoryStore, StateStore
from meshgate.gateway.http.ticks import tick_once_a_second
from meshgate.gateway.serving.admission import Admission
from meshgate.gateway.serving.catalog import Catalog
from meshgate.gateway.serving.dispatch import Dispatcher
from meshgate.gateway.serving.model_defaults import UserModels
from meshgate.gateway.serving.runner_health import runner_health, runner_kv
from meshgate.gateway.telemetry.metrics import PlaneSnapshot
from meshgate.plugins.policy import by_preference
from meshgate.plugins.settings import Settings

__all__ = ["ControlPlane", "control_plane", "make_batch_store", "make_store"]


log = logging.getLogger("meshgate.runtime")


def make_store(settings: Settings) -> StateStore:
    return RedisStore(settings.redis, timeout=settings.store_timeout) if settings.redis else MemoryStore()


def make_batch_store(settings: Settings) -> BatchStore:
    """Where batch jobs live: the cluster's Redis when there is one (every gateway shares the work), else memory."""
    if settings.redis:
        return RedisBatchStore(settings.redis, timeout=settings.store_timeout)
    return MemoryBatchStore()


@dataclass
class ControlPlane:
    store: StateStore
    catalog: Catalog
    backends: list[Backend]
    plugins: pluggy.PluginManager
    http: httpx.AsyncClient
    instances: InstanceManager | None = None
    agent: NodeAgent | None = None
    dispatcher: Dispatcher | None = None
    kv_tiers: KvTiers | None = None  # each ready replica's KV tier, polled (a gateway's)
    batches: BatchStore | None = None  # batch jobs, files and lines (a gateway's)
    batch_worker: BatchWorker | None = None  # the task that runs this gateway's share of the lines
    extra: dict = field(default_factory=dict)

    async def snapshot(self) -> PlaneSnapshot:
        """What ``/metrics`` reports of this plane (``telemetry.metrics.Snapshots``), read now."""
        nodes, links, instances = await asyncio.gather(self.store.nodes(), self.store.links(), self.store.instances())
        dispatcher, manager = self.dispatcher, self.instances
        loads = dispatcher.loads if dispatcher is not None else None
        return PlaneSnapshot(
            nodes=nodes,
            links=links,
            instances=instances,
            queues=dispatcher.admission.loads() if dispatcher is not None else {},
            replacements=dict(manager.replacements) if manager is not None else {},
            routed=dict(manager.routed) if manager is not None else {},
            replica_load=loads.view if loads is not None else None,
            restarts=self.agent.metrics.restarts.family() if self.agent is not None else None,
            kv_tiers=self.kv_tiers.figures() if self.kv_tiers is not None else {},
        )


@contextlib.asynccontextmanager
async def control_plane(
    settings: Settings, plugins: pluggy.PluginManager, *, gateway: bool, agent: bool
) -> AsyncIterator[ControlPlane]:
    """Everything a gateway (``gateway=True``) and/or a node agent (``agent=True``) needs, started and closed."""
    async with httpx.AsyncClient(
        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64), trust_env=False
    ) as http:
        backends: list[Backend] = []
        sources: list[ModelSource] = []
        plugins.hook.meshgate_register_backends(register=backends.append, settings=settings, http=http)
        plugins.hook.meshgate_register_model_sources(register=sources.append, settings=settings)
        backends = by_preference(backends, settings.backend_preference)
        catalog = Catalog(sources)
        await asyncio.to_thread(catalog.refresh)
        store = make_store(settings)
        plane = ControlPlane(store=store, catalog=catalog, backends=backends, plugins=plugins, http=http)
        following: asyncio.Task[None] | None = None
        choose = plugins.hook.meshgate_choose_backend
        try:
            secret = settings.cluster_secret or await store.cluster_secret(cluster_secret.current())
            cluster_secret.use(secret)  # what this process's runners demand and its runner clients present
            if not settings.cluster_secret and not agent:
                following = asyncio.create_task(follow_secret(store), name="cluster-secret")
            if agent:
                plane.agent = NodeAgent(
                    store,
                    backends,
                    catalog.resolve,
                    choose=choose,
                    name=settings.node_name,
                    address=settings.cluster_address,
                    port=settings.agent_port,
                    heartbeat=settings.heartbeat,
                    ttl=settings.node_ttl,
                    memory=settings.node_memory,
                    probe_every=settings.link_probe_every,
                    flops=settings.node_flops,
                    secret=secret,
                    tune_server=tick_once_a_second,  # an idle agent wakes once a second, not ten times
                )
                await plane.agent.start()
            if gateway:

                def context(backend: Backend, card: ModelCard) -> int | None:
                    return backend.context(card) or None  # 0: the model's own (the planner reads its spec)

                admission = Admission(settings.parallel, settings.max_queue, settings.batch_aging)
                loads = LoadBoard(store, admission, live=lambda: plane.instances.ids() if plane.instances else set())
                plane.instances = InstanceManager(
                    store,
                    backends,
                    resolve=catalog.resolve,
                    choose=choose,
                    rank=_rank(plugins),
                    auto_place=settings.placement != "never",
                    context=context,
                    load=loads.load,
                    holder=loads.gateway_id,
                    routing=settings.routing,
                    on_route=loads.routed,
                    min_replicas=settings.min_replicas,
                    max_replicas=max(settings.min_replicas, settings.max_replicas),
                    drain_grace=settings.drain_grace,
                    node_ttl=settings.node_ttl,
                )
                policy = Policy(
                    up_wait=settings.scale_up_wait,
                    down_idle=settings.scale_down_idle,
                    cooldown=settings.scale_cooldown,
                )
                plane.instances.scale = Autoscaler(plane.instances, policy, loads.view).step
                await plane.instances.start()
                await loads.start()
                plane.dispatcher = Dispatcher(
                    catalog,
                    backends,
                    choose,
                    plane.instances,
                    keepalive=settings.keepalive,
                    admission=admission,
                    max_tokens=settings.max_tokens,
                    user_models=UserModels(ModelRegistry.in_data_dir(settings.data_dir)),
                    loads=loads,
                    grow_context=settings.grow_context,
                    resume_wait=settings.resume_wait,
                )
                health_of = runner_health(catalog.resolve, plane.dispatcher.backend_for)
                tell = runner_kv(catalog.resolve, plane.dispatcher.backend_for)
                plane.kv_tiers = KvTiers(plane.instances.snapshot, health_of, tell=tell, links=plane.store.links)
                plane.instances.replicas.cached = plane.kv_tiers.holding  # routing's ``tier`` rule
                plane.instances.replicas.cold = plane.kv_tiers.cold  # new replicas warming up take nothing
                await plane.kv_tiers.start()
                plane.batches = make_batch_store(settings)
                plane.batch_worker = BatchWorker(
                    plane.batches,
                    plane.dispatcher,
                    concurrency=settings.batch_concurrency,
                    lease=settings.batch_lease,
                )
                plane.batch_worker.start()
            yield plane
        finally:
            if following is not None:
                following.cancel()
            if plane.batch_worker is not None:
                await plane.batch_worker.close()
            if plane.batches is not None:
                await plane.batches.close()
            if plane.kv_tiers is not None:
                await plane.kv_tiers.close()
            if plane.dispatcher is not None and plane.dispatcher.loads is not None:
                await plane.dispatcher.loads.close()
            if plane.instances is not None:
                await plane.instances.close()
            if plane.agent is not None:
                await plane.agent.close()
            await store.close()


SECRET_EVERY = 2.0
"""Seconds between a gateway's reads of the cluster secret (``follow_secret``)."""


async def follow_secret(store: StateStore, every: float = SECRET_EVERY) -> None:
    """A gateway's side of the secret's survival: read it again every ``every`` seconds and use what the store
    says. After the store restarted empty, the first read puts this gateway's back (provisional); a node agent
    whose runners demand another one replaces it at its next heartbeat, and the next read here takes that one
    (``StateStore.cluster_secret``), so runners never answer 401 for longer than a heartbeat and this period."""
    while True:
        await asyncio.sleep(every)
        try:
            found = await store.cluster_secret(cluster_secret.current())
        except Exception:  # the store away: keep the one in use
            continue
        if found != cluster_secret.current():
            log.warning("the cluster secret in the state store changed (it was emptied); using the stored one")
            cluster_secret.use(found)


def _rank(plugins: pluggy.PluginManager):
    """The placement policy: the first plugin that answers ``meshgate_rank_candidates``, else the built-in."""

    def rank(candidates, topology):
        ranked = plugins.hook.meshgate_rank_candidates(candidates=candidates, topology=topology)
        return ranked if ranked is not None else default_rank(candidates, topology)

    return rank
