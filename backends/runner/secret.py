"""The cluster secret: what runner processes demand of every caller, and how callers present it.

Every HTTP endpoint a runner process serves (``server``: ``/generate``, ``/tokenize``, ``/embed``, ``/health``; the
``control`` endpoints of MLX followers and Ray node keepers) answers only a request that carries the cluster's
secret as ``authorization: Bearer <secret>`` or ``x-meshgate-secret: <secret>``; anything else gets a 401 and runs
nothing. Compared with ``hmac.compare_digest``.

How it travels:

- The control plane (``gateway.http.runtime``) learns the cluster's secret (the operator's
  ``MESHGATE_CLUSTER_SECRET``, else the one the state store keeps, else this process's random one) and calls
  ``use(secret)`` once at start; ``current()`` is that value, or a random one made once per process when nobody
  called ``use`` (so a test that launches and connects in one process still matches itself).
- ``RunnerProcess.start`` puts it in the runner's environment as ``MESHGATE_RUNNER_SECRET`` (``child_env()``),
  never in argv: ``ps`` shows argv to every user, ``/proc/<pid>/environ`` only to the same user. The runner reads it
  back with ``from_environ()``. A runner started by hand without it serves openly and says so on stderr.
- Clients (``RunnerClient``, the MLX and vLLM backends' calls) send ``headers()``.

Why a value per process, when STYLE 8 asks to pass things down: the secret belongs to the cluster and a process
serves one cluster; ``Backend.launch`` and ``Backend.connect`` have no place for it, and with it here every
backend, built in or a plugin's, that starts runners with ``RunnerProcess`` and reads them with ``RunnerClient`` is
covered without having to remember it.

Imports the standard library only (runner processes import it too).
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Iterable

__all__ = ["ENV", "HEADER", "authorized", "authorized_asgi", "child_env", "current", "from_environ", "headers", "use"]

ENV = "MESHGATE_RUNNER_SECRET"
"""The environment variable a runner process reads its secret from."""
HEADER = "x-meshgate-secret"
"""The header that may carry the secret instead of ``authorization: Bearer``."""

_current: str | None = None


def use(secret: str) -> None:
    """Make ``secret`` the one this process gives the runners it starts and presents to every runner it calls."""
    global _current
    if not secret or not secret.isascii() or not secret.isprintable() or any(c.isspace() for c in secret):
        raise ValueError("the cluster secret must be printable ASCII without spaces (it travels in a header)")
    _current = secret


def current() -> str:
    """The secret set by ``use``; else a random one, made once per process."""
    global _current
    if _current is None:
        _current = secrets.token_urlsafe(32)
    return _current


def headers() -> dict[str, str]:
    """The header to send a runner (or a node agent)."""
    return {"authorization": f"Bearer {current()}"}


def child_env() -> dict[str, str]:
    """What goes in a started runner's environment."""
    return {ENV: current()}


def from_environ() -> bytes | None:
    """A runner's secret, from its environment (``None``: started without one)."""
    value = os.environ.get(ENV)
    return value.encode() if value else None


def authorized(expected: bytes | None, authorization: bytes | None, direct: bytes | None) -> bool:
    """Whether a request that sent these headers may proceed (always, when ``expected`` is ``None``).

    ``authorization`` is the ``authorization`` header (``Bearer <secret>``), ``direct`` the ``x-meshgate-secret``
    one; either may be missing.
    """
    if expected is None:
        return True
    token = direct
    if token is None and authorization is not None:
        scheme, _, value = authorization.strip().partition(b" ")
        if scheme.lower() == b"bearer":
            token = value.strip()
    return token is not None and hmac.compare_digest(token, expected)


def authorized_asgi(expected: bytes | None, raw_headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """``authorized`` for an ASGI scope's ``headers`` (names are lower case there)."""
    if expected is None:
        return True
    authorization = direct = None
    for name, value in raw_headers:
        if name == b"authorization":
            authorization = value
        elif name == b"x-meshgate-secret":
            direct = value
    return authorized(expected, authorization, direct)
