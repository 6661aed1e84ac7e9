"""A tiny JSON control endpoint on the standard library, for processes that must answer before (or beside) their
runtime: an MLX follower waiting to be joined into a ring, a Ray node keeper waiting for its head.

``JsonHandler`` is a ``BaseHTTPRequestHandler`` with ``reply(status, body)`` and ``body()``, and no access log;
``serve_control(host, port, handler)`` binds it (IPv4 or IPv6 by the address) and serves it on a daemon thread.
Like a runner's own server, it answers only callers presenting the cluster secret of this process's environment
(``backends.runner.secret``): others get 401 before any ``do_*`` method runs.

Imports only the standard library.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from meshgate.backends.runner import secret as cluster_secret
from meshgate.backends.runner.net import family

__all__ = ["JsonHandler", "serve_control"]


class JsonHandler(BaseHTTPRequestHandler):
    """Subclass with ``do_GET``/``do_POST``; answer with ``self.reply``."""

    secret: bytes | None = None
    """What callers must present (``serve_control`` sets it); ``None``: anyone may call."""

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if not cluster_secret.authorized(
            self.secret, _raw(self.headers.get("authorization")), _raw(self.headers.get(cluster_secret.HEADER))
        ):
            self.close_connection = True  # its body is never read
            self.reply(401, {"error": "missing or wrong cluster secret"})
            return False
        return True

    def body(self) -> Any:
        """The request's JSON body (raises ``ValueError`` when it is not JSON)."""
        return json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"null")

    def reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def serve_control(host: str, port: int, handler: type[JsonHandler], name: str) -> ThreadingHTTPServer:
    """Serve ``handler`` on ``host:port`` (0: a free port, see ``server_address``) on a daemon thread, to callers
    with the secret in ``MESHGATE_RUNNER_SECRET`` (to anyone when it is unset)."""
    server_class = type(
        "ControlServer", (ThreadingHTTPServer,), {"address_family": family(host), "daemon_threads": True}
    )
    guarded = type(handler.__name__, (handler,), {"secret": cluster_secret.from_environ()})
    server = server_class((host, port), guarded)
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


def _raw(value: str | None) -> bytes | None:
    """A header as ``http.server`` decoded it (latin-1), back to its bytes."""
    return None if value is None else value.encode("latin-1", errors="replace")
