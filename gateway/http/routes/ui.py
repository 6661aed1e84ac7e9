"""The dashboard at ``/ui``: a static page (HTML, vanilla JS modules, CSS) shipped in ``gateway/http/ui/``.

Not at ``/``: Ollama clients probe that. There is no build step and nothing is fetched from elsewhere at run
time; the Content-Security-Policy below lets the page load and call only this gateway. The files are public
(``scope: public``); the page asks for an admin key, keeps it in ``sessionStorage`` and sends it on every call
to the admin API (``/cluster``, ``/instances``, ``/events``, ``/metrics``), reading the server-sent streams
with ``fetch`` because ``EventSource`` cannot send headers. The cluster map and the load charts are SVG that the
page builds itself (``cluster_map.js``, ``load_chart.js``), coloured from the stylesheet, so the policy needs no
inline styles and no other origin. Served by Litestar's static-files router (it resolves paths inside the folder
and sets types and ETags).

Imports only Litestar and the standard library.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from litestar import Request, Response
from litestar.datastructures import CacheControlHeader
from litestar.exceptions import NotFoundException
from litestar.static_files import create_static_files_router

__all__ = ["UI_DIR", "router"]

UI_DIR = Path(__file__).resolve().parent.parent / "ui"
"""``gateway/ui`` in a checkout, ``meshgate/gateway/ui`` once installed (package data in ``pyproject.toml``)."""

_SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


_SERVED = {"", ".html", ".js", ".css"}
"""What the folder serves: the page and its assets (``""``: ``/ui`` itself), not ``__init__.py`` or bytecode."""


async def _assets_only(request: Request) -> None:
    if PurePosixPath(str(request.path_params.get("file_path", ""))).suffix not in _SERVED:
        raise NotFoundException()


async def _secure(response: Response) -> Response:
    response.headers.update(_SECURITY_HEADERS)
    return response


router = create_static_files_router(
    path="/ui",
    directories=[UI_DIR],
    html_mode=True,  # /ui and /ui/ answer index.html
    name="ui",
    before_request=_assets_only,
    after_request=_secure,
    cache_control=CacheControlHeader(no_cache=True),  # revalidate (ETag): a new version shows at once
    opt={"scope": "public"},
    tags=["dashboard"],
)
