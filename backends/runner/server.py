"""Serve an ``Engine`` over the internal streaming protocol: a small ASGI app, run by uvicorn in the runner.

The engine is synchronous (llama.cpp and MLX generate on a thread). An engine with ``parallel`` > 1 batches
requests itself: up to ``parallel`` generations run at once, each ``generate`` on its own thread (more wait here,
first come first served), or, for an engine that pushes its streams (``open_stream``: llama.cpp), read on this
event loop with one wake per decode step for all of them (``pushed``); other engines run one generation at a
time. A client that disconnects sets the request's cancel flag, so the runtime stops at its next token. Events go
out as NDJSON lines, as many in one chunk as the engine has ready, so a fast engine costs one write per batch of
events, not one per token.

``POST /embed`` takes an ``EmbedRequest`` and answers ``Embeddings`` (200), or ``{"error": ErrorInfo}`` with the
error's status; a client that disconnects (or times out) sets its cancel flag too. ``POST /tokenize`` takes a
``Request`` and answers ``{"count": n}``: the prompt's tokens as the model reads it (chat template, system text,
tools). An engine without ``embed`` or ``count_tokens`` answers ``UnsupportedFeature``. For a batching engine
these run beside the generations (the gateway counts a prompt before it queues it); for others, under the same
one-job lock.

Every endpoint, ``/health`` included, answers only callers presenting the cluster secret (``backends.runner.secret``:
``authorization: Bearer <secret>`` or ``x-meshgate-secret``); anything else gets 401 with
``{"error": ErrorInfo}`` before its body is read, and nothing runs. ``serve`` takes the secret from the runner's
environment (``MESHGATE_RUNNER_SECRET``, set by ``RunnerProcess.start``).

Imports protocols only; no web framework (a raw ASGI app keeps the runner light).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import msgspec

from meshgate.backends.runner import kv_routes
from meshgate.backends.runner import secret as cluster_secret
from meshgate.backends.runner.asgi import read_body
from meshgate.backends.runner.net import family
from meshgate.backends.runner.pushed import Waker, run_pushed
from meshgate.protocols.model import (
    TERMINAL,
    AuthenticationFailed,
    BackendProtocolError,
    Embeddings,
    EmbedRequest,
    Event,
    Failed,
    GatewayError,
    InvalidRequest,
    Request,
    UnsupportedFeature,
)

__all__ = ["EmbeddingEngine", "Engine", "RunnerApp", "exit_when_parent_goes", "serve"]

READY_LINE = "MESHGATE_RUNNER_READY"
FAILED_LINE = "MESHGATE_RUNNER_FAILED"
_encoder = msgspec.json.Encoder()
_request_decoder = msgspec.json.Decoder(Request)
_embed_decoder = msgspec.json.Decoder(EmbedRequest)


class Engine(Protocol):
    """A loaded model that generates events synchronously."""

    def generate(self, request: Request, cancel: threading.Event) -> Iterator[Event]:
        """Yield events for ``request``; stop early when ``cancel`` is set. May raise ``GatewayError``."""
        ...

    def health(self) -> dict[str, Any]:
        """Facts about the loaded model for ``GET /health``."""
        ...


class EmbeddingEngine(Engine, Protocol):
    """An engine that also embeds (optional: ``RunnerApp`` checks for ``embed``)."""

    def embed(self, request: EmbedRequest, cancel: threading.Event) -> Embeddings:
        """One unit vector per input; may raise ``GatewayError``; may stop early (raising) once ``cancel`` is set.

        Runs on a thread, never beside ``generate``.
        """
        ...


_UNAUTHORIZED = _encoder.encode(
    {"error": AuthenticationFailed("this runner answers only its cluster: missing or wrong cluster secret").info()}
)


class RunnerApp:
    """ASGI app serving one engine; with ``secret``, only to callers that present it (``None``: to anyone)."""

    def __init__(self, engine: Engine, secret: bytes | None = None) -> None:
        self.engine = engine
        self.secret = secret
        self.parallel = max(1, int(getattr(engine, "parallel", 1) or 1))
        self._busy = asyncio.Semaphore(self.parallel)
        self._unary_busy = self._busy if self.parallel == 1 else contextlib.nullcontext()
        self.stats = {"active": 0, "finished": 0, "cancelled": 0}  # requests, as the server sees them
        self._waker: Waker | None = None  # for an engine that pushes its streams (``pushed``), made on the loop

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return  # a websocket: closed unaccepted
        if not cluster_secret.authorized_asgi(self.secret, scope.get("headers", ())):
            await _respond(send, 401, _UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
            return
        path, method = scope["path"], scope["method"]
        if path == "/health" and method == "GET":
            await _respond(send, 200, _encoder.encode({**self.engine.health(), **self.stats}))
        elif path == "/generate" and method == "POST":
            await self._generate(receive, send)
        elif path == "/embed" and method == "POST":
            await self._unary(receive, send, _embed_decoder, "embed", "compute embeddings")
        elif path == "/tokenize" and method == "POST":
            await self._unary(receive, send, _request_decoder, "count_tokens", "count tokens")
        elif path.startswith("/kv/") and getattr(self.engine, "tier", None) is not None:
            await kv_routes.serve(self.engine, path, method, receive, send)
        else:
            await _respond(send, 404, b'{"error":"not found"}')

    async def _generate(self, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        body = await read_body(receive)
        try:
            request = _request_decoder.decode(body)
        except (msgspec.MsgspecError, RecursionError) as exc:  # RecursionError: JSON nested too deeply
            await _respond(send, 400, _encoder.encode({"error": f"bad request: {exc}"}))
            return
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-ndjson")]}
        )
        cancel = threading.Event()
        watcher = asyncio.ensure_future(_wait_disconnect(receive, cancel))
        try:
            async with self._busy:
                self.stats["active"] += 1
                ended = False
                try:
                    if hasattr(self.engine, "open_stream"):
                        if self._waker is None:
                            interval = float(getattr(self.engine, "stream_interval", 0.0))
                            self._waker = Waker(asyncio.get_running_loop(), interval)
                        source = run_pushed(self.engine, request, cancel, self._waker)
                    else:
                        source = _run_in_thread(self.engine, request, cancel)
                    async for events in source:
                        if cancel.is_set():
                            break
                        body = b"".join([_encoder.encode(event) + b"\n" for event in events])
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                        ended = isinstance(events[-1], TERMINAL)
                finally:
                    self.stats["active"] -= 1
                    self.stats["finished" if ended else "cancelled"] += 1
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            cancel.set()
            watcher.cancel()

    async def _unary(
        self,
        receive: Callable[..., Any],
        send: Callable[..., Any],
        decoder: msgspec.json.Decoder,
        method: str,
        what: str,
    ) -> None:
        """One request in, one JSON answer out, run by ``engine.<method>(request, cancel)`` on a thread under
        the runner's one-job lock; errors as ``{"error": ErrorInfo}`` with their status."""
        body = await read_body(receive)
        try:
            try:
                request = decoder.decode(body)
            except (msgspec.MsgspecError, RecursionError) as exc:
                raise InvalidRequest(f"bad {method} request: {exc}") from exc
            call = getattr(self.engine, method, None)
            if call is None:
                raise UnsupportedFeature(f"this runner's engine does not {what}")
            cancel = threading.Event()
            watcher = asyncio.ensure_future(_wait_disconnect(receive, cancel))
            try:
                async with self._unary_busy:
                    result = await asyncio.to_thread(_call_engine, call, request, cancel)
            finally:
                cancel.set()
                watcher.cancel()
        except GatewayError as exc:
            await _respond(send, exc.status, _encoder.encode({"error": exc.info()}))
            return
        await _respond(send, 200, _encoder.encode(result))


