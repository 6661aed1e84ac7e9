"""OpenAI's Files and Batch API: ``/v1/files`` (purpose ``batch``) and ``/v1/batches``, over the batch store.

A file is checked when it is uploaded (every line an object with ``custom_id``, ``method``, ``url``, ``body``;
the message names the line to fix) and again when a batch is made of it (every ``url`` the batch's endpoint); a
line whose ``body`` the endpoint would refuse fails alone, in the error file (``gateway.batches``). Files and
batches belong to the key that made them: another inference key gets a 404 (an admin key sees all; without keys,
everyone sees everything). Errors use OpenAI's envelope (``gateway.http.errors``).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from litestar import Request as HttpRequest
from litestar import Response, Router, delete, get, post
from litestar.datastructures import State, UploadFile
from litestar.di import NamedDependency, Provide

from meshgate.gateway.auth.guard import caller_of
from meshgate.gateway.batches import jobs
from meshgate.gateway.batches.lines import ENDPOINTS, openai_lines
from meshgate.gateway.batches.views import openai_batch, openai_file, page
from meshgate.gateway.batches.worker import BatchWorker
from meshgate.gateway.cluster.batch_store import BatchStore, FileRecord, Job
from meshgate.gateway.http.routes.common import body, json_response
from meshgate.plugins.settings import Settings
from meshgate.protocols.model import InvalidRequest, NotFound, RequestTooLarge

__all__ = ["owner_of", "provide_batches", "provide_batch_worker", "router", "visible"]

FILE_EXPIRY = 30 * 24 * 3600
"""Seconds after which an uploaded batch file expires (OpenAI's default for purpose ``batch``)."""


def provide_batches(state: State) -> BatchStore:
    """The ``batches`` dependency: the batch store."""
    return state.plane.batches


def provide_batch_worker(state: State) -> BatchWorker:
    """The ``batch_worker`` dependency: this gateway's batch worker (woken when a job is made or cancelled)."""
    return state.plane.batch_worker


def owner_of(request: HttpRequest) -> str:
    """Whose the files and batches a request makes are: its key's bucket (``""`` without a valid key: anyone's)."""
    caller = caller_of(request)
    return caller.bucket if caller.scope is not None else ""


def visible(request: HttpRequest, owner: str) -> bool:
    caller = caller_of(request)
    return not owner or caller.scope == "admin" or owner == caller.bucket


Store = NamedDependency[BatchStore]


async def _file(store: BatchStore, request: HttpRequest, file_id: str) -> FileRecord:
    record = await store.get_file(file_id)
    if record is None or not visible(request, record.owner):
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    return record


async def _job(store: BatchStore, request: HttpRequest, batch_id: str) -> Job:
    job = await store.get_job(batch_id)
    if job is None or job.api != "openai" or not visible(request, job.owner):
        raise NotFound(f"No batch found with id '{batch_id}'", param="batch_id")
    return job


async def _batch_body(store: BatchStore, job: Job) -> Response[bytes]:
    return json_response(msgspec.json.encode(openai_batch(job, await store.progress(job.id))))


@post("/v1/files", status_code=200, summary="Upload a JSONL file for the Batch API (purpose batch)")
async def upload_file(request: HttpRequest, batches: Store, settings: NamedDependency[Settings]) -> Response[bytes]:
    form = await request.form()
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, UploadFile):
        raise InvalidRequest("'file' is required: send the JSONL file as multipart form data", param="file")
    if purpose != "batch":
        raise InvalidRequest(
            f"purpose {purpose!r} is not served: meshgate keeps files for the Batch API only (purpose 'batch')",
            param="purpose",
        )
    content = await upload.read()
    if len(content) > settings.batch_max_bytes:
        raise RequestTooLarge(
            f"the file is {len(content):,} bytes; at most {settings.batch_max_bytes:,} (MESHGATE_BATCH_MAX_BYTES)"
        )
    openai_lines(content, settings.batch_max_lines)  # refused now, with the line to fix
    now = int(time.time())
    record = FileRecord(
        id=jobs.new_id("file-"),
        bytes=len(content),
        created_at=now,
        filename=upload.filename or "batch.jsonl",
        purpose="batch",
        expires_at=now + FILE_EXPIRY,
        owner=owner_of(request),
    )
    await batches.put_file(record, content)
    return json_response(msgspec.json.encode(openai_file(record)))


