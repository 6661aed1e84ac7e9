"""A lean HTTP/1.1 client for one streamed POST to a runner: the per-token read path of every generation.

``post_stream(url, body)`` connects, sends the request and yields the response body as it arrives: each item is
everything received since the last one (so a runner that wrote several NDJSON lines at once is read in one
step). httpx reads the same stream at ~100 us of gateway CPU per chunk on this project's 2-core box (six layers
of async generators, an anyio cancel scope per read, h11 in Python); this reader parses with httptools (C, a
dependency already, uvicorn's parser) in an asyncio ``Protocol`` and costs ~30 us per chunk, which is most of
what relaying a token costs. Unary calls (health, embed, tokenize) keep httpx.

Kept small on purpose: plain ``http://`` only (runners listen on the cluster interface), one connection per
stream (``connection: close``: no pool to go stale; a loopback or LAN connect is far below a prompt's
prefill), no proxies (runners are never behind one), no redirects. The request head is written by hand
because that is what an HTTP client does; the response is parsed by httptools, never by hand.

Failures are raised as ``GatewayError``: a refused or lost connection ``BackendUnavailable`` (a peer that vanished
without closing it is found by TCP keep-alive, ``KEEPALIVE``), no connection or
no data in time ``BackendTimeout``, a malformed response ``BackendProtocolError``, a status other than 200
``BackendProtocolError`` with the start of its body; the connect's failures are mapped by
``backends.runner.errors.mapped_transport_errors``, as every runner client's are. Closing the iterator closes the
connection, which the runner sees as a disconnect (and cancels the generation).

Imports protocols and ``backends.runner.errors`` only (and httptools).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

from meshgate.backends.runner.errors import mapped_transport_errors
from meshgate.protocols.model import BackendProtocolError, BackendTimeout, BackendUnavailable

__all__ = ["post_stream"]

_HIGH_WATER = 1 << 20
"""Bytes buffered unread before the socket stops being read (a consumer that fell far behind)."""


class _Response(asyncio.Protocol):
    """One response as it arrives: body bytes buffered until taken, ``waiter`` woken on every change."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.status = 0
        self.body: list[bytes] = []
        self.buffered = 0
        self.complete = False
        self.error: BaseException | None = None
        self.closed = False
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.heard = time.monotonic()  # when data last came (the read timeout counts from it)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP connection's transport is a Transport

    def data_received(self, data: bytes) -> None:
        self.heard = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.error = BackendProtocolError("the model runner switched protocols")
        except httptools.HttpParserError as exc:
            self.error = BackendProtocolError(f"the model runner sent a malformed response: {exc}")
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self.wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.wake()

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def take(self) -> bytes:
        """Everything received and not yet taken."""
        data = self.body[0] if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class _ReadTimeout:
    """Fails ``response`` once nothing came for ``timeout`` seconds. One timer per stream, re-armed only when it
    fires early: data arriving just notes the time (no timer set and cancelled per token)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, response: _Response, timeout: float) -> None:
        self.loop, self.response, self.timeout = loop, response, timeout
        self.timer = loop.call_later(timeout, self.check)

    def check(self) -> None:
        quiet = time.monotonic() - self.response.heard
        if quiet < self.timeout:
            self.timer = self.loop.call_later(self.timeout - quiet, self.check)
            return
        self.response.error = BackendTimeout(f"the model runner sent nothing for {self.timeout:g}s (read timeout)")
        self.response.wake()

    def cancel(self) -> None:
        self.timer.cancel()


async def post_stream(
    url: str, body: bytes, *, headers: bytes = b"", connect_timeout: float = 10.0, read_timeout: float = 300.0
) -> AsyncIterator[bytes]:
    """POST ``body`` (JSON) to ``url`` and yield the 200 response's body as it arrives.

    ``headers``: extra request header lines, encoded once by the caller, each ending in ``\r\n``
    (``b"authorization: Bearer ...\r\n"``), so nothing is built per request but the head itself.

    Raises:
        BackendUnavailable: the connection was refused, failed or closed before the response was complete.
        BackendTimeout: no connection within ``connect_timeout``, or no data for ``read_timeout`` seconds.
        BackendProtocolError: a malformed response, or a status other than 200 (with its body's start).
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    loop = asyncio.get_running_loop()
    with mapped_transport_errors(connect_timeout=connect_timeout):
        transport, response = await asyncio.wait_for(loop.create_connection(_Response, host, port), connect_timeout)
    _keep_alive(transport.get_extra_info("socket"))
    response.heard = time.monotonic()
    timeout = _ReadTimeout(loop, response, read_timeout)
    try:
        authority = parts.netloc.rpartition("@")[2].encode()
        target = (parts.path or "/").encode() + (b"?" + parts.query.encode() if parts.query else b"")
        transport.write(
            b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n%s"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (target, authority, headers, len(body), body)
        )
        while True:
            if response.status and response.status != 200:
                while not (response.complete or response.closed or response.error):
                    await _wait(loop, response)
                text = response.take().decode(errors="replace")
                raise BackendProtocolError(f"runner answered {response.status}: {text[:200]}")
            if response.body:
                yield response.take()
                continue
            if response.complete:
                return
            if response.error is not None:
                raise response.error
            if response.closed:
                raise BackendUnavailable("lost the connection to the model runner: it closed mid-response")
            await _wait(loop, response)
    finally:
        timeout.cancel()
        transport.close()


KEEPALIVE = (5, 2, 3)
"""TCP keep-alive of a stream's connection: probes after 5 idle seconds, every 2 s, 3 unanswered end it. A runner
whose node vanished (its link down, its machine off) sends no FIN; the kernel then ends the connection in ~11 s
(``BackendUnavailable``, so the stream resumes elsewhere) where the read timeout would wait minutes. A busy runner
is not mistaken for a lost one: its kernel answers the probes."""


def _keep_alive(sock: socket.socket | None) -> None:
    if sock is None:
        return
    idle, interval, count = KEEPALIVE
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, option):  # Linux; macOS names the first TCP_KEEPALIVE and has the other two since 10.15
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


async def _wait(loop: asyncio.AbstractEventLoop, response: _Response) -> None:
    """Until ``response`` changes (data, its end, an error, a read timeout)."""
    waiter = response.waiter = loop.create_future()
    try:
        await waiter
    finally:
        response.waiter = None
