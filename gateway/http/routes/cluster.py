"""The cluster API: topology, placement previews and instances (``/cluster``, ``/instances``, ``/events``).

Errors use OpenAI's envelope (``{"error": {"message", "type", ...}}``), the most widely parsed one. Instances are
shown with this gateway's queue for each (``queue``: requests generating, waiting, and the bounds) and their
load across every gateway (``load``: running, queued, tokens/s, prefix hits), and the KV cache tier its head
runner last reported (``kv_tier``: bytes, budget and entries in RAM and on disk, hits, misses; ``null`` for a
runner without one, ``gateway.cluster.kv_tiers``). ``POST /instances`` with
``replicas: N`` places N replicas at once, over distinct nodes where they fit (``min_replicas`` and
``max_replicas`` bound its autoscaling); ``/deployments`` lists the desired replica count and bounds of each model,
and ``PUT /deployments/{model}`` changes the bounds (``gateway.cluster.autoscale``).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from litestar import Router, delete, get, post, put
from litestar.di import NamedDependency
from litestar.response import Response, Stream
from sse_starlette.event import ServerSentEvent

from meshgate.backends.placement import Candidate, InstanceId, Link, Node, Strategy
from meshgate.gateway.cluster.instances import InstanceManager
from meshgate.gateway.cluster.kv_tiers import KvTiers
from meshgate.gateway.cluster.loads import ReplicaLoad
from meshgate.gateway.cluster.records import Deployment, Failed, Instance, Ready, StoreEvent
from meshgate.gateway.serving.admission import Load
from meshgate.gateway.serving.dispatch import Dispatcher
from meshgate.gateway.telemetry.kv_tier import KvTier
from meshgate.protocols.model import InvalidRequest, NotFound


class InstanceView(Instance, frozen=True):
    """A stored instance, this gateway's queue for it, its load across every gateway and its runner's KV tier."""

    queue: Load | None = None
    load: ReplicaLoad | None = None
    kv_tier: KvTier | None = None


class Placed(Instance, frozen=True):
    """The first instance placed, and every replica placed by the request (itself included) in ``replicas``."""

    replicas: list[Instance] = msgspec.field(default_factory=list)


class ClusterView(msgspec.Struct, frozen=True):
    nodes: list[Node]
    links: list[Link]
    instances: list[InstanceView]


class Preview(msgspec.Struct, frozen=True):
    model: str
    candidates: list[Candidate]


class CreateInstance(msgspec.Struct, frozen=True, kw_only=True):
    """Create from a preview (``candidate_id``) or from constraints (``nodes``); the best fit otherwise.
    ``replicas``: how many to place at once (each a whole placement, over distinct nodes where they fit);
    ``context``: tokens each holds (the backend's default when unset); ``min_replicas`` and ``max_replicas``: the
    bounds of the model's autoscaling (``MESHGATE_MIN_REPLICAS`` / ``MESHGATE_MAX_REPLICAS`` for a new
    deployment, raised to the replicas placed, when unset)."""

    model: str
    candidate_id: str | None = None
    nodes: list[str] | None = None
    strategy: Strategy | None = None
    min_nodes: int | None = None
    replicas: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    context: Annotated[int, msgspec.Meta(ge=1)] | None = None
    min_replicas: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None
    max_replicas: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None


class Bounds(msgspec.Struct, frozen=True, kw_only=True):
    """A deployment's autoscaling bounds; one left out stays as it is."""

    min_replicas: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None
    max_replicas: Annotated[int, msgspec.Meta(ge=1, le=64)] | None = None


Instances = NamedDependency[InstanceManager]  # the app's ``instances`` dependency (``common.provide_instances``)
Dispatch = NamedDependency[Dispatcher]
Tiers = NamedDependency[KvTiers]  # the app's ``kv_tiers`` dependency (``common.provide_kv_tiers``)


def _view(dispatcher: Dispatcher, kv_tiers: KvTiers, instance: Instance) -> InstanceView:
    fields = {name: getattr(instance, name) for name in instance.__struct_fields__}
    load = dispatcher.loads.view(instance.id) if dispatcher.loads is not None else None
    queue = dispatcher.admission.load(instance.id)
    return InstanceView(**fields, queue=queue, load=load, kv_tier=kv_tiers.get(instance.id))


def _nodes(value: str | None) -> list[str] | None:
    return [n.strip() for n in value.split(",") if n.strip()] if value else None


@get("/cluster", summary="Nodes, measured links and instances")
async def cluster(instances: Instances, dispatcher: Dispatch, kv_tiers: Tiers) -> ClusterView:
    topology = await instances.topology()
    return ClusterView(
        nodes=list(topology.nodes),
        links=list(topology.links),
        instances=[_view(dispatcher, kv_tiers, i) for i in await instances.store.instances()],
    )


@get("/instances/previews", summary="Every placement candidate for a model, with memory per node, cost and error")
async def previews(
    instances: Instances,
    dispatcher: Dispatch,
    model: str,
    nodes: str | None = None,
    strategy: str | None = None,
    min_nodes: int | None = None,
) -> Preview:
    card = dispatcher.catalog.resolve(model)
    candidates = await instances.preview(card.name, nodes=_nodes(nodes), strategy=strategy, min_nodes=min_nodes)
    return Preview(model=card.name, candidates=candidates)


