"""What every protocol's handlers share: the dispatcher, request metadata, auth, responses."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

from litestar import Request as HttpRequest
from litestar import Response
from litestar.exceptions import HTTPException
from litestar.response import Stream

from gateway.dispatch import Dispatcher
from gateway.routes.stream import CoalescedStream
from protocols import model
from protocols.model import AuthenticationFailed, Event, GatewayError, Meta, ModelInfo, RateLimited

JSON = "application/json"


def dispatcher_of(request: HttpRequest) -> Dispatcher:
    return request.app.state.dispatcher


def new_meta(model: str) -> Meta:
    return Meta(id=uuid.uuid4().hex[:24], model=model, created=time.time())


def model_infos(dispatcher: Dispatcher) -> list[ModelInfo]:
    return [ModelInfo(name=c.name, created=c.created, size=c.size, digest=c.digest, format=c.format,
                      family=c.family, parameter_size=c.parameter_size, quantization=c.quantization,
                      context_length=c.context_length) for c in dispatcher.models()]


def _api_key(request: HttpRequest) -> str | None:
    """The key a client presents, as ``Authorization: Bearer`` or ``x-api-key``."""
    bearer = request.headers.get("authorization", "")
    return bearer[7:].strip() if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key")


def check_auth(request: HttpRequest) -> None:
    """With ``api_keys`` configured, require one as ``Authorization: Bearer`` or ``x-api-key``."""
    keys = request.app.state.settings.api_keys
    if keys and _api_key(request) not in keys:
        raise AuthenticationFailed("invalid or missing API key: pass it as 'Authorization: Bearer <key>'")


def caller_of(request: HttpRequest) -> str:
    """Who a request is from, for rate limits and the fair queue: its API key (any key a client sends while auth
    is off), else the client's address."""
    key = _api_key(request)
    return f"key:{key}" if key else f"addr:{request.client.host if request.client else '-'}"


async def admit(request: HttpRequest) -> None:
    """Auth, then the rate limit (``rate_limit`` generation requests per minute per key or client address)."""
    check_auth(request)
    limit = request.app.state.settings.rate_limit
    if not limit:
        return
    count = await request.app.state.plane.store.hit(f"requests:{caller_of(request)}", 60.0)
    if count > limit:
        raise RateLimited(f"rate limit reached: {limit} requests per minute; retry after the minute",
                          retry_after=60 - time.time() % 60)


class ClientGone(HTTPException):
    """The client disconnected before its answer was complete; no one reads the response."""

    status_code = 499  # nginx's "client closed request"


async def collect_or_cancel(request: HttpRequest, events: AsyncIterator[Event]) -> model.Response:
    """``protocols.model.collect(events)`` for a non-streaming answer, cancelled with the generation if the client
    disconnects meanwhile.

    Litestar does not cancel a handler when its client goes (a streaming response notices when a write fails), so
    the request's ASGI receive channel is watched for ``http.disconnect`` while the answer is collected; closing
    the event stream closes the runner's stream, which cancels the generation on the runner.

    Raises:
        ClientGone: the client disconnected first.
        GatewayError: as ``protocols.model.collect``.
    """
    collecting = asyncio.ensure_future(model.collect(events))
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
        if hasattr(events, "aclose"):
            await events.aclose()  # releases the runner's stream (a no-op once it ended)


async def _disconnect(request: HttpRequest) -> None:
    """Return when the client disconnects (the body was read already: nothing else comes on the channel)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def json_response(body: bytes, status: int = 200) -> Response[bytes]:
    return Response(body, status_code=status, media_type=JSON)


def stream_response(chunks: AsyncIterator[bytes], media_type: str) -> Stream:
    """A streamed 200 whose ready chunks are written together (``gateway.routes.stream``)."""
    return CoalescedStream(chunks, status_code=200, media_type=media_type,
                           headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


def error_response(exc: Exception, status: int, body: bytes) -> Response[bytes]:
    """An error body with the headers SDKs read (``retry-after`` for 429; OAI-61, ANT-48)."""
    retry_after = getattr(exc, "retry_after", None)
    headers = {"retry-after": str(max(1, round(retry_after)))} if retry_after else None
    return Response(body, status_code=status, media_type=JSON, headers=headers)


def error_handler(render: Callable[[GatewayError], tuple[int, bytes]]):
    """A Litestar exception handler that renders ``GatewayError`` in one protocol's envelope."""

    def handle(_: HttpRequest, exc: Exception) -> Response[bytes]:
        status, body = render(exc)  # type: ignore[arg-type]
        return error_response(exc, status, body)

    return handle
