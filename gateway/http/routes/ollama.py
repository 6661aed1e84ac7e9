"""Ollama API handlers (``/api/*`` and ``/``): NDJSON streams, ``{"error": ...}`` errors.

Model management (show, ps, copy, delete, create, pull, push) lives in ``gateway.http.routes.ollama_models`` and is
registered on this router; ``keep_alive`` is applied through ``gateway.models.admin``.

``HEAD`` answers where Ollama registers it (``/``, ``/api/version``, ``/api/tags``; tools probe a server with it):
the GET handler's status and headers, ``content-length`` included, and no body. Ollama has no ``HEAD /api/ps``
(nor on the other GET routes), so neither has meshgate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from litestar import Request as HttpRequest
from litestar import Response, Router, get, head, post
from litestar.di import NamedDependency

from meshgate.gateway.http.routes.common import (
    NDJSON,
    body,
    json_response,
    may_use,
    model_infos,
    new_meta,
    serve_generation,
)
from meshgate.gateway.http.routes.ollama_models import ROUTES as MODEL_ROUTES
from meshgate.gateway.models import admin as model_admin
from meshgate.gateway.serving.context_fit import Fit
from meshgate.gateway.serving.dispatch import Dispatcher
from meshgate.gateway.serving.streams import closing
from meshgate.protocols import ollama, ollama_embeddings, ollama_models
from meshgate.protocols.model import GatewayError, Request

log = logging.getLogger("meshgate.ollama")
VERSION = "0.13.0"  # the Ollama API version we follow; clients gate features on it


def _root() -> Response[str]:
    return Response("Ollama is running", media_type="text/plain")


def _version() -> Response[bytes]:
    return json_response(ollama.encode_version(VERSION))


def _tags(request: HttpRequest, dispatcher: Dispatcher) -> Response[bytes]:
    return json_response(ollama.encode_tags(model_infos(dispatcher, request)))


def _head(response: Response[bytes] | Response[str]) -> Response[None]:
    """The answer to ``HEAD``: ``response``'s status and headers, its length included, without its body."""
    body = response.content.encode() if isinstance(response.content, str) else response.content
    headers = {**response.headers, "content-length": str(len(body))}
    return Response(None, status_code=response.status_code, media_type=response.media_type, headers=headers)


@get("/", sync_to_thread=False, include_in_schema=False, opt={"scope": "public"})
def root() -> Response[str]:
    return _root()


@head("/", sync_to_thread=False, include_in_schema=False, opt={"scope": "public"})
def root_head() -> Response[None]:
    return _head(_root())


@get(["/api/version"], sync_to_thread=False, opt={"scope": "public"})
def version() -> Response[bytes]:
    return _version()


@head(["/api/version"], sync_to_thread=False, include_in_schema=False, opt={"scope": "public"})
def version_head() -> Response[None]:
    return _head(_version())


@get(["/api/tags"], sync_to_thread=False)
def tags(request: HttpRequest, dispatcher: NamedDependency[Dispatcher]) -> Response[bytes]:
    return _tags(request, dispatcher)


@head(["/api/tags"], sync_to_thread=False, include_in_schema=False)
def tags_head(request: HttpRequest, dispatcher: NamedDependency[Dispatcher]) -> Response[None]:
    return _head(_tags(request, dispatcher))


@post("/api/chat", status_code=200, opt={"limited": True}, dependencies=body(ollama.ChatRequest))
async def chat(
    request: HttpRequest, wire: NamedDependency[ollama.ChatRequest], dispatcher: NamedDependency[Dispatcher]
) -> Response:
    return await _run(request, dispatcher, wire, ollama.chat_to_internal(wire), chat=True)


@post("/api/generate", status_code=200, opt={"limited": True}, dependencies=body(ollama.GenerateRequest))
async def generate(
    request: HttpRequest, wire: NamedDependency[ollama.GenerateRequest], dispatcher: NamedDependency[Dispatcher]
) -> Response:
    return await _run(request, dispatcher, wire, ollama.generate_to_internal(wire), chat=False)


