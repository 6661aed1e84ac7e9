"""Transport failures of every runner client, mapped to the gateway's errors in one place.

As httpx maps httpcore's exceptions in one context manager (``map_httpcore_exceptions``), every client that talks
to a runner (``backends.runner.client``, its lean stream reader ``backends.runner.http_stream``, the vLLM head's
``backends.vllm.runner``) wraps its I/O in ``mapped_transport_errors(peer)``, which raises, ``from`` the original:

- ``httpx.TimeoutException`` (connect, read, write, pool): ``BackendTimeout``, "<peer> did not answer in time
  (ReadTimeout)";
- ``httpx.NetworkError`` (connect, read, write, close) and ``httpx.RemoteProtocolError``: ``BackendUnavailable``,
  "lost the connection to <peer>: <what httpx said>";
- ``TimeoutError`` (a connect bounded with ``asyncio.wait_for``): ``BackendTimeout``, "no connection to <peer>
  within <connect_timeout>s";
- ``OSError`` (refused, reset, unreachable): ``BackendUnavailable``, "lost the connection to <peer>: <the OS
  error>".

``GatewayError`` and everything else pass through unchanged. ``peer`` names the other side in the message the
user sees ("the model runner", "vLLM"). ``secret_refused(peer)`` is the error for a runner that answers 401: the
gateway and the runner's agent disagree on the cluster secret, which is never the client's own authentication
error.

Imports protocols and httpx only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx

from meshgate.protocols.model import BackendProtocolError, BackendTimeout, BackendUnavailable

__all__ = ["mapped_transport_errors", "secret_refused"]

_RUNNER = "the model runner"  # the peer speaking the internal streaming protocol

_LOST = (httpx.NetworkError, httpx.RemoteProtocolError, OSError)


@contextlib.contextmanager
def mapped_transport_errors(peer: str = _RUNNER, *, connect_timeout: float | None = None) -> Iterator[None]:
    """Raise the transport failures inside as ``BackendTimeout`` / ``BackendUnavailable`` naming ``peer``.

    Args:
        peer: the other side, as the message names it.
        connect_timeout: the bound on a plain ``TimeoutError`` from the block (a connect under ``asyncio.wait_for``),
            for its message.

    Raises:
        BackendTimeout: an httpx timeout, or a ``TimeoutError``.
        BackendUnavailable: a lost or refused connection (an httpx network or remote protocol error, an
            ``OSError``).
    """
    try:
        yield
    except httpx.TimeoutException as exc:
        raise BackendTimeout(f"{peer} did not answer in time ({type(exc).__name__})") from exc
    except TimeoutError as exc:  # an OSError too: caught first
        within = f" within {connect_timeout:g}s" if connect_timeout is not None else " in time"
        raise BackendTimeout(f"no connection to {peer}{within}") from exc
    except _LOST as exc:
        raise BackendUnavailable(f"lost the connection to {peer}: {str(exc) or type(exc).__name__}") from exc


def secret_refused(peer: str = _RUNNER) -> BackendProtocolError:
    """The error for a runner that refused this process's cluster secret (it answered 401)."""
    return BackendProtocolError(
        f"{peer} refused this process's cluster secret (the gateway and the runner's agent "
        "disagree on MESHGATE_CLUSTER_SECRET)"
    )
