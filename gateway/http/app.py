"""``create_app(settings, plugins) -> Litestar``: the gateway's HTTP surface.

Routes are thin (see ``gateway.http.routes``); shared resources (the HTTP client for runners, the dispatcher) are
created in the lifespan and kept on ``app.state``. Every error, Litestar's own (unknown route, wrong method)
included, is rendered by ``gateway.http.errors`` in the envelope of the client's protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pluggy
from litestar import Litestar
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from meshgate.gateway.auth.guard import KeyRing, authorize
from meshgate.gateway.auth.keys import open_accounts
from meshgate.gateway.http import errors
from meshgate.gateway.http.openapi_bodies import describe_request_bodies
from meshgate.gateway.http.routes import anthropic as anthropic_routes
from meshgate.gateway.http.routes import batches as batch_routes
from meshgate.gateway.http.routes import cluster as cluster_routes
from meshgate.gateway.http.routes import keys as key_routes
from meshgate.gateway.http.routes import message_batches as message_batch_routes
from meshgate.gateway.http.routes import ollama as ollama_routes
from meshgate.gateway.http.routes import openai as openai_routes
from meshgate.gateway.http.routes import ui as ui_routes
from meshgate.gateway.http.routes.common import (
    provide_dispatcher,
    provide_instances,
    provide_keyring,
    provide_kv_tiers,
    provide_settings,
)
from meshgate.gateway.http.runtime import control_plane
from meshgate.gateway.telemetry import route as metrics_route
from meshgate.gateway.telemetry.metrics import GatewayMetrics
from meshgate.gateway.telemetry.middleware import RequestTelemetry
from meshgate.plugins.settings import Settings

__all__ = ["create_app"]

log = logging.getLogger("meshgate")


def create_app(settings: Settings, plugins: pluggy.PluginManager, *, worker: int | None = None) -> Litestar:
    """The gateway app for ``settings``, with backends and model sources from ``plugins``; ``worker``: its index
    among ``serve --workers`` (labels its metrics and request log lines), ``None`` for a gateway of its own."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        embedded_agent = not settings.redis
        async with control_plane(settings, plugins, gateway=True, agent=embedded_agent) as plane:
            log.info(
                "meshgate: %d backend(s), models: %s; state in %s",
                len(plane.backends),
                ", ".join(c.name for c in plane.catalog.models()) or "-",
                "redis" if settings.redis else "memory (embedded agent)",
            )
            app.state.dispatcher = plane.dispatcher
            app.state.plane = plane
            if plane.batch_worker is not None:  # batch lines are logged and counted as requests
                plane.batch_worker.report = app.state.telemetry.add
            accounts = open_accounts(settings.redis, settings.data_dir, timeout=settings.store_timeout)
            app.state.keyring = KeyRing(accounts, settings.api_keys, settings.rate_limit)
            keeping = asyncio.create_task(app.state.keyring.keep_seal(), name="keep-seal")
            try:
                yield
            finally:
                keeping.cancel()
                app.state.telemetry.flush()  # the last requests' lines and counts
                await accounts.close()

    app = Litestar(
        route_handlers=[
            openai_routes.router,
            anthropic_routes.router,
            batch_routes.router,  # OpenAI's /v1/files and /v1/batches
            message_batch_routes.router,  # Anthropic's /v1/messages/batches
            ollama_routes.router,
            cluster_routes.router,
            key_routes.router,
            ui_routes.router,  # the dashboard at /ui (static, public; it sends an admin key itself)
            *([metrics_route.metrics] if settings.metrics else []),  # GET /metrics (admin scope)
        ],
        dependencies={
            "dispatcher": Provide(provide_dispatcher, sync_to_thread=False),
            "instances": Provide(provide_instances, sync_to_thread=False),
            "keyring": Provide(provide_keyring, sync_to_thread=False),
            "kv_tiers": Provide(provide_kv_tiers, sync_to_thread=False),
            "settings": Provide(provide_settings, sync_to_thread=False),
        },
        guards=[authorize],  # every route: its scope (admin unless it says otherwise) and limits (gateway.auth.guard)
        lifespan=[lifespan],
        exception_handlers={Exception: errors.render},  # every error, in the client's protocol's envelope
        openapi_config=OpenAPIConfig(title="meshgate", version="0.1.0", path="/schema"),
        request_max_body_size=settings.max_body_bytes,
        logging_config=None,  # the process's logging is gateway.cli.commands's (text or JSON, gateway.telemetry.logs)
        debug=False,
    )
    describe_request_bodies(app.openapi_schema)  # bodies are decoded by a dependency: Litestar cannot see their Structs
    app.state.settings = settings
    app.state.plugins = plugins
    # every response carries its request id (``x-request-id`` for OpenAI SDKs, ``request-id`` for Anthropic's);
    # each request is logged and counted (gateway.telemetry), its own registry per app
    app.state.metrics = GatewayMetrics(worker=worker) if settings.metrics else None
    app.state.telemetry = RequestTelemetry(app.asgi_handler, app.state, app.state.metrics, worker=worker)
    app.asgi_handler = app.state.telemetry
    return app
