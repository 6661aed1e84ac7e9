"""``/api/pull``'s progress for a model meshgate already has (``gateway.models.admin.pull`` resolves it): there
is no hub to download from, so the work a pull does, and reports, is reading the model's files through and checking
a single file's sha256 against the model's digest, as Ollama checks a downloaded blob. The objects are Ollama's
(OLL-45): ``pulling manifest``, ``pulling <digest>`` with ``total`` and a growing ``completed``, ``verifying sha256
digest``, ``writing manifest``, ``success``; a mismatch ends the stream with Ollama's ``digest mismatch`` error.
Reads go through a thread, a block at a time, so a client that leaves stops the reading at the next block.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from meshgate.backends.base import ModelCard
from meshgate.protocols import ollama_models

__all__ = ["pull_progress"]

_PULL_BLOCK = 8 << 20
"""Bytes read and hashed at a time while pulling; a progress object goes out each 1% of the model or each block,
whichever is more bytes (so at most about 100 of them)."""


def _files_of(path: str) -> list[str]:
    """The files a model consists of: the file itself, or a checkpoint directory's files (sorted); none when the
    path is not on this machine (a model another node holds, a test backend's name)."""
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        return sorted(str(p) for p in Path(path).rglob("*") if p.is_file())
    return []


def _read_block(f: Any, digest: Any) -> int:
    block = f.read(_PULL_BLOCK)
    digest.update(block)
    return len(block)


async def pull_progress(card: ModelCard) -> AsyncIterator[bytes]:
    """Ollama's pull progress (OLL-45), for a model already here: its files are read through and hashed, with
    ``completed`` bytes growing to ``total``; a single file is then checked against the card's sha256 (a
    mismatch ends the stream with ``{"error": "digest mismatch, ..."}``, as Ollama's does). A checkpoint
    directory's digest is not a hash of its bytes, so its files are only read."""
    line = ollama_models.progress_line
    digest, status = f"sha256:{card.digest}", f"pulling {card.digest[:12]}"
    yield line("pulling manifest")
    files = await asyncio.to_thread(_files_of, card.path)
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes) if files else card.size
    yield line(status, digest=digest, total=total, completed=0)
    hasher, done = hashlib.sha256(), 0
    step = max(total // 100, _PULL_BLOCK)
    reported = 0
    for path in files:
        try:
            f = open(path, "rb")  # closed by the with below
        except OSError as exc:
            yield ollama_models.error_line(f"pull: cannot read {os.path.basename(path)}: {exc.strerror}") + b"\n"
            return
        with f:
            while read := await asyncio.to_thread(_read_block, f, hasher):
                done += read
                if done - reported >= step:
                    reported = done
                    yield line(status, digest=digest, total=total, completed=done)
    if reported != total:
        yield line(status, digest=digest, total=total, completed=total)
    yield line("verifying sha256 digest")
    if len(files) == 1 and _SHA256.fullmatch(card.digest) and hasher.hexdigest() != card.digest:
        got = f"sha256:{hasher.hexdigest()}"
        yield (
            ollama_models.error_line(f"digest mismatch, file must be downloaded again: want {digest}, got {got}")
            + b"\n"
        )
        return
    yield line("writing manifest")
    yield line("success")


_SHA256 = re.compile(r"[0-9a-f]{64}")
