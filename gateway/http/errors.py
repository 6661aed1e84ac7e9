"""The one place that picks an error's envelope: every exception a request raises (a ``GatewayError`` from a
handler or the guard, Litestar's own 404/405/413/400, anything unexpected) is rendered here, in the shape of the
protocol the client speaks.

Which protocol: an Ollama path (``/api/...``) gets Ollama's ``{"error": ...}``; Anthropic's Messages paths, and
any request that carries ``anthropic-version`` (Anthropic's SDKs send it on every call, ``GET /v1/models``
included), get Anthropic's envelope; everything else (OpenAI's paths, the cluster and key administration) gets
OpenAI's. A client that hung up (``ClientGone``, or a body cut off) gets 499, nginx's "client closed request",
which no one reads but the request log and the metrics count apart from the client's own mistakes.
"""

from __future__ import annotations

import logging
from types import ModuleType

from litestar import Request, Response
from litestar.exceptions import HTTPException

from meshgate.gateway.http.routes.common import error_response
from meshgate.protocols import anthropic, ollama, openai
from meshgate.protocols.model import MAX_JSON_DEPTH, GatewayError, InvalidRequest, NotFound, RequestTooLarge

__all__ = ["codec_for", "render"]

log = logging.getLogger("meshgate")

_HUNG_UP = "client disconnected prematurely"  # Litestar's words when the body never fully arrives


def codec_for(path: str, headers: dict[str, str] | object) -> ModuleType:
    """The protocol codec whose error envelope a request at ``path`` with ``headers`` gets (module docstring)."""
    if path.startswith("/api"):
        return ollama
    if path.startswith("/v1/messages") or "anthropic-version" in headers:  # type: ignore[operator]
        return anthropic
    return openai


def render(request: Request, exc: Exception) -> Response[bytes]:
    """``exc`` as the client's protocol's error response (the app's one exception handler)."""
    override = None
    if isinstance(exc, HTTPException):
        if exc.status_code == 499 or exc.detail == _HUNG_UP:
            err: GatewayError = InvalidRequest(f"the client went away: {exc.detail}")
            override = 499
        elif exc.status_code in (404, 405):
            err = NotFound(f"no such endpoint: {request.method} {request.url.path}")
        elif exc.status_code == 413:
            limit = request.app.state.settings.max_body_bytes
            err = RequestTooLarge(
                f"the request body is larger than {limit:,} bytes; send less (or raise MESHGATE_MAX_BODY_BYTES)"
            )
        else:
            err = InvalidRequest(str(exc.detail))
        if exc.status_code == 405:
            override = 405
    elif isinstance(exc, GatewayError):
        err = exc
    elif isinstance(exc, RecursionError):  # a body Litestar decodes itself (``data:``), nested past the stack
        err = InvalidRequest(f"request body nests JSON too deeply; at most {MAX_JSON_DEPTH} levels are allowed")
    else:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        err = GatewayError(f"internal error: {type(exc).__name__}")
    status, body = codec_for(request.url.path, request.headers).error_body(err)
    return error_response(err, override or status, body)
