"""What every protocol's handlers share: their dependencies (the request body, the dispatcher), request metadata,
auth, responses.

Handlers take their request body as ``wire``, a wire Struct provided by ``body(Struct)`` in their route's
``dependencies``: decoded with ``protocols.model.decode_body``, so a bad body is a 400 in the client's protocol's
envelope (``gateway.http.errors``) with the field to fix, and the Struct is the body in the OpenAPI schema
(``gateway.http.openapi_bodies``). The app provides ``dispatcher`` to every handler that names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from litestar import Request as HttpRequest
from litestar import Response
from litestar.datastructures import State
from litestar.di import Provide
from litestar.exceptions import HTTPException
from litestar.response import Stream

from meshgate.gateway.auth.guard import KeyRing, caller_of
from meshgate.gateway.cluster.instances import InstanceManager
from meshgate.gateway.cluster.kv_tiers import KvTiers
from meshgate.gateway.http.routes.stream import CoalescedStream
from meshgate.gateway.serving.context_fit import Fit
from meshgate.gateway.serving.dispatch import Dispatcher
from meshgate.gateway.serving.streams import aclose
from meshgate.plugins.settings import Settings
from meshgate.protocols import model
from meshgate.protocols.model import Event, Meta, ModelInfo, Priority, decode_body

JSON = "application/json"
SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


class WireBody:
    """Provides a handler's ``wire``: the request body decoded as ``struct`` (the module docstring)."""

    def __init__(self, struct: type[Any]) -> None:
        self.struct = struct

    async def __call__(self, request: HttpRequest) -> Any:
        return decode_body(await request.body(), self.struct)


def body(struct: type[Any]) -> dict[str, Provide]:
    """A route's ``dependencies`` for a handler that takes its body as ``wire: struct``."""
    return {"wire": Provide(WireBody(struct))}


def provide_dispatcher(state: State) -> Dispatcher:
    """The app's ``dispatcher`` dependency."""
    return state.dispatcher


def provide_instances(state: State) -> InstanceManager:
    """The app's ``instances`` dependency: the control plane's replicas and deployments."""
    return state.plane.instances


def provide_kv_tiers(state: State) -> KvTiers:
    """The app's ``kv_tiers`` dependency: each replica's KV tier, as its runner last reported it."""
    return state.plane.kv_tiers


def provide_keyring(state: State) -> KeyRing:
    """The app's ``keyring`` dependency: keys, scopes and limits."""
    return state.keyring


def provide_settings(state: State) -> Settings:
    """The app's ``settings`` dependency."""
    return state.settings


def model_infos(dispatcher: Dispatcher, request: HttpRequest | None = None) -> list[ModelInfo]:
    """The models to list; only those the caller's key may use when it has a list."""
    allowed = may_use(request) if request is not None else None
    return [
        ModelInfo(
            name=c.name,
            created=c.created,
            size=c.size,
            digest=c.digest,
            format=c.format,
            family=c.family,
            parameter_size=c.parameter_size,
            quantization=c.quantization,
            context_length=c.context_length,
        )
        for c in dispatcher.models()
        if allowed is None or allowed(c.name)
    ]


def who(request: HttpRequest) -> dict[str, Any]:
    """``open_stream``'s view of the caller ``gateway.auth.guard.authorize`` found: its line in the queue, the models
    its key may use, (with a token budget) where its usage is counted, and whose cached prompts it shares."""
    caller = caller_of(request)
    meter = request.app.state.keyring.meter(caller) if caller.tpm else None
    scope = caller.tenant if request.app.state.settings.kv_sharing == "tenant" else ""
    return {
        "caller": caller.bucket,
        "may_use": may_use(request),
        "on_usage": meter,
        "cache_scope": scope,
        "weight": caller.weight,
    }


def classify(request: HttpRequest, internal: model.Request) -> model.Request:
    """``internal`` with its class settled: what its protocol's ``service_tier`` asked for, else its caller's key's
    ``priority``, else the ``default_priority`` setting (``gateway.serving.admission``)."""
    if internal.priority is not model.UNSET:
        return internal
    priority = caller_of(request).priority or request.app.state.settings.default_priority
    return msgspec.structs.replace(internal, priority=priority)