def _call_engine(call: Callable[[Any, threading.Event], Any], request: Any, cancel: threading.Event) -> Any:
    """Run an engine call, mapping the runtime's own exceptions as ``_run_in_thread`` does."""
    try:
        return call(request, cancel)
    except GatewayError:
        raise
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    except Exception as exc:  # the runtime's own failure: report it, keep the runner serving
        raise GatewayError(repr(exc)) from exc


async def _run_in_thread(engine: Engine, request: Request, cancel: threading.Event):
    """Run the engine's generator on a thread, handing events over through a queue; yields lists of the events
    ready at once, the last list ending terminal."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event | None] = asyncio.Queue()

    def produce() -> None:
        ended = False
        try:
            for event in engine.generate(request, cancel):
                loop.call_soon_threadsafe(queue.put_nowait, event)
                if isinstance(event, TERMINAL):
                    ended = True
                    break
            if not ended:
                err: GatewayError = BackendProtocolError("the engine stopped without finishing")
                loop.call_soon_threadsafe(queue.put_nowait, Failed(error=err.info()))
        except GatewayError as exc:
            loop.call_soon_threadsafe(queue.put_nowait, Failed(error=exc.info()))
        except Exception as exc:  # the runtime's own failure: report it, keep the runner serving
            wrapped = InvalidRequest(str(exc)) if isinstance(exc, ValueError) else GatewayError(repr(exc))
            loop.call_soon_threadsafe(queue.put_nowait, Failed(error=wrapped.info()))
        finally:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    thread = threading.Thread(target=produce, name="engine", daemon=True)
    thread.start()
    try:
        while True:
            ready = [await queue.get()]
            while not queue.empty():
                ready.append(queue.get_nowait())
            if ready[-1] is None:
                if len(ready) > 1:
                    yield ready[:-1]
                return
            yield ready
    finally:
        cancel.set()
        await asyncio.to_thread(thread.join)


async def _wait_disconnect(receive: Callable[..., Any], cancel: threading.Event) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            cancel.set()
            return


async def _respond(
    send: Callable[..., Any], status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *(headers or ())],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def exit_when_parent_goes() -> None:
    """The gateway holds our stdin open; EOF means it is gone, so no runner outlives its gateway."""
    with contextlib.suppress(Exception):
        while sys.stdin.buffer.read(1024):
            pass
    os._exit(0)


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 0, *, watch_parent: bool = True) -> None:
    """Serve ``engine`` on ``host:port`` (0 picks a free port) and print the ready line with the real port; only
    to callers with the secret in ``MESHGATE_RUNNER_SECRET`` (to anyone, with a warning, when it is unset).

    ``watch_parent``: exit when stdin closes (the runner's own ``main`` may watch it already)."""
    import uvicorn

    secret = cluster_secret.from_environ()
    if secret is None:
        print(
            f"meshgate runner: {cluster_secret.ENV} is not set: serving without authentication",
            file=sys.stderr,
            flush=True,
        )
    sock = socket.socket(family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(64)
    if watch_parent:
        threading.Thread(target=exit_when_parent_goes, name="parent-watch", daemon=True).start()
    print(f"{READY_LINE} port={sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(RunnerApp(engine, secret), log_level="warning", access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])
