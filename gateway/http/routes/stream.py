"""The streamed response every protocol uses: what is ready goes out together, nothing waits for what is not.

``CoalescedStream`` is Litestar's ``Stream`` with one change in how the body is written. Litestar sends one ASGI
message (one socket write, ~20-50 us of the gateway's CPU on loopback) per item of the iterator. Here a task pulls
frames from the protocol encoder, which pulls events from the runner, and appends them to a list; the writer
takes the whole list each time it runs and sends it as one message. The puller runs until the runner has no more
data ready, so every line the runner wrote at once (a batched runner writes all it has) is encoded and written
in one chunk; and the writer runs one event-loop turn after the first frame appears, so the first token is never
held back for company.

A client that disconnects cancels both (Litestar's disconnect listener). Whatever ends the response, it closes
the frames' iterator and then ``closes`` (the dispatcher's event stream): that frees the request's queue slot and
the runner's connection even when the encoder never started. Frames pile up while the client reads slowly only to
``_MAX_PENDING``; beyond that the puller waits, and so does the runner's socket.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import anyio
from litestar.enums import MediaType
from litestar.response import Stream
from litestar.response.streaming import ASGIStreamingResponse
from litestar.utils.helpers import get_enum_string_value

from meshgate.gateway.serving.streams import aclose

if TYPE_CHECKING:
    from litestar.app import Litestar
    from litestar.background_tasks import BackgroundTask, BackgroundTasks
    from litestar.connection import Request
    from litestar.datastructures.cookie import Cookie
    from litestar.response.base import ASGIResponse
    from litestar.types import Receive, Scope, Send

__all__ = ["CoalescedStream"]

_MAX_PENDING = 1024
"""Frames encoded but not yet written before the puller waits for the writer (a client that reads slowly)."""


class _CoalescedASGIStream(ASGIStreamingResponse):
    """Writes the iterator's items in as few ASGI messages as their arrival allows; closes them and ``closes``
    when done."""

    def __init__(self, *, closes: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.closes = closes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await aclose(self.iterator)
            if self.closes is not None:
                await aclose(self.closes)

    async def _stream(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        pending: list[bytes] = []
        wake: asyncio.Future[None] | None = None  # the writer waits on it for frames
        drained: asyncio.Future[None] | None = None  # the puller waits on it when too much piled up
        done = False

        async def pull() -> None:
            nonlocal done, drained
            async for frame in self.iterator:
                pending.append(frame)  # type: ignore[arg-type]  # our encoders yield bytes
                if wake is not None and not wake.done():
                    wake.set_result(None)
                if len(pending) >= _MAX_PENDING:
                    drained = loop.create_future()
                    await drained
            done = True
            if wake is not None and not wake.done():
                wake.set_result(None)

        async with anyio.create_task_group() as group:
            group.start_soon(pull)
            while True:
                if not pending and not done:
                    wake = loop.create_future()
                    await wake
                    wake = None
                last = done  # read before sending: the puller may finish while a send waits for the client
                body = b"".join(pending) if len(pending) != 1 else pending[0]
                pending.clear()
                if drained is not None and not drained.done():
                    drained.set_result(None)
                await send({"type": "http.response.body", "body": body, "more_body": not last})
                if last:
                    return


class CoalescedStream(Stream):
    """A ``Stream`` of ``bytes`` whose ready items are written together, closing ``closes`` when it is done (see
    the module docstring)."""

    def __init__(self, content: Any, *, closes: Any = None, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.closes = closes

    def to_asgi_response(  # the same as ``Stream.to_asgi_response``, with the coalescing ASGI response
        self,
        app: Litestar | None,
        request: Request,
        *,
        background: BackgroundTask | BackgroundTasks | None = None,
        cookies: Iterable[Cookie] | None = None,
        encoded_headers: Iterable[tuple[bytes, bytes]] | None = None,
        headers: dict[str, str] | None = None,
        is_head_response: bool = False,
        media_type: MediaType | str | None = None,
        status_code: int | None = None,
        **_: Any,
    ) -> ASGIResponse:
        return _CoalescedASGIStream(
            closes=self.closes,
            background=self.background or background,
            content_length=0,
            cookies=self.cookies if cookies is None else itertools.chain(self.cookies, cookies),
            encoded_headers=encoded_headers,
            encoding=self.encoding,
            headers={**headers, **self.headers} if headers is not None else self.headers,
            is_head_response=is_head_response,
            iterator=self.iterator() if callable(self.iterator) else self.iterator,
            media_type=get_enum_string_value(media_type or self.media_type or MediaType.JSON),
            status_code=self.status_code or status_code,
        )
