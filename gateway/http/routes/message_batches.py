"""Anthropic's Message Batches: ``/v1/messages/batches`` (create, retrieve, list, cancel, delete, results).

Each request's ``params`` is checked as ``/v1/messages`` checks a body; one it would refuse is ``errored`` alone
(``gateway.batches``). ``results`` is JSONL once the batch has ended. Batches belong to the key that made them
(``routes.batches.visible``); errors use Anthropic's envelope (the path starts with ``/v1/messages``).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Request as HttpRequest
from litestar import Response, Router, delete, get, post
from litestar.di import NamedDependency, Provide

from meshgate.gateway.auth.guard import caller_of
from meshgate.gateway.batches import jobs
from meshgate.gateway.batches.lines import anthropic_lines
from meshgate.gateway.batches.views import anthropic_batch, anthropic_results, anthropic_status, page
from meshgate.gateway.batches.worker import BatchWorker
from meshgate.gateway.cluster.batch_store import BatchStore, Job
from meshgate.gateway.http.routes.batches import owner_of, provide_batch_worker, provide_batches, visible
from meshgate.gateway.http.routes.common import json_response
from meshgate.plugins.settings import Settings
from meshgate.protocols.model import InvalidRequest, NotFound

__all__ = ["router"]

Store = NamedDependency[BatchStore]


async def _job(store: BatchStore, request: HttpRequest, batch_id: str) -> Job:
    job = await store.get_job(batch_id)
    if job is None or job.api != "anthropic" or not visible(request, job.owner):
        raise NotFound(f"message batch {batch_id!r} not found", param="message_batch_id")
    return job


async def _view(store: BatchStore, request: HttpRequest, job: Job) -> dict[str, Any]:
    return anthropic_batch(job, await store.progress(job.id), str(request.base_url))


@post("/v1/messages/batches", status_code=200, opt={"limited": True}, summary="Create a Message Batch")
async def create(
    request: HttpRequest,
    batches: Store,
    batch_worker: NamedDependency[BatchWorker],
    settings: NamedDependency[Settings],
) -> Response[bytes]:
    lines = anthropic_lines(await request.body(), settings.batch_max_lines)
    caller = caller_of(request)
    job = await jobs.create_job(
        batches,
        api="anthropic",
        endpoint="/v1/messages",
        lines=lines,
        owner=owner_of(request),
        models=tuple(caller.models),
        tenant=caller.tenant if settings.kv_sharing == "tenant" else "",
        weight=caller.weight,
    )
    batch_worker.wake()
    return json_response(msgspec.json.encode(await _view(batches, request, job)))


@get("/v1/messages/batches/{batch_id:str}", summary="A Message Batch")
async def retrieve(request: HttpRequest, batches: Store, batch_id: str) -> Response[bytes]:
    job = await _job(batches, request, batch_id)
    return json_response(msgspec.json.encode(await _view(batches, request, job)))


@get("/v1/messages/batches", summary="List Message Batches, newest first")
async def list_batches(
    request: HttpRequest,
    batches: Store,
    before_id: str | None = None,
    after_id: str | None = None,
    limit: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 20,
) -> Response[bytes]:
    found = [j for j in reversed(await batches.jobs()) if j.api == "anthropic" and visible(request, j.owner)]
    chosen, more = page(found, [j.id for j in found], after=after_id, before=before_id, limit=limit)
    data = [await _view(batches, request, j) for j in chosen]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return json_response(msgspec.json.encode({"data": data, "has_more": more, "first_id": first, "last_id": last}))


@post("/v1/messages/batches/{batch_id:str}/cancel", status_code=200, summary="Cancel a Message Batch")
async def cancel(
    request: HttpRequest, batches: Store, batch_worker: NamedDependency[BatchWorker], batch_id: str
) -> Response[bytes]:
    await _job(batches, request, batch_id)
    job = await jobs.cancel(batches, batch_id)
    if job is None:
        raise NotFound(f"message batch {batch_id!r} not found", param="message_batch_id")
    batch_worker.wake()
    return json_response(msgspec.json.encode(await _view(batches, request, job)))


@delete("/v1/messages/batches/{batch_id:str}", status_code=200, summary="Delete an ended Message Batch")
async def remove(request: HttpRequest, batches: Store, batch_id: str) -> Response[bytes]:
    job = await _job(batches, request, batch_id)
    if anthropic_status(job) != "ended":
        raise InvalidRequest(
            f"message batch {batch_id} is still processing: cancel it, and delete it once it has ended",
            param="message_batch_id",
        )
    await batches.delete_job(batch_id)
    return json_response(msgspec.json.encode({"id": batch_id, "type": "message_batch_deleted"}))


@get("/v1/messages/batches/{batch_id:str}/results", summary="A Message Batch's results (JSONL)")
async def results(request: HttpRequest, batches: Store, batch_id: str) -> Response[bytes]:
    job = await _job(batches, request, batch_id)
    if anthropic_status(job) != "ended":
        raise InvalidRequest(f"message batch {batch_id} has not ended: its results are not ready")
    return Response(anthropic_results(await batches.results(job.id)), media_type="application/x-jsonl")


router = Router(
    path="/",
    route_handlers=[create, retrieve, list_batches, cancel, remove, results],
    dependencies={
        "batches": Provide(provide_batches, sync_to_thread=False),
        "batch_worker": Provide(provide_batch_worker, sync_to_thread=False),
    },
    tags=["anthropic batches"],
    opt={"scope": "inference"},
)
