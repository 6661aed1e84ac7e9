"""Ollama API handlers (``/api/*`` and ``/``): NDJSON streams, ``{"error": ...}`` errors."""

from __future__ import annotations

import time

from litestar import Request as HttpRequest
from litestar import Response, Router, get, head, post

from gateway.routes.common import (
    admit,
    dispatcher_of,
    error_handler,
    json_response,
    model_infos,
    new_meta,
    stream_response,
)
from protocols import ollama, ollama_embeddings
from protocols.model import GatewayError, collect, decode_body

NDJSON = "application/x-ndjson"
VERSION = "0.13.0"  # the Ollama API version we follow; clients gate features on it


@get("/", sync_to_thread=False, include_in_schema=False)
def root() -> Response[str]:
    return Response("Ollama is running", media_type="text/plain")


@head("/", sync_to_thread=False, include_in_schema=False)
def root_head() -> Response[None]:
    return Response(None, media_type="text/plain")


@get(["/api/version"], sync_to_thread=False)
def version() -> Response[bytes]:
    return json_response(ollama.encode_version(VERSION))


@get(["/api/tags"], sync_to_thread=False)
def tags(request: HttpRequest) -> Response[bytes]:
    return json_response(ollama.encode_tags(model_infos(dispatcher_of(request))))


@post("/api/chat", status_code=200)
async def chat(request: HttpRequest) -> Response:
    await admit(request)
    wire = decode_body(await request.body(), ollama.ChatRequest)
    return await _run(request, wire, ollama.chat_to_internal(wire), chat=True)


@post("/api/generate", status_code=200)
async def generate(request: HttpRequest) -> Response:
    await admit(request)
    wire = decode_body(await request.body(), ollama.GenerateRequest)
    return await _run(request, wire, ollama.generate_to_internal(wire), chat=False)


@post("/api/embed", status_code=200)
async def embed(request: HttpRequest) -> Response:
    await admit(request)
    started = time.perf_counter_ns()
    wire = decode_body(await request.body(), ollama_embeddings.EmbedBody)
    result = await dispatcher_of(request).embed(ollama_embeddings.embed_to_internal(wire))
    return json_response(ollama_embeddings.encode_embed(result, wire.model, time.perf_counter_ns() - started))


@post("/api/embeddings", status_code=200)
async def embeddings(request: HttpRequest) -> Response:
    await admit(request)
    wire = decode_body(await request.body(), ollama_embeddings.EmbeddingsBody)
    result = await dispatcher_of(request).embed(ollama_embeddings.embeddings_to_internal(wire))
    return json_response(ollama_embeddings.encode_embeddings(result))


async def _run(request: HttpRequest, wire, internal, *, chat: bool) -> Response:
    dispatcher = dispatcher_of(request)
    meta = new_meta(internal.model)
    if ollama.is_load_request(wire):
        unload = ollama.is_unload_request(wire)
        await (dispatcher.unload(internal.model) if unload else dispatcher.load(internal.model))
        return json_response(ollama.encode_load_response(internal.model, meta, unloaded=unload, chat=chat))
    events = await dispatcher.open_stream(internal)
    if internal.stream:
        encode = ollama.encode_chat_stream if chat else ollama.encode_generate_stream
        return stream_response(encode(events, meta), NDJSON)
    encode_one = ollama.encode_chat_response if chat else ollama.encode_generate_response
    return json_response(encode_one(await collect(events), meta))


router = Router(
    path="/",
    route_handlers=[root, root_head, version, tags, chat, generate, embed, embeddings],
    exception_handlers={GatewayError: error_handler(ollama.error_body)},
    tags=["ollama"],
)
