"""User models: a small registry persisted as ``registry.json`` in the data directory, and the model sources
that apply it. Neutral: it knows no model format and no backend.

Ollama's ``/api/copy`` and ``/api/create`` add an entry (a name for a model file or directory, with an optional
system prompt, template and parameters); ``/api/delete`` removes one, or hides a model that another source lists
(the packaged ``gemma3:270m``, configured paths) until it is pulled, copied or created again under that name. The
file is read on every call, so the gateway's routes and the catalog's sources share it without sharing objects;
writes go to a temporary file that is renamed over the old one.

The registry is bounded, since it is read on every call and clients write it: at most ``MAX_USER_MODELS`` names
and ``MAX_REGISTRY_BYTES`` of JSON (system prompts, templates and parameters included). ``put`` raises
``RegistryFull`` beyond either; replacing an existing name is always allowed while the file stays in bounds, and
``remove`` always is.

Which entries are listed is up to the plugins that read model files: each registers a ``RegistrySource`` with a
reader for its format (the ``llama_cpp`` plugin for GGUF files, the neutral ``models`` plugin for Hugging Face
checkpoint directories), and wraps its other sources in a ``HidingSource``. A user model whose file exists
shadows every other source's model of that name, whichever plugin's sources the catalog asks first.

Imports ``backends.base`` only; nothing of a backend, the plugins or the gateway.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from meshgate.backends.base import ModelCard, ModelSource

__all__ = [
    "MAX_REGISTRY_BYTES",
    "MAX_USER_MODELS",
    "REGISTRY_FILE",
    "CardReader",
    "HidingSource",
    "ModelRegistry",
    "RegistryFull",
    "RegistrySource",
    "UserModel",
    "sha256_file",
]

MAX_USER_MODELS = 1000
MAX_REGISTRY_BYTES = 16 << 20
REGISTRY_FILE = "registry.json"


class RegistryFull(Exception):
    """Adding a model would take the registry past its bounds (its message says which, and what to do)."""


class UserModel(msgspec.Struct, kw_only=True):
    """One user model: a name for the model file (or checkpoint directory) at ``path`` and what ``/api/show``
    reports with it."""

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
    ``max_bytes`` of JSON.

    Example::

        registry = ModelRegistry.in_data_dir(settings.data_dir)
        registry.put("pirate:latest", UserModel(path="/models/x.gguf", digest=sha256_file("/models/x.gguf"),
                                                created=time.time(), system="You are a pirate."))
    """

    def __init__(self, path: Path, *, max_models: int = MAX_USER_MODELS, max_bytes: int = MAX_REGISTRY_BYTES) -> None:
        self.path = path
        self.max_models = max_models
        self.max_bytes = max_bytes

    @classmethod
    def in_data_dir(cls, data_dir: str | os.PathLike[str]) -> ModelRegistry:
        """The registry of the data directory ``data_dir`` (``<data_dir>/registry.json``)."""
        return cls(Path(data_dir) / REGISTRY_FILE)

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

    def shadowed(self) -> set[str]:
        """Names other sources must not list: the hidden ones and the user models whose file exists."""
        registry = self._load()
        return set(registry.hidden) | {name for name, model in registry.models.items() if os.path.exists(model.path)}

    def put(self, name: str, model: UserModel) -> None:
        """Add or replace ``name`` (and stop hiding it).

        Raises:
            RegistryFull: ``name`` is new and the registry holds ``max_models`` already, or the registry would
                exceed ``max_bytes``. Nothing is written then.
        """
        registry = self._load()
        if name not in registry.models and len(registry.models) >= self.max_models:
            raise RegistryFull(
                f"too many models: meshgate keeps at most {self.max_models} copied or created models; "
                "delete one (/api/delete) before adding another"
            )
        registry.models[name] = model
        registry.hidden = [h for h in registry.hidden if h != name]
        data = msgspec.json.encode(registry)
        if len(data) > self.max_bytes:
            raise RegistryFull(
                f"the model registry would exceed {self.max_bytes >> 20} MiB (the system prompts, "
                "templates and parameters of all copied and created models); store less, or delete "
                "models (/api/delete) first"
            )
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


CardReader = Callable[[str], "ModelCard | None"]
"""Describes the model file or directory at a path as a card (its name, digest and dates are replaced); ``None``,
``OSError`` or ``ValueError`` when it is not a model of the reader's format."""


class RegistrySource:
    """Lists the registry's user models that ``read`` describes (one model format; entries whose file has gone, or
    that ``read`` does not take, are skipped).

    Example::

        register(RegistrySource(registry, lambda path: card_from_gguf("", path, digest="", source="")
                                if os.path.isfile(path) else None))
    """

    def __init__(self, registry: ModelRegistry, read: CardReader, *, name: str = "registry") -> None:
        self.registry = registry
        self.read = read
        self.name = name

    def card(self, name: str, model: UserModel) -> ModelCard | None:
        """``model``'s card under ``name``, or ``None`` when its file has gone or is not of this source's format."""
        if not os.path.exists(model.path):
            return None
        try:
            card = self.read(model.path)
        except (OSError, ValueError):
            return None
        if card is None:
            return None
        return msgspec.structs.replace(card, name=name, digest=model.digest, created=model.created, source=self.name)

    def models(self) -> Sequence[ModelCard]:
        return [card for name, model in self.registry.models().items() if (card := self.card(name, model)) is not None]


class HidingSource:
    """Another source, less the names the registry hides or gives to user models (``ModelRegistry.shadowed``)."""

    def __init__(self, inner: ModelSource, registry: ModelRegistry) -> None:
        self.inner = inner
        self.registry = registry
        self.name = inner.name

    def models(self) -> Sequence[ModelCard]:
        shadowed = self.registry.shadowed()
        return [card for card in self.inner.models() if card.name not in shadowed]


def sha256_file(path: str) -> str:
    """The file's sha256 (hex), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