def new_meta(model: str, priority: Priority | None = None) -> Meta:
    """An answer's id, model and time; ``priority``, the class it runs at, for protocols that echo it."""
    return Meta(id=uuid.uuid4().hex[:24], model=model, created=time.time(), priority=priority)


def may_use(request: HttpRequest) -> Callable[[str], bool] | None:
    """The caller's model filter (``None``: every model)."""
    caller = caller_of(request)
    return caller.may_use if caller.models else None


class ClientGone(HTTPException):
    """The client disconnected before its answer was complete; no one reads the response."""

    status_code = 499  # nginx's "client closed request"


async def collect_or_cancel(request: HttpRequest, opening: Awaitable[AsyncIterator[Event]]) -> model.Response:
    """``protocols.model.collect`` of the stream ``opening`` gives, for a non-streaming answer, cancelled if the
    client disconnects first: while the request waits for its model or its turn in the queue (it leaves the
    queue), or while the answer is generated (the generation stops).

    Litestar does not cancel a handler when its client goes (a streaming response notices when a write fails), so
    the request's ASGI receive channel is watched for ``http.disconnect`` meanwhile; closing the event stream
    closes the runner's stream, which cancels the generation on the runner.

    Raises:
        ClientGone: the client disconnected first.
        GatewayError: as ``Dispatcher.open_stream`` and ``protocols.model.collect``.
    """

    async def answer() -> model.Response:
        events = await opening
        try:
            return await model.collect(events)
        finally:
            await aclose(events)  # releases the runner's stream (a no-op once it ended)

    collecting = asyncio.ensure_future(answer())
    watching = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        if collecting.done():
            return collecting.result()
        raise ClientGone(detail="the client disconnected before the answer was complete")
    finally:
        for task in (collecting, watching):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # the task holds its exception, whose traceback holds this frame, which holds the task: without this
        # cycle break every refused request (its body, its messages) stays until a garbage collection
        del collecting, watching, task


async def _disconnect(request: HttpRequest) -> None:
    """Return when the client disconnects (the body was read already: nothing else comes on the channel)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def serve_generation(
    request: HttpRequest,
    dispatcher: Dispatcher,
    internal: model.Request,
    *,
    fit: Fit,
    stream: Callable[[AsyncIterator[Event]], AsyncIterator[bytes]],
    whole: Callable[[model.Response], bytes],
    media_type: str = SSE,
    clamp_output: bool = False,
) -> Response:
    """Every generation handler's tail: open ``internal``'s stream for the caller, then answer with ``stream``'s
    chunks (a streamed 200) when the client asked to stream, else with ``whole`` of the collected answer.

    ``fit`` is the protocol's context rule and ``clamp_output`` its output rule (``Dispatcher.open_stream``);
    ``internal``'s class is settled here unless the handler did (``classify``)."""
    internal = classify(request, internal)
    opening = dispatcher.open_stream(internal, **who(request), fit=fit, clamp_output=clamp_output)
    if internal.stream:
        events = await opening
        return stream_response(stream(events), media_type, closes=events)
    return json_response(whole(await collect_or_cancel(request, opening)))


def json_response(body: bytes, status: int = 200) -> Response[bytes]:
    return Response(body, status_code=status, media_type=JSON)


def stream_response(chunks: AsyncIterator[bytes], media_type: str, closes: AsyncIterator[Any] | None = None) -> Stream:
    """A streamed 200 whose ready chunks are written together (``gateway.http.routes.stream``); ``closes`` (the
    event stream the chunks encode) is closed when the response is done, however it ends."""
    return CoalescedStream(
        chunks,
        closes=closes,
        status_code=200,
        media_type=media_type,
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


def error_response(exc: Exception, status: int, body: bytes) -> Response[bytes]:
    """An error body with the headers SDKs read (``retry-after`` for 429; OAI-61, ANT-48)."""
    retry_after = getattr(exc, "retry_after", None)
    headers = {"retry-after": str(max(1, round(retry_after)))} if retry_after else None
    return Response(body, status_code=status, media_type=JSON, headers=headers)
