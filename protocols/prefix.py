"""A request's prefix key: what routing keeps near a replica, and what a runner's KV tier tags its entries with, so a
gateway can route a request to the replica whose tier holds its start (``gateway.cluster.routing``,
``backends.runner.kvtier``). One function both sides compute from the same ``Request``.

The key hashes the first ``PREFIX_CHARS`` characters of the preamble (system prompt, tool definitions: an agent's
fixed part) and of the conversation's first message, which every later turn repeats (a plain completion: its
prompt). Two conversations behind one long system prompt get different keys. ``None`` when the prompt's start is
shorter than ``MIN_PREFIX`` characters: nothing worth keeping near a replica.

Imports only the internal model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from meshgate.protocols.model import Request

__all__ = ["MIN_PREFIX", "PREFIX_CHARS", "prefix_key", "request_prefix"]

PREFIX_CHARS = 1024
"""Characters of each of the two parts of a prompt's start that make its prefix key: the preamble (system prompt
and tools, an agent's fixed part) and the conversation's first message, which every later turn repeats. Two
conversations behind one long system prompt get different keys, so they spread over the replicas, each of
which soon holds the shared preamble too."""

MIN_PREFIX = 512
"""The shortest prompt prefix (characters, about 128 tokens) that routing keeps a request near: a shorter one saves
a runner less prefill than an unevenly loaded replica costs."""


def prefix_key(preamble: Iterable[str], first: str) -> bytes | None:
    """The key of a prompt whose ``preamble`` (system prompt, tool definitions) is followed by the ``first``
    message of its conversation (a plain completion: the prompt itself, no preamble): a hash of the first
    ``PREFIX_CHARS`` characters of each; ``None`` when together they are shorter than ``MIN_PREFIX``."""
    digest = hashlib.blake2b(digest_size=8)
    left = PREFIX_CHARS
    length = len(first)
    for part in preamble:
        length += len(part)
        if left <= 0:
            continue
        piece = part[:left]
        digest.update(piece.encode("utf-8", "surrogatepass"))
        left -= len(piece)
    if length < MIN_PREFIX:
        return None
    digest.update(b"\0")
    digest.update(first[:PREFIX_CHARS].encode("utf-8", "surrogatepass"))
    return digest.digest()


def request_prefix(request: Request) -> tuple[list[str], str]:
    """The preamble and first message ``prefix_key`` hashes of ``request`` (a plain completion: none, its prompt)."""
    if request.raw_prompt is not None:
        return [], request.raw_prompt
    system = [m.text for m in request.messages if m.role == "system"][:1]
    preamble = system + [f"{t.name}\0{t.description or ''}" for t in request.tools]
    first = next((m.text for m in request.messages if m.role != "system"), "")
    return preamble, first
