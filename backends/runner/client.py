"""Read the internal streaming protocol: send a ``Request`` to a runner, get its events back.

A generation is read with ``backends.runner.http_stream.post_stream`` (the per-token path, kept lean), the unary
calls with the shared httpx client. Transport failures become ``Failed`` events (never raised): a refused
connection or a runner that dies mid-stream is ``BackendUnavailable``, a stalled one ``BackendTimeout``, garbage
``BackendProtocolError``. Closing the iterator closes the connection, which cancels the generation.
``embed`` is a plain request: the same failures are raised, and a runner's ``{"error": ErrorInfo}`` answer is
raised as the ``GatewayError`` it names. Transport failures are mapped by ``backends.runner.errors``, once for
every runner client. Every call presents the cluster secret (``backends.runner.secret``); a runner that refuses it
(401: the two ended up with different secrets) is a ``BackendProtocolError``, never the client's own
authentication error.

Imports protocols and ``backends.runner`` only.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
import msgspec

from meshgate.backends.runner import secret as cluster_secret
from meshgate.backends.runner.errors import mapped_transport_errors, secret_refused
from meshgate.backends.runner.http_stream import post_stream
from meshgate.protocols.model import (
    TERMINAL,
    BackendProtocolError,
    BackendUnavailable,
    Embeddings,
    EmbedRequest,
    ErrorInfo,
    Event,
    Failed,
    GatewayError,
    Request,
    error_from_info,
)

__all__ = ["RunnerClient"]

_event_decoder = msgspec.json.Decoder(Event)
_embeddings_decoder = msgspec.json.Decoder(Embeddings)
_encoder = msgspec.json.Encoder()


class _ErrorBody(msgspec.Struct):
    """A runner's error answer: ``{"error": ErrorInfo}``."""

    error: ErrorInfo


_error_decoder = msgspec.json.Decoder(_ErrorBody)


class RunnerClient:
    """Talks to one runner at ``base_url`` over a shared ``httpx.AsyncClient``, presenting ``secret`` (by default
    this process's cluster secret, ``backends.runner.secret.current()``)."""

    def __init__(
        self, base_url: str, http: httpx.AsyncClient, *, read_timeout: float = 300.0, secret: str | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = http
        self.timeout = httpx.Timeout(10.0, read=read_timeout)
        token = secret or cluster_secret.current()
        self.headers = {"authorization": f"Bearer {token}"}
        self._stream_headers = b"authorization: Bearer %s\r\n" % token.encode()  # built once, not per generation

    async def health(self) -> dict[str, object]:
        response = await self.http.get(f"{self.base_url}/health", headers=self.headers, timeout=5.0)
        response.raise_for_status()
        return response.json()

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        """Stream ``request``'s events; always ends in exactly one ``Finished`` or ``Failed``.

        Read with ``post_stream`` (not httpx: this is the per-token path). The events of every line that came in
        one read are yielded back to back, with no wait between them, so whoever relays them can write them out
        together.
        """
        pending = b""
        try:
            async with contextlib.aclosing(  # type: ignore[type-var]  # post_stream is an async generator
                post_stream(
                    f"{self.base_url}/generate",
                    _encoder.encode(request),
                    headers=self._stream_headers,
                    connect_timeout=self.timeout.connect or 10.0,
                    read_timeout=self.timeout.read or 300.0,
                )
            ) as chunks:
                async for chunk in chunks:  # NDJSON split by hand: no text decoding per token
                    *lines, pending = (pending + chunk if pending else chunk).split(b"\n")
                    for line in lines:
                        if not line:
                            continue
                        event = _event_decoder.decode(line)
                        yield event
                        if isinstance(event, TERMINAL):
                            return
        except GatewayError as exc:
            yield _failed(exc)
            return
        except msgspec.DecodeError as exc:
            yield _failed(BackendProtocolError(f"the model runner sent an invalid event: {exc}"))
            return
        yield _failed(BackendUnavailable("the model runner closed the stream before finishing"))

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """``request``'s vectors; raises ``GatewayError`` (the runner's own, or a transport failure mapped)."""
        return await self._unary("/embed", request, _embeddings_decoder, "embeddings")

    async def count_tokens(self, request: Request) -> int:
        """The tokens of ``request``'s prompt as the model reads it; raises ``GatewayError``."""
        return (await self._unary("/tokenize", request, _count_decoder, "token count")).count

    async def _unary(self, path: str, request: object, decoder: msgspec.json.Decoder, what: str):
        with mapped_transport_errors():
            response = await self.http.post(
                f"{self.base_url}{path}",
                content=_encoder.encode(request),
                headers={"content-type": "application/json", **self.headers},
                timeout=self.timeout,
            )
        response.stream = httpx.ByteStream(b"")  # httpx 0.28 keeps the response (and the request body, a whole
        # prompt) in a reference cycle with its stream: broken here, the body is freed at once
        if response.status_code == 401:
            raise secret_refused()
        if response.status_code != 200:
            try:
                info = _error_decoder.decode(response.content).error
            except msgspec.DecodeError:
                body = response.text[:200]
                raise BackendProtocolError(f"runner answered {response.status_code}: {body}") from None
            raise error_from_info(info)
        try:
            return decoder.decode(response.content)
        except msgspec.DecodeError as exc:
            raise BackendProtocolError(f"the model runner sent an invalid {what}: {exc}") from exc


class _Count(msgspec.Struct):
    count: int


_count_decoder = msgspec.json.Decoder(_Count)


def _failed(err: GatewayError) -> Failed:
    return Failed(error=err.info())
