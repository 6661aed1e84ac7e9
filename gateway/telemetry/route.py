"""``GET /metrics``: the gateway's metrics in Prometheus text format (OpenMetrics when the scraper asks for it).

Admin scope, as every route that says nothing (``gateway.auth.guard``): with keys configured the scraper presents an
admin key (``authorization: Bearer``); without keys it is open, as every route is. Not in the OpenAPI schema.
"""

from __future__ import annotations

from litestar import Request, Response, get

from meshgate.gateway.telemetry.instruments import exposition
from meshgate.gateway.telemetry.metrics import GatewayMetrics

__all__ = ["metrics"]


@get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response[bytes]:
    collected: GatewayMetrics = request.app.state.metrics
    request.app.state.telemetry.flush()  # requests finished since the last report
    await collected.refresh(getattr(request.app.state, "plane", None))  # a ``Snapshots``: the control plane
    body, content_type = exposition(collected.registry, request.headers.get("accept", ""))
    if content_type.startswith("text/"):  # Litestar appends the charset to text types itself
        content_type = content_type.replace("; charset=utf-8", "")
    return Response(body, media_type=content_type)
