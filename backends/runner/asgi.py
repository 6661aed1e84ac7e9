"""ASGI helpers the runner's server and its KV tier routes share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["read_body"]


async def read_body(receive: Callable[..., Any]) -> bytes:
    """An ASGI request's whole body."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)