@post("/api/embed", status_code=200, opt={"limited": True}, dependencies=body(ollama_embeddings.EmbedBody))
async def embed(
    request: HttpRequest, wire: NamedDependency[ollama_embeddings.EmbedBody], dispatcher: NamedDependency[Dispatcher]
) -> Response:
    started = time.perf_counter_ns()
    keep_alive = ollama_models.parse_keep_alive(wire.keep_alive)
    result = await dispatcher.embed(ollama_embeddings.embed_to_internal(wire), may_use(request))
    await model_admin.apply_keep_alive(dispatcher, wire.model, keep_alive)
    return json_response(ollama_embeddings.encode_embed(result, wire.model, time.perf_counter_ns() - started))


@post("/api/embeddings", status_code=200, opt={"limited": True}, dependencies=body(ollama_embeddings.EmbeddingsBody))
async def embeddings(
    request: HttpRequest,
    wire: NamedDependency[ollama_embeddings.EmbeddingsBody],
    dispatcher: NamedDependency[Dispatcher],
) -> Response:
    keep_alive = ollama_models.parse_keep_alive(wire.keep_alive)
    result = await dispatcher.embed(ollama_embeddings.embeddings_to_internal(wire), may_use(request))
    await model_admin.apply_keep_alive(dispatcher, wire.model, keep_alive)
    return json_response(ollama_embeddings.encode_embeddings(result))


async def _run(
    request: HttpRequest,
    dispatcher: Dispatcher,
    wire: ollama.ChatRequest | ollama.GenerateRequest,
    internal: Request,
    *,
    chat: bool,
) -> Response:
    """Generate (or load/unload, OLL-17), then apply ``keep_alive`` (OLL-15) once the reply is complete."""
    meta = new_meta(internal.model)
    keep_alive = ollama_models.parse_keep_alive(wire.keep_alive)

    async def after() -> None:
        await model_admin.apply_keep_alive(dispatcher, internal.model, keep_alive)

    if refused := ollama.refuses_thinking(wire, dispatcher.capabilities(internal.model, may_use(request)).reasoning):
        raise refused
    if ollama.is_load_request(wire):
        dispatcher.resolve(internal.model, may_use(request))  # a key's model list holds for loads too
        unload = ollama.is_unload_request(wire)
        await (dispatcher.unload(internal.model) if unload else dispatcher.load(internal.model))
        if not unload:
            await after()
        return json_response(ollama.encode_load_response(internal.model, meta, unloaded=unload, chat=chat))
    # Ollama's /api/chat drops the oldest turns to fit the context unless told ``truncate: false``
    fit = Fit.DROP_OLDEST if chat and wire.truncate is not False else Fit.PROMPT
    encode = ollama.encode_chat_stream if chat else ollama.encode_generate_stream
    encode_one = ollama.encode_chat_response if chat else ollama.encode_generate_response
    response = await serve_generation(
        request,
        dispatcher,
        internal,
        fit=fit,
        clamp_output=True,
        stream=lambda events: _then(encode(events, meta), after),
        whole=lambda answer: encode_one(answer, meta),
        media_type=NDJSON,
    )
    if not internal.stream:
        await after()
    return response


async def _then(lines: AsyncIterator[bytes], after: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """``lines``, then ``after()`` when they all went out (not when the client left early)."""
    async with closing(lines):
        async for line in lines:
            yield line
    try:
        await after()
    except GatewayError as exc:  # the model went away meanwhile: nothing to keep alive
        log.warning("keep_alive not applied: %s", exc.message)


router = Router(
    path="/",
    route_handlers=[
        root,
        root_head,
        version,
        version_head,
        tags,
        tags_head,
        chat,
        generate,
        embed,
        embeddings,
        *MODEL_ROUTES,
    ],
    tags=["ollama"],
    opt={"scope": "inference"},
)