@get("/v1/files", summary="List files")
async def list_files(
    request: HttpRequest,
    batches: Store,
    after: str | None = None,
    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> Response[bytes]:
    found = [f for f in await batches.files() if visible(request, f.owner) and purpose in (None, f.purpose)]
    if order == "desc":
        found.reverse()
    chosen, more = page(found, [f.id for f in found], after=after, before=None, limit=limit)
    return json_response(_listing([openai_file(f) for f in chosen], more))


def _listing(data: list[dict[str, Any]], more: bool) -> bytes:
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return msgspec.json.encode({"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more})


@get("/v1/files/{file_id:str}", summary="A file's record")
async def get_file(request: HttpRequest, batches: Store, file_id: str) -> Response[bytes]:
    return json_response(msgspec.json.encode(openai_file(await _file(batches, request, file_id))))


@get("/v1/files/{file_id:str}/content", summary="A file's content")
async def file_content(request: HttpRequest, batches: Store, file_id: str) -> Response[bytes]:
    await _file(batches, request, file_id)
    content = await batches.file_content(file_id)
    if content is None:
        raise NotFound(f"No such File object: {file_id}", param="file_id")
    return Response(content, media_type="application/octet-stream")


@delete("/v1/files/{file_id:str}", status_code=200, summary="Delete a file")
async def delete_file(request: HttpRequest, batches: Store, file_id: str) -> Response[bytes]:
    await _file(batches, request, file_id)
    deleted = await batches.delete_file(file_id)
    return json_response(msgspec.json.encode({"id": file_id, "object": "file", "deleted": deleted}))


class CreateBatch(msgspec.Struct, kw_only=True):
    """The body of ``POST /v1/batches`` (``openai: types/batch_create_params.py``)."""

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, Annotated[str, msgspec.Meta(max_length=512)]] | None = None
    output_expires_after: dict[str, Any] | None = None


@post("/v1/batches", status_code=200, opt={"limited": True}, dependencies=body(CreateBatch))
async def create_batch(
    request: HttpRequest,
    wire: NamedDependency[CreateBatch],
    batches: Store,
    batch_worker: NamedDependency[BatchWorker],
    settings: NamedDependency[Settings],
) -> Response[bytes]:
    if wire.endpoint not in ENDPOINTS:
        raise InvalidRequest(
            f"endpoint {wire.endpoint!r} is not served in batches; use one of {', '.join(ENDPOINTS)}", param="endpoint"
        )
    if wire.completion_window != "24h":
        raise InvalidRequest("completion_window must be '24h'", param="completion_window")
    if wire.metadata is not None and len(wire.metadata) > 16:
        raise InvalidRequest("metadata: at most 16 keys", param="metadata")
    record = await _file(batches, request, wire.input_file_id)
    content = await batches.file_content(record.id)
    if record.purpose != "batch" or content is None:
        raise InvalidRequest(f"file {record.id} was not uploaded with purpose 'batch'", param="input_file_id")
    lines = openai_lines(content, settings.batch_max_lines, wire.endpoint)
    caller = caller_of(request)
    job = await jobs.create_job(
        batches,
        api="openai",
        endpoint=wire.endpoint,
        lines=lines,
        owner=owner_of(request),
        models=tuple(caller.models),
        tenant=caller.tenant if settings.kv_sharing == "tenant" else "",
        weight=caller.weight,
        input_file_id=record.id,
        metadata=wire.metadata,
    )
    batch_worker.wake()
    return await _batch_body(batches, job)


@get("/v1/batches/{batch_id:str}", summary="A batch")
async def get_batch(request: HttpRequest, batches: Store, batch_id: str) -> Response[bytes]:
    return await _batch_body(batches, await _job(batches, request, batch_id))


@get("/v1/batches", summary="List batches, newest first")
async def list_batches(
    request: HttpRequest,
    batches: Store,
    after: str | None = None,
    limit: Annotated[int, msgspec.Meta(ge=1, le=100)] = 20,
) -> Response[bytes]:
    found = [j for j in reversed(await batches.jobs()) if j.api == "openai" and visible(request, j.owner)]
    chosen, more = page(found, [j.id for j in found], after=after, before=None, limit=limit)
    data = [openai_batch(j, await batches.progress(j.id)) for j in chosen]
    return json_response(_listing(data, more))


@post("/v1/batches/{batch_id:str}/cancel", status_code=200, summary="Cancel a batch")
async def cancel_batch(
    request: HttpRequest, batches: Store, batch_worker: NamedDependency[BatchWorker], batch_id: str
) -> Response[bytes]:
    await _job(batches, request, batch_id)
    job = await jobs.cancel(batches, batch_id)
    if job is None:
        raise NotFound(f"No batch found with id '{batch_id}'", param="batch_id")
    batch_worker.wake()
    return await _batch_body(batches, job)


router = Router(
    path="/",
    route_handlers=[
        upload_file,
        list_files,
        get_file,
        file_content,
        delete_file,
        create_batch,
        get_batch,
        list_batches,
        cancel_batch,
    ],
    dependencies={
        "batches": Provide(provide_batches, sync_to_thread=False),
        "batch_worker": Provide(provide_batch_worker, sync_to_thread=False),
    },
    tags=["openai batches"],
    opt={"scope": "inference"},
)
