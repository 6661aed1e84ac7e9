"""Small formats that several protocol modules need alike: base64, ``data:`` URIs and RFC 3339 timestamps.

A helper used by two protocol codecs lives here, once, rather than in one of them (the protocol modules stay
independent of one another). Only the mechanics are shared: each protocol still decides what it accepts and
words its own errors, so the functions raise plain ``ValueError`` and the caller turns it into its
``InvalidRequest``.

- ``decode_base64``: strict standard base64 (RFC 4648 section 4, padding checked). Anything else is a
  ``ValueError``, non-ASCII text included (``base64.b64decode`` raises a bare ``ValueError`` for that, not
  ``binascii.Error``). ``wrapped=True`` first drops whitespace, as in a line-wrapped ``data:`` URI.
- ``parse_data_uri`` splits ``data:[<media type>][;<parameter>]*,<data>`` (RFC 2397) without decoding;
  ``encode_data_uri`` builds the base64 form.
- ``rfc3339``: a Unix time as an RFC 3339 UTC timestamp, either with six fractional digits and ``+00:00``
  (Ollama's ``created_at``/``modified_at``; every ``datetime.fromisoformat`` reads it) or in whole seconds with
  ``Z`` (Anthropic's ``created_at``). Cached: a stream stamps every line with the same time.
- ``json_object_prefix``: tool-call arguments as an object for the protocols that send them as one (Anthropic's
  ``input``, Ollama's ``arguments``), even when the model was cut short mid-JSON: what the text holds so far,
  read by jiter in partial mode as the anthropic SDK reads a streamed ``input`` (an unfinished string or
  value is left out).

- ``check_tool_name``: a tool name against a protocol's rule: ``^[a-zA-Z0-9_-]{1,n}$`` (OpenAI's n is 64,
  Anthropic's 128, which Claude Code's ``mcp__server__tool`` names fit), or, for Ollama, which checks nothing,
  only that the name is not empty and holds no control character.

Imports only the standard library and jiter. No I/O.
"""

from __future__ import annotations

import base64
import functools
import json
import re
from datetime import UTC, datetime
from typing import Any, NamedTuple

import jiter

__all__ = [
    "DataURI",
    "check_tool_name",
    "decode_base64",
    "encode_data_uri",
    "json_object_prefix",
    "parse_data_uri",
    "rfc3339",
]


def decode_base64(text: str, *, wrapped: bool = False) -> bytes:
    """The bytes that ``text`` (standard base64, padded) encodes.

    Args:
        text: the base64 text.
        wrapped: ignore whitespace (line breaks of wrapped base64) instead of refusing it.

    Raises:
        ValueError: ``text`` is not valid base64 (``binascii.Error``), or holds non-ASCII characters.
    """
    if wrapped:
        text = "".join(text.split())
    return base64.b64decode(text, validate=True)


class DataURI(NamedTuple):
    """A ``data:`` URI split into its parts; ``payload`` is not decoded."""

    media_type: str | None
    """The media type it names; ``None`` when it names none (``data:,...`` or ``data:;base64,...``)."""
    base64: bool
    """Whether ``base64`` is among its parameters (the payload is base64, not percent-encoded text)."""
    payload: str
    """Everything after the first comma."""


def parse_data_uri(uri: str) -> DataURI | None:
    """``uri`` split as ``data:[<media type>][;<parameter>]*,<data>``; ``None`` when it does not start with
    ``data:`` or has no comma."""
    header, comma, payload = uri.partition(",")
    if not uri.startswith("data:") or not comma:
        return None
    media_type, *params = header.removeprefix("data:").split(";")
    return DataURI(media_type=media_type or None, base64="base64" in params, payload=payload)


def encode_data_uri(data: bytes, media_type: str) -> str:
    """``data:<media type>;base64,<data>``."""
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


@functools.lru_cache(maxsize=256)
def rfc3339(timestamp: float, *, fraction: bool = True) -> str:
    """``timestamp`` (Unix seconds) as RFC 3339 in UTC.

    Args:
        timestamp: seconds since the epoch.
        fraction: six fractional digits and ``+00:00`` (``2025-03-10T01:32:32.700000+00:00``); when false,
            whole seconds and ``Z`` (``2025-03-10T01:32:32Z``).
    """
    moment = datetime.fromtimestamp(timestamp, UTC)
    if fraction:
        return moment.isoformat(timespec="microseconds")
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def json_object_prefix(text: str) -> dict[str, Any]:
    """The object that ``text``, JSON or the start of JSON, holds so far; ``{}`` for text that is neither an
    object nor the start of one (a model can write broken arguments in ``auto`` mode)."""
    try:
        value = jiter.from_json(text.encode(), partial_mode=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def check_tool_name(name: str, longest: int | None) -> None:
    """Raise ``ValueError`` saying how ``name`` breaks the rule for tool names.

    Args:
        name: the tool's name as the client sent it.
        longest: the rule ``^[a-zA-Z0-9_-]{1,longest}$``; ``None`` asks only for a non-empty name without
            control characters.
    """
    shown = json.dumps(name if len(name) <= 80 else name[:80] + "...")  # a control character shows as \\u0000
    if not name:
        raise ValueError("the tool name is empty; give the tool a name")
    if longest is None:
        if _CONTROL.search(name):
            raise ValueError(f"the tool name {shown} holds a control character; use printable characters only")
        return
    rule = f"^[a-zA-Z0-9_-]{{1,{longest}}}$"
    if not _TOOL_NAME.fullmatch(name):
        raise ValueError(f"the tool name {shown} does not match {rule}: use only ASCII letters, digits, '_' and '-'")
    if len(name) > longest:
        raise ValueError(f"the tool name {shown} has {len(name)} characters; {rule} allows at most {longest}")
