"""Ollama model-management handlers: ``/api/show``, ``/api/ps``, ``/api/copy``, ``/api/delete``, ``/api/create``,
``/api/pull``, ``/api/push``. Thin: decode, ``gateway.models.admin``, encode. Registered on the Ollama router."""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar import Request as HttpRequest
from litestar import Response, delete, get, post

from meshgate.gateway.http.routes.common import dispatcher_of, json_response, stream_response
from meshgate.gateway.models import admin as model_admin
from meshgate.protocols import ollama_models
from meshgate.protocols.model import decode_body

NDJSON = "application/x-ndjson"


def _registry(request: HttpRequest):
    return model_admin.registry_of(request.app.state.settings.data_dir)


@post("/api/show", status_code=200, opt={"body": ollama_models.ShowRequest})
async def show(request: HttpRequest) -> Response[bytes]:
    wire = decode_body(await request.body(), ollama_models.ShowRequest)
    return json_response(await model_admin.show(dispatcher_of(request), _registry(request), wire.target))


@get("/api/ps")
async def ps(request: HttpRequest) -> Response[bytes]:
    instances = await request.app.state.plane.store.instances()
    return json_response(await model_admin.ps(dispatcher_of(request), instances))


@post("/api/copy", status_code=200, opt={"body": ollama_models.CopyRequest, "scope": "admin"})
async def copy(request: HttpRequest) -> Response[None]:
    wire = decode_body(await request.body(), ollama_models.CopyRequest)
    await model_admin.copy(dispatcher_of(request), _registry(request), wire.source, wire.destination)
    return Response(None, status_code=200)


@delete("/api/delete", status_code=200, opt={"body": ollama_models.DeleteRequest, "scope": "admin"})
async def delete_model(request: HttpRequest) -> Response[None]:
    wire = decode_body(await request.body(), ollama_models.DeleteRequest)
    await model_admin.delete(dispatcher_of(request), _registry(request), wire.target)
    return Response(None, status_code=200)


@post("/api/create", status_code=200, opt={"body": ollama_models.CreateRequest, "scope": "admin"})
async def create(request: HttpRequest) -> Response:
    wire = decode_body(await request.body(), ollama_models.CreateRequest)
    lines = await model_admin.create(
        dispatcher_of(request), _registry(request), wire, model_admin.model_roots(request.app.state.settings)
    )
    return await _progress(lines, wire.stream)


@post("/api/pull", status_code=200, opt={"body": ollama_models.PullRequest, "scope": "admin"})
async def pull(request: HttpRequest) -> Response:
    wire = decode_body(await request.body(), ollama_models.PullRequest)
    lines = await model_admin.pull(dispatcher_of(request), _registry(request), wire.target)
    return await _progress(lines, wire.stream)


@post("/api/push", status_code=200, opt={"body": ollama_models.PullRequest, "scope": "admin"})
async def push(request: HttpRequest) -> Response[bytes]:
    decode_body(await request.body(), ollama_models.PullRequest)
    return json_response(
        ollama_models.error_line("push is not supported: meshgate has no registry to push to"), status=501
    )


async def _progress(lines: AsyncIterator[bytes], stream: bool | None) -> Response:
    """Progress objects as NDJSON (``stream`` true or missing), else only the last one (OLL-45); that one is a 500
    when it is an error (a pull whose digest did not match), as Ollama answers a failed pull."""
    if stream is not False:
        return stream_response(lines, NDJSON)
    last = b""
    async for line in lines:
        last = line
    last = last.rstrip(b"\n")
    return json_response(last, status=500 if last.startswith(b'{"error"') else 200)


ROUTES = [show, ps, copy, delete_model, create, pull, push]
