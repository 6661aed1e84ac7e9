"""Ollama model-management handlers: ``/api/show``, ``/api/ps``, ``/api/copy``, ``/api/delete``, ``/api/create``,
``/api/pull``, ``/api/push``. Thin: decode, ``gateway.models.admin``, encode. Registered on the Ollama router."""

from __future__ import annotations

from collections.abc import AsyncIterator

from litestar import Request as HttpRequest
from litestar import Response, delete, get, post
from litestar.di import NamedDependency

from meshgate.gateway.cluster.instances import InstanceManager
from meshgate.gateway.http.routes.common import body, json_response, may_use, stream_response
from meshgate.gateway.models import admin as model_admin
from meshgate.gateway.serving.dispatch import Dispatcher
from meshgate.plugins.settings import Settings
from meshgate.protocols import ollama_models

NDJSON = "application/x-ndjson"


Config = NamedDependency[Settings]  # the app's ``settings`` dependency (``common.provide_settings``)
Instances = NamedDependency[InstanceManager]


def _registry(settings: Settings):
    return model_admin.registry_of(settings.data_dir)


@post("/api/show", status_code=200, dependencies=body(ollama_models.ShowRequest))
async def show(
    request: HttpRequest,
    wire: NamedDependency[ollama_models.ShowRequest],
    dispatcher: NamedDependency[Dispatcher],
    settings: Config,
) -> Response[bytes]:
    return json_response(await model_admin.show(dispatcher, _registry(settings), wire.target, may_use(request)))


@get("/api/ps")
async def ps(request: HttpRequest, dispatcher: NamedDependency[Dispatcher], instances: Instances) -> Response[bytes]:
    found = await instances.store.instances()
    return json_response(await model_admin.ps(dispatcher, found, may_use(request)))


@post("/api/copy", status_code=200, opt={"scope": "admin"}, dependencies=body(ollama_models.CopyRequest))
async def copy(
    wire: NamedDependency[ollama_models.CopyRequest], dispatcher: NamedDependency[Dispatcher], settings: Config
) -> Response[None]:
    await model_admin.copy(dispatcher, _registry(settings), wire.source, wire.destination)
    return Response(None, status_code=200)


@delete("/api/delete", status_code=200, opt={"scope": "admin"}, dependencies=body(ollama_models.DeleteRequest))
async def delete_model(
    wire: NamedDependency[ollama_models.DeleteRequest], dispatcher: NamedDependency[Dispatcher], settings: Config
) -> Response[None]:
    await model_admin.delete(dispatcher, _registry(settings), wire.target)
    return Response(None, status_code=200)


@post("/api/create", status_code=200, opt={"scope": "admin"}, dependencies=body(ollama_models.CreateRequest))
async def create(
    wire: NamedDependency[ollama_models.CreateRequest], dispatcher: NamedDependency[Dispatcher], settings: Config
) -> Response:
    lines = await model_admin.create(dispatcher, _registry(settings), wire, model_admin.model_roots(settings))
    return await _progress(lines, wire.stream)


@post("/api/pull", status_code=200, opt={"scope": "admin"}, dependencies=body(ollama_models.PullRequest))
async def pull(
    wire: NamedDependency[ollama_models.PullRequest], dispatcher: NamedDependency[Dispatcher], settings: Config
) -> Response:
    lines = await model_admin.pull(dispatcher, _registry(settings), wire.target)
    return await _progress(lines, wire.stream)


@post("/api/push", status_code=200, opt={"scope": "admin"}, dependencies=body(ollama_models.PullRequest))
async def push(request: HttpRequest, wire: NamedDependency[ollama_models.PullRequest]) -> Response[bytes]:
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