@post("/instances", summary="Create an instance (or N replicas) from a preview or from constraints", status_code=201)
async def create_instance(instances: Instances, data: CreateInstance) -> Placed:
    if data.candidate_id is not None and data.replicas > 1:
        raise InvalidRequest("a candidate_id places one instance; leave out replicas or candidate_id", param="replicas")
    placed = await instances.deploy(
        data.model,
        replicas=data.replicas,
        candidate_id=data.candidate_id,
        nodes=data.nodes,
        strategy=data.strategy,
        min_nodes=data.min_nodes,
        context=data.context,
        min_replicas=data.min_replicas,
        max_replicas=data.max_replicas,
    )
    first = placed[0]
    return Placed(**{name: getattr(first, name) for name in first.__struct_fields__}, replicas=placed)


@get("/deployments", summary="Each model's desired replicas (its deployment record)")
async def deployments(instances: Instances) -> list[Deployment]:
    return await instances.store.deployments()


@put("/deployments/{model:str}", summary="Change a model's autoscaling bounds (min_replicas, max_replicas)")
async def set_bounds(instances: Instances, dispatcher: Dispatch, model: str, data: Bounds) -> Deployment:
    card = dispatcher.catalog.resolve(model)
    return await instances.set_bounds(card.name, data.min_replicas, data.max_replicas)


@get("/instances", summary="All instances, with this gateway's queue for each and its runner's KV tier")
async def list_instances(instances: Instances, dispatcher: Dispatch, kv_tiers: Tiers) -> list[InstanceView]:
    return [_view(dispatcher, kv_tiers, i) for i in await instances.store.instances()]


@get("/instances/{instance_id:str}", summary="One instance, with this gateway's queue for it and its runner's KV tier")
async def get_instance(instances: Instances, dispatcher: Dispatch, kv_tiers: Tiers, instance_id: str) -> InstanceView:
    instance = await instances.store.get_instance(InstanceId(instance_id))
    if instance is None:
        raise NotFound(f"instance '{instance_id}' not found")
    return _view(dispatcher, kv_tiers, instance)


@delete(
    "/instances/{instance_id:str}",
    summary="Delete an instance: it drains (202, the draining instance), or goes at once (204: not ready, grace=0)",
    status_code=202,
)
async def delete_instance(
    instances: Instances, dispatcher: Dispatch, kv_tiers: Tiers, instance_id: str, grace: float | None = None
) -> Response[Any]:
    """A ready instance drains: it takes no new requests and is stopped when what runs or queues on it (on any
    gateway) has finished, 2.5 s at least (a stream another gateway began a moment ago may not be in the shared
    load yet), or after ``grace`` seconds (``MESHGATE_DRAIN_GRACE`` when unset; 0: at once, and its streams resume
    on another replica)."""
    if grace is not None and not 0 <= grace <= 86400:
        raise InvalidRequest("grace must be between 0 and 86400 seconds", param="grace")
    draining = await instances.delete(InstanceId(instance_id), grace=grace)
    if draining is None:
        return Response(None, status_code=204)
    return Response(_view(dispatcher, kv_tiers, draining), status_code=202)


@get("/instances/{instance_id:str}/events", summary="Server-sent state changes until ready or failed")
async def instance_events(instances: Instances, instance_id: str) -> Stream:
    if await instances.store.get_instance(InstanceId(instance_id)) is None:
        raise NotFound(f"instance '{instance_id}' not found")
    return Stream(_state_changes(instances, InstanceId(instance_id)), media_type="text/event-stream")


async def _state_changes(manager: InstanceManager, instance_id: InstanceId) -> AsyncIterator[bytes]:
    last = None
    for _ in range(3000):  # bounded: 10 minutes at 0.2 s
        instance = await manager.store.get_instance(instance_id)
        if instance is None:
            yield ServerSentEvent(data='{"state":"deleted"}', event="deleted").encode()
            return
        snapshot = msgspec.json.encode(instance)
        if snapshot != last:
            last = snapshot
            yield ServerSentEvent(data=snapshot.decode(), event=type(instance.state).__name__.lower()).encode()
        if isinstance(instance.state, Ready) or (isinstance(instance.state, Failed) and instance.attempts >= 3):
            return
        await asyncio.sleep(0.2)
    yield ServerSentEvent(comment="timed out").encode()


@get("/events", summary="The audit stream: placements, state changes, nodes joining and leaving")
async def events(instances: Instances, since: str | None = None, count: int = 100) -> list[StoreEvent]:
    if not 1 <= count <= 10000:
        raise InvalidRequest("count must be between 1 and 10000", param="count")
    if since is not None and not _EVENT_ID.fullmatch(since):
        raise InvalidRequest(
            f"since must be an event id such as 1700000000000-0 (the id of an event from this list); got {since!r}",
            param="since",
        )
    return await instances.store.events(since=since, count=count)


_EVENT_ID = re.compile(r"[0-9]{1,19}(?:-[0-9]{1,19})?")  # 64-bit numbers
"""An event's id, as the state store gives it: ``<milliseconds>-<sequence>`` (a Redis stream id)."""


router = Router(
    path="/",
    route_handlers=[
        cluster,
        previews,
        create_instance,
        list_instances,
        get_instance,
        delete_instance,
        instance_events,
        events,
        deployments,
        set_bounds,
    ],
    tags=["cluster"],
    opt={"scope": "admin"},
)
