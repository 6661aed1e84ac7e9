"""Request bodies as every protocol reads them: JSON decoded into a wire Struct with the offending field named,
nesting and message counts bounded before any work is done.

Part of the internal model (``protocols.model`` re-exports every name here); imports only ``protocols.errors``.
"""

from __future__ import annotations

import array
import itertools
import re
from typing import TypeVar

import msgspec

from meshgate.protocols.errors import InvalidRequest

__all__ = ["MAX_JSON_DEPTH", "MAX_MESSAGES", "decode_body", "json_depth", "too_many_messages"]

T = TypeVar("T")


MAX_JSON_DEPTH = 128
"""How deeply a request body may nest JSON arrays and objects. Python's recursion limit (about 1,000 frames, shared
with the code on the stack) stops every JSON decoder, encoder and schema walker somewhere below that; a body that
decodes here must still encode for a runner and turn into a grammar there."""

MAX_MESSAGES = 10_000
"""The most messages (Responses API: input items) one request may hold; OpenAI's chat completions keep their own
2,048. Rendering and counting a prompt is linear in them, yet a chat of 100,000 empty messages still cost seconds
of CPU per count and 37-60 s before an answer; no model's context holds that many turns, and a client that sends
more is refused before any work is done, told the bound."""


def too_many_messages(count: int, param: str = "messages") -> InvalidRequest | None:
    """The ``InvalidRequest`` for a request of ``count`` messages when that is more than ``MAX_MESSAGES``."""
    if count <= MAX_MESSAGES:
        return None
    return InvalidRequest(
        f"{param} holds {count:,} messages; at most {MAX_MESSAGES:,} are allowed: drop or summarize the oldest",
        param=param,
    )


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes) -> int:
    """How deeply ``body``, valid JSON, nests arrays and objects (brackets inside strings do not count).

    Linear and mostly in C: the strings are cut out and the brackets left are summed (0.4 s for 32 MB of them).
    """
    steps = _JSON_STRING.sub(b"", body).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    return max(itertools.accumulate(array.array("b", steps)), default=0)


def decode_body(body: bytes, into: type[T]) -> T:
    """Decode a JSON request body into a wire Struct; bad JSON or a bad field becomes ``InvalidRequest``.

    The message names the offending field (``Object missing required field `max_tokens```,
    ``Expected `str`, got `int` - at `$.messages[0].content```). JSON nested deeper than ``MAX_JSON_DEPTH`` is
    refused, even in fields that are otherwise taken as they come.
    """
    try:
        wire = msgspec.json.decode(body, type=into)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request body: {exc}", param=_param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # deeper than the decoder's stack allows
        raise InvalidRequest(
            f"request body nests JSON too deeply; at most {MAX_JSON_DEPTH} levels are allowed"
        ) from exc
    # Measured on valid JSON only (every string closed, so the scan is linear). A body with fewer opening brackets
    # than the limit cannot nest deeper than it and is not scanned.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and (depth := json_depth(body)) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"request body nests JSON {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed")
    return wire


def _param_of(message: str) -> str | None:
    """The field a msgspec error names: ``messages[0].role`` from "... - at `$.messages[0].role`"."""
    if "`" not in message:
        return None
    at = message.rsplit(" - at `$.", 1)[1].rstrip("`") if " - at `$." in message else None
    if message.startswith("Object missing required field"):
        field = message.split("`")[1]
        return f"{at}.{field}" if at else field
    return at or message.split("`")[1]
