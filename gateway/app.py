"""``create_app(settings, plugins) -> Litestar``: the gateway's HTTP surface.

Routes are thin (see ``gateway.routes``); shared resources (the HTTP client for runners, the dispatcher) are
created in the lifespan and kept on ``app.state``. Errors Litestar raises itself (unknown route, wrong method)
are rendered in the envelope of the protocol the path belongs to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
import pluggy
from litestar import Litestar, Request, Response
from litestar.exceptions import HTTPException
from litestar.openapi import OpenAPIConfig

from backends.base import Backend, ModelSource
from gateway.dispatch import Dispatcher
from gateway.routes import anthropic as anthropic_routes
from gateway.routes import ollama as ollama_routes
from gateway.routes import openai as openai_routes
from plugins.settings import Settings
from protocols import anthropic, ollama, openai
from protocols.model import GatewayError, InvalidRequest, NotFound

__all__ = ["create_app"]

log = logging.getLogger("meshgate")


def _render_for_path(request: Request, exc: Exception) -> Response[bytes]:
    """Litestar's own errors (no route, bad method) in the envelope of the path's protocol."""
    if isinstance(exc, HTTPException):
        err: GatewayError = NotFound(f"no such endpoint: {request.method} {request.url.path}") \
            if exc.status_code in (404, 405) else InvalidRequest(str(exc.detail))
    elif isinstance(exc, GatewayError):
        err = exc
    else:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        err = GatewayError(f"internal error: {type(exc).__name__}")
    path = request.url.path
    codec = ollama if path.startswith("/api") else anthropic if path.startswith("/v1/messages") else openai
    status, body = codec.error_body(err)
    if isinstance(exc, HTTPException) and exc.status_code == 405:
        status = 405
    return Response(body, status_code=status, media_type="application/json")


def create_app(settings: Settings, plugins: pluggy.PluginManager) -> Litestar:
    """The gateway app for ``settings``, with backends and model sources from ``plugins``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
                                     trust_env=False) as http:
            backends: list[Backend] = []
            sources: list[ModelSource] = []
            plugins.hook.meshgate_register_backends(register=backends.append, settings=settings, http=http)
            plugins.hook.meshgate_register_model_sources(register=sources.append, settings=settings)
            dispatcher = Dispatcher(backends, sources, plugins.hook.meshgate_choose_backend)
            cards = await asyncio.to_thread(dispatcher.refresh)
            log.info("meshgate: %d backend(s), models: %s", len(backends), ", ".join(c.name for c in cards) or "-")
            app.state.dispatcher = dispatcher
            try:
                yield
            finally:
                await dispatcher.close()

    app = Litestar(
        route_handlers=[openai_routes.router, anthropic_routes.router, ollama_routes.router],
        lifespan=[lifespan],
        exception_handlers={Exception: _render_for_path},
        openapi_config=OpenAPIConfig(title="meshgate", version="0.1.0", path="/schema"),
        debug=False,
    )
    app.state.settings = settings
    app.state.plugins = plugins
    return app
