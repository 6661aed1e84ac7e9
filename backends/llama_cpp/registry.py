"""User models: a small registry persisted as ``registry.json`` in the data directory, and the model sources
that apply it.

Ollama's ``/api/copy`` and ``/api/create`` add an entry (a name for a GGUF file, with an optional system prompt,
template and parameters); ``/api/delete`` removes one, or hides a model that another source lists (the packaged
``gemma3:270m``, configured paths) until it is pulled, copied or created again under that name. The file is read
on every call, so the gateway's routes and the catalog's source share it without sharing objects; writes go to a
temporary file that is renamed over the old one.

The registry is bounded, since it is read on every call and clients write it: at most ``MAX_USER_MODELS`` names
and ``MAX_REGISTRY_BYTES`` of JSON (system prompts, templates and parameters included). ``put`` raises
``RegistryFull`` beyond either; replacing an existing name is always allowed while the file stays in bounds, and
``remove`` always is.

Imports ``backends.base`` and ``backends.llama_cpp``'s GGUF helpers; nothing of the gateway.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from meshgate.backends.base import ModelCard, ModelSource
from meshgate.backends.llama_cpp.sources import card_from_gguf

__all__ = ["MAX_REGISTRY_BYTES", "MAX_USER_MODELS", "HidingSource", "ModelRegistry", "RegistryFull", "RegistrySource",
           "UserModel", "sha256_file"]

MAX_USER_MODELS = 1000
MAX_REGISTRY_BYTES = 16 << 20


class RegistryFull(Exception):
    """Adding a model would take the registry past its bounds (its message says which, and what to do)."""


class UserModel(msgspec.Struct, kw_only=True):
    """One user model: a name for the GGUF at ``path`` and what ``/api/show`` reports with it."""

    path: str
    digest: str
    created: float
    parent: str = ""
    system: str = ""
    template: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class _Registry(msgspec.Struct, kw_only=True):
    models: dict[str, UserModel] = msgspec.field(default_factory=dict)
    hidden: list[str] = msgspec.field(default_factory=list)


class ModelRegistry:
    """The persisted registry (``<data_dir>/registry.json``), holding at most ``max_models`` user models in at most
    ``max_bytes`` of JSON."""

    def __init__(self, path: Path, *, max_models: int = MAX_USER_MODELS, max_bytes: int = MAX_REGISTRY_BYTES) -> None:
        self.path = path
        self.max_models = max_models
        self.max_bytes = max_bytes

    def _load(self) -> _Registry:
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=_Registry)
        except FileNotFoundError:
            return _Registry()

    def _save(self, registry: _Registry) -> None:
        self._write(msgspec.json.encode(registry))

    def _write(self, data: bytes) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + f".{os.getpid()}.partial")
        partial.write_bytes(data)
        partial.replace(self.path)

    def models(self) -> dict[str, UserModel]:
        return self._load().models

    def get(self, name: str) -> UserModel | None:
        return self._load().models.get(name)

    def hidden(self) -> set[str]:
        return set(self._load().hidden)

    def put(self, name: str, model: UserModel) -> None:
        """Add or replace ``name`` (and stop hiding it).

        Raises:
            RegistryFull: ``name`` is new and the registry holds ``max_models`` already, or the registry would
                exceed ``max_bytes``. Nothing is written then.
        """
        registry = self._load()
        if name not in registry.models and len(registry.models) >= self.max_models:
            raise RegistryFull(f"too many models: meshgate keeps at most {self.max_models} copied or created models; "
                               "delete one (/api/delete) before adding another")
        registry.models[name] = model
        registry.hidden = [h for h in registry.hidden if h != name]
        data = msgspec.json.encode(registry)
        if len(data) > self.max_bytes:
            raise RegistryFull(f"the model registry would exceed {self.max_bytes >> 20} MiB (the system prompts, "
                               "templates and parameters of all copied and created models); store less, or delete "
                               "models (/api/delete) first")
        self._write(data)

    def unhide(self, name: str) -> None:
        registry = self._load()
        registry.hidden = [h for h in registry.hidden if h != name]
        self._save(registry)

    def remove(self, name: str) -> bool:
        """Delete a user model; ``False`` if ``name`` is not one."""
        registry = self._load()
        if registry.models.pop(name, None) is None:
            return False
        self._save(registry)
        return True

    def hide(self, name: str) -> None:
        """Hide a model another source lists (deleting the packaged model, for instance)."""
        registry = self._load()
        if name not in registry.hidden:
            registry.hidden.append(name)
        self._save(registry)


class RegistrySource:
    """Lists the registry's user models (entries whose file has gone are skipped)."""

    name = "registry"

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    def models(self) -> Sequence[ModelCard]:
        cards = []
        for name, model in self.registry.models().items():
            if os.path.exists(model.path):
                card = card_from_gguf(name, model.path, digest=model.digest, source=self.name)
                cards.append(msgspec.structs.replace(card, created=model.created))
        return cards


class HidingSource:
    """Another source, less the names the registry hides."""

    def __init__(self, inner: ModelSource, registry: ModelRegistry) -> None:
        self.inner = inner
        self.registry = registry
        self.name = inner.name

    def models(self) -> Sequence[ModelCard]:
        hidden = self.registry.hidden()
        return [card for card in self.inner.models() if card.name not in hidden]


def sha256_file(path: str) -> str:
    """The file's sha256 (hex), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
