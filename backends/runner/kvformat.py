"""The KV tiers' entry format, on disk and between nodes: one layout, checked the same way wherever it is read.

An entry is a fixed header (``MAGIC``, the format version, the JSON header's length), a JSON header (namespace,
scope, token count, the sizes of its parts, its restore points' digests, an XXH3-128 of the body) and the body:
the tokens (int32, little-endian), the state, the logits, then each restore point's bytes. The checksum guards
against corruption and truncation (a file or a transfer cut short, a flipped bit), not against forgery: peers
prove who they are with the cluster secret, and files are the runner's own (mode 0600). XXH3 hashes at memory
speed (~16 GB/s here against BLAKE2b's ~0.8), and an entry computes it once (``Entry.checksum``), when it is first
encoded, so a peer's fetch costs the transfer, not a hash on each side (format 1 used BLAKE2b). ``decode`` refuses
(``ValueError``) an entry of another format or namespace, one whose body is shorter or longer than its header says,
whose checksum does not match, or whose tokens do not give its digests: it is never loaded.

Runs in runner processes; imports numpy and xxhash, nothing of ours.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import xxhash

__all__ = ["FORMAT", "Entry", "decode", "encode", "parse", "read_header"]

MAGIC = b"MGKV"
FORMAT = 2
"""The format's version: an entry of another version is refused."""
_FIXED = struct.Struct("<4sII")  # magic, format version, JSON header length


@dataclass(eq=False)
class Entry:
    """A prompt's KV state: ``tokens`` (int32), ``state`` at their end, the last position's ``logits`` (float32
    bytes), and restore points inside them (``points``: token count -> the runtime's bytes for cutting back there)."""

    scope: str
    tokens: np.ndarray
    state: bytearray | memoryview
    logits: bytearray | memoryview
    points: dict[int, bytearray | memoryview] = field(default_factory=dict)
    digests: dict[int, str] = field(default_factory=dict)  # restore point (and the end) -> its digest
    tag: str = ""  # the prompt's prefix key (``protocols.prefix``, hex): what the tier tells routing it holds
    checksum: str = ""  # its body's XXH3-128 (hex), once ``encode`` or ``decode`` has computed it

    @property
    def key(self) -> str:
        return self.digests[len(self.tokens)]

    def nbytes(self) -> int:
        return self.tokens.nbytes + len(self.state) + len(self.logits) + sum(len(p) for p in self.points.values())


def encode(entry: Entry, namespace: str) -> list[Any]:
    """``entry`` as the buffers to write, in order (the fixed header, the JSON header, the body's parts)."""
    parts = [entry.tokens.astype("<i4").tobytes(), entry.state, entry.logits, *entry.points.values()]
    if not entry.checksum:
        checksum = xxhash.xxh3_128()
        for part in parts:
            checksum.update(part)
        entry.checksum = checksum.hexdigest()
    header = json.dumps(
        {
            "namespace": namespace,
            "scope": entry.scope,
            "tag": entry.tag,
            "tokens": len(entry.tokens),
            "sizes": {
                "state": len(entry.state),
                "logits": len(entry.logits),
                "points": [[n, len(p)] for n, p in entry.points.items()],
            },
            "digests": [[n, d] for n, d in entry.digests.items()],
            "checksum": entry.checksum,
        }
    ).encode()
    return [_FIXED.pack(MAGIC, FORMAT, len(header)), header, *parts]


def read_header(f: BinaryIO) -> dict[str, Any]:
    """The JSON header of the entry ``f`` starts with (``f`` is left at its body)."""
    return _header(f.read)


def parse(data: bytearray | memoryview) -> tuple[dict[str, Any], memoryview]:
    """The JSON header and the body of the entry ``data`` holds whole (a peer's transfer), without copying it."""
    view = memoryview(data).cast("B")
    at = 0

    def read(n: int) -> bytes:
        nonlocal at
        piece = bytes(view[at : at + n])
        at += len(piece)
        return piece

    header = _header(read)
    return header, view[at:]


def _header(read: Callable[[int], bytes]) -> dict[str, Any]:
    """The fixed header's checks and the JSON header, read with ``read(n)`` (at most ``n`` bytes)."""
    fixed = read(_FIXED.size)
    if len(fixed) != _FIXED.size:
        raise ValueError("shorter than its header")
    magic, version, length = _FIXED.unpack(fixed)
    if magic != MAGIC or version != FORMAT:
        raise ValueError(f"not a meshgate KV entry of format {FORMAT}")
    raw = read(length)
    if len(raw) != length:
        raise ValueError("shorter than its header")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("its header is not an object")
    return header


def decode(
    header: dict[str, Any],
    body: bytearray | memoryview,
    namespace: str,
    digests_of: Callable[[str, np.ndarray, list[int]], dict[int, str]],
) -> Entry:
    """The entry ``header`` and ``body`` make, checked (``ValueError`` says what is wrong); ``digests_of`` is the
    tier's digest function, to check the tokens against the digests."""
    try:
        n, sizes = int(header["tokens"]), header["sizes"]
        expected = n * 4 + sizes["state"] + sizes["logits"] + sum(size for _, size in sizes["points"])
        if header["namespace"] != namespace:
            raise ValueError("it belongs to another model or runtime")
        if len(body) != expected:
            raise ValueError(f"{len(body)} body bytes where its header says {expected}")
        checksum = xxhash.xxh3_128_hexdigest(body)
        if checksum != header["checksum"]:
            raise ValueError("its checksum does not match")
        view = memoryview(body).cast("B")
        tokens = np.frombuffer(view, dtype="<i4", count=n).astype(np.int32)
        at = n * 4
        state = view[at : at + sizes["state"]]
        at += sizes["state"]
        logits = view[at : at + sizes["logits"]]
        at += sizes["logits"]
        points: dict[int, bytearray | memoryview] = {}
        for point, size in sizes["points"]:
            points[int(point)] = view[at : at + size]
            at += size
        digests = {int(p): str(d) for p, d in header["digests"]}
        scope = str(header["scope"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"its header lacks {exc}") from exc
    if digests_of(scope, tokens, list(digests)) != digests or n not in digests:
        raise ValueError("its tokens do not match its digests")
    return Entry(scope, tokens, state, logits, points, digests, str(header.get("tag", "")), checksum)
