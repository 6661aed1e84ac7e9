"""What every protocol's handlers share: the dispatcher, request metadata, auth, responses."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from litestar import Request as HttpRequest
from litestar import Response
from litestar.response import Stream

from gateway.dispatch import Dispatcher
from protocols.model import AuthenticationFailed, GatewayError, Meta, ModelInfo, RateLimited

JSON = "application/json"


def dispatcher_of(request: HttpRequest) -> Dispatcher:
    return request.app.state.dispatcher


def new_meta(model: str) -> Meta:
    return Meta(id=uuid.uuid4().hex[:24], model=model, created=time.time())


def model_infos(dispatcher: Dispatcher) -> list[ModelInfo]:
    return [ModelInfo(name=c.name, created=c.created, size=c.size, digest=c.digest, format=c.format,
                      family=c.family, parameter_size=c.parameter_size, quantization=c.quantization,
                      context_length=c.context_length) for c in dispatcher.models()]


def check_auth(request: HttpRequest) -> None:
    """With ``api_keys`` configured, require one as ``Authorization: Bearer`` or ``x-api-key``."""
    keys = request.app.state.settings.api_keys
    if not keys:
        return
    bearer = request.headers.get("authorization", "")
    given = bearer[7:].strip() if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key")
    if given not in keys:
        raise AuthenticationFailed("invalid or missing API key: pass it as 'Authorization: Bearer <key>'")


async def admit(request: HttpRequest) -> None:
    """Auth, then the rate limit (``rate_limit`` generation requests per minute per key or client address)."""
    check_auth(request)
    limit = request.app.state.settings.rate_limit
    if not limit:
        return
    bearer = request.headers.get("authorization", "")
    who = bearer[7:].strip() or request.headers.get("x-api-key") or (request.client.host if request.client else "-")
    count = await request.app.state.plane.store.hit(f"requests:{who}", 60.0)
    if count > limit:
        raise RateLimited(f"rate limit reached: {limit} requests per minute; retry after the minute",
                          retry_after=60 - time.time() % 60)


def json_response(body: bytes, status: int = 200) -> Response[bytes]:
    return Response(body, status_code=status, media_type=JSON)


def stream_response(chunks: AsyncIterator[bytes], media_type: str) -> Stream:
    return Stream(chunks, status_code=200, media_type=media_type, headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


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
