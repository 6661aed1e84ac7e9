"""Server-sent event frames for the protocol encoders: the bytes sse-starlette's ``ServerSentEvent`` writes.

The encoders frame one JSON object per token. ``ServerSentEvent(data=..., event=...).encode()`` costs ~2 us a
frame (a ``StringIO``, a regex split of the data into lines, a str round trip), as much as building the JSON.
msgspec's JSON never holds a line break (it escapes them in strings), so its frame is always one ``data:`` line:
a fixed head and tail around the payload, both taken from ``ServerSentEvent`` itself once. A payload that does
hold a line break (never one of ours) is framed by ``ServerSentEvent`` itself.

``KEEPALIVE`` is the comment line sent while a request waits, the same bytes for every endpoint that sends one.

Imports sse-starlette only; shared by the SSE protocol modules, which stay independent of one another.
"""

from __future__ import annotations

from sse_starlette.event import ServerSentEvent

__all__ = ["KEEPALIVE", "frame"]

KEEPALIVE = ServerSentEvent(comment="keep-alive").encode()
"""A keep-alive: an SSE comment, which clients skip (the OpenAI endpoints send it while a request waits)."""

_MARK = "\x00"
_DATA_HEAD, _DATA_TAIL = ServerSentEvent(data=_MARK).encode().split(_MARK.encode())
_heads: dict[str, bytes] = {}


def frame(payload: bytes, event: str | None = None) -> bytes:
    """One SSE frame carrying ``payload`` (JSON bytes) as its data, named ``event`` if given."""
    if b"\n" in payload or b"\r" in payload:
        return ServerSentEvent(data=payload.decode(), event=event).encode()
    if event is None:
        return _DATA_HEAD + payload + _DATA_TAIL
    head = _heads.get(event)
    if head is None:
        head = _heads[event] = ServerSentEvent(data=_MARK, event=event).encode().split(_MARK.encode())[0]
    return head + payload + _DATA_TAIL
