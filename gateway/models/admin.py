"""Model management behind Ollama's ``/api/show``, ``/api/ps``, ``/api/copy``, ``/api/delete``, ``/api/create``,
``/api/pull`` and ``keep_alive``: the facts (cards, the backends' descriptions, instances, the user-model registry)
gathered for the pure codecs in ``protocols.ollama_models``. It reads no model file and knows no backend by name:
what ``/api/show`` shows of a model (``model_info``, template, parameters, license) and the context a runner gets
come through the ``Backend`` contract (``describe``, ``context``), and a file given to ``/api/create`` is a model
when a user-model source of an enabled plugin reads it (``backends.registry.RegistrySource``).

Decisions (docs/protocols.md OLL-15, OLL-41..47):

- **Models stay loaded.** Without ``keep_alive`` an instance never expires (Ollama unloads after 5 minutes;
  meshgate keeps models placed until told otherwise, since placing can span nodes). ``keep_alive`` given on a
  request sets the expiry of the model's ready instances when the request ends: ``0`` unloads them, a negative
  value clears the expiry, a positive one sets it that far ahead; a request without ``keep_alive`` puts an
  instance that had an expiry back to "never" (the default, as each Ollama request resets the timer to its own
  value). A client that disconnects mid-stream leaves the expiry as it was.
- **The registry** (``backends.registry``, ``<data_dir>/registry.json``) holds copies and created models: names
  for model files (GGUF files, checkpoint directories) with a stored system prompt, template and parameters, which
  ``/api/show`` reports over the backend's own; generation applies the system prompt and parameters as defaults
  (``gateway.serving.model_defaults``; the stored template is shown only). Deleting a copy or a created
  model removes its entry (the file stays); deleting a model another source lists (the packaged ``gemma3:270m``)
  hides it until it is pulled, copied or created again. Names get ``:latest`` when they have no tag (OLL-47).
- **No hub.** ``/api/pull`` succeeds for models meshgate already has (including a hidden packaged model, which it
  shows again); any other name fails as Ollama's pull of a name its registry lacks (``pulling manifest``, then
  ``{"error": "pull model manifest: file does not exist"}``: in a 200 stream, or alone as a 500 without
  streaming, as Ollama's ``waitForStream`` answers a failed pull). Its progress objects are real: the model's
  files are read through and a single file's sha256 checked against the model's digest, ``completed`` growing
  as they are read (a 250 MB model takes about a second; a corrupt file ends in Ollama's "digest mismatch"
  error). ``/api/push`` answers 501.
- **Hostile clients.** ``/api/create`` reads only GGUF files under ``<data_dir>/models`` or a directory of
  ``MESHGATE_MODEL_DIRS`` (``model_roots``). ``from`` is a path, not a model name, when its text says so (absolute,
  ``~``, starting with ``.``, or ending in ``.gguf``), never because a file exists. A relative path is taken from
  ``<data_dir>/models`` (the server's working directory means nothing to a client). The path is resolved
  (symlinks followed, ``..`` applied) and must land under a resolved root, so a link in the data directory to a
  file elsewhere needs that place in ``MESHGATE_MODEL_DIRS``. Outside the roots the answer is one message whether
  or not the path exists; only inside them does "names no file" appear. Names given to create, copy (destination)
  and delete must be Ollama model names (``protocols.ollama_models.parse_model_name``).
- **A bounded registry** (``backends.registry``: 1,000 user models, 16 MiB). Past it create and copy
  answer 400 with ``{"error": "too many models: ..."}``: Ollama clients (ollama-python, ollama-js, Open WebUI)
  surface any error status with its ``error`` text, and a 4xx says "do not retry as is", which is right, since
  only deleting models helps. A 503 would invite retry loops, and 507 is neither a status Ollama answers nor in
  our error tree. A registry entry whose file has gone is listed by no source but still counts, so
  ``/api/delete`` removes it by name.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from meshgate.backends.base import Backend, ModelCard
from meshgate.backends.registry import ModelRegistry, RegistryFull, RegistrySource, UserModel, sha256_file
from meshgate.gateway.cluster.records import Ready
from meshgate.gateway.models.pull import pull_progress
from meshgate.gateway.serving.catalog import normalize_model_name
from meshgate.gateway.serving.dispatch import Dispatcher
from meshgate.plugins.settings import Settings
from meshgate.protocols import ollama_models
from meshgate.protocols.model import (
    GatewayError,
    InvalidRequest,
    ModelInfo,
    UnknownModel,
    UnsupportedFeature,
)

__all__ = ["apply_keep_alive", "copy", "create", "delete", "model_roots", "ps", "pull", "registry_of", "show"]


def registry_of(data_dir: str) -> ModelRegistry:
    return ModelRegistry.in_data_dir(data_dir)


def model_roots(settings: Settings) -> tuple[Path, ...]:
    """The directories ``/api/create`` may read GGUF files from, resolved: ``<data_dir>/models`` first, then
    ``MESHGATE_MODEL_DIRS``."""
    return tuple(Path(d).expanduser().resolve() for d in (str(settings.models_dir), *settings.model_dirs))


def info_of(card: ModelCard, context_length: int = 0) -> ModelInfo:
    return ModelInfo(
        name=card.name,
        created=card.created,
        size=card.size,
        digest=card.digest,
        format=card.format,
        family=card.family,
        parameter_size=card.parameter_size,
        quantization=card.quantization,
        context_length=context_length or card.context_length,
    )


def effective_context(dispatcher: Dispatcher, card: ModelCard) -> int:
    """The context a runner gets for ``card`` (the backend's ``context``, else the model's own)."""
    try:
        backend = dispatcher.backend_for(card)
    except GatewayError:  # no backend serves it (its plugin is disabled): the model's own
        return card.context_length
    return backend.context(card) or card.context_length


def _capabilities(backend: Backend, card: ModelCard) -> list[str]:
    caps = backend.capabilities(card)
    flags = [
        ("completion", True),
        ("tools", caps.tools),
        ("vision", caps.vision),
        ("embedding", caps.embeddings),
        ("thinking", caps.reasoning),
    ]
    return [name for name, present in flags if present]


async def show(
    dispatcher: Dispatcher, registry: ModelRegistry, name: str, may_use: Callable[[str], bool] | None = None
) -> bytes:
    """``/api/show`` for ``name``: the card, the backend's description, and a user model's stored system prompt,
    template (over the backend's) and parameters (over the backend's); ``UnknownModel`` if there is none or the
    caller's key may not use it (``may_use``), ``NoCapacity`` when no backend serves it."""
    card = dispatcher.resolve(name, may_use)
    backend = dispatcher.backend_for(card)
    context = backend.context(card) or card.context_length
    described = await asyncio.to_thread(backend.describe, card)
    user = registry.get(card.name)
    template = user.template if user and user.template else described.template
    parameters = {**described.parameters, **(user.parameters if user else {})}
    return ollama_models.encode_show(
        info_of(card, context),
        path=card.path,
        model_info=described.model_info,
        capabilities=_capabilities(backend, card),
        template=template,
        system=user.system if user else "",
        parameters=parameters,
        license=described.license,
    )


async def ps(dispatcher: Dispatcher, instances: list, may_use: Callable[[str], bool] | None = None) -> bytes:
    """``/api/ps``: the loaded models, with their details and expiry: each model once, as its ready replica with
    the largest context shows it (an Ollama client knows one loaded copy of a model; ``/instances`` lists all);
    only the models the caller's key may use (``may_use``)."""
    loaded: list[tuple[ModelInfo, float | None, float]] = []
    largest: dict[str, Any] = {}
    for instance in instances:
        if isinstance(instance.state, Ready) and (may_use is None or may_use(instance.model)):
            known = largest.get(instance.model)
            if known is None or instance.placement.context > known.placement.context:
                largest[instance.model] = instance
    for instance in largest.values():
        try:
            card = dispatcher.resolve(instance.model)
        except UnknownModel:
            info = ModelInfo(name=instance.model, context_length=instance.placement.context or 0)
        else:
            info = info_of(card, instance.placement.context or effective_context(dispatcher, card))
        loaded.append((info, instance.expires_at, instance.updated_at))
    return ollama_models.encode_ps(loaded)


async def apply_keep_alive(dispatcher: Dispatcher, model: str, keep_alive: float | None) -> None:
    """Apply a request's parsed ``keep_alive`` to ``model``'s ready instances once the request is done."""
    await dispatcher.keep_alive(model, keep_alive)


async def _refresh(dispatcher: Dispatcher) -> None:
    await asyncio.to_thread(dispatcher.catalog.refresh)


def _derived(card: ModelCard, parent: UserModel | None, **overrides: Any) -> UserModel:
    """A registry entry for ``card``'s file, inheriting a parent entry's stored fields unless overridden."""
    fields: dict[str, Any] = {
        "system": parent.system if parent else "",
        "template": parent.template if parent else "",
        "parameters": dict(parent.parameters) if parent else {},
    }
    fields.update({k: v for k, v in overrides.items() if v is not None})
    return UserModel(path=card.path, digest=card.digest, created=time.time(), parent=card.name, **fields)


def _put(registry: ModelRegistry, name: str, entry: UserModel, param: str) -> None:
    try:
        registry.put(name, entry)
    except RegistryFull as exc:
        raise InvalidRequest(str(exc), param=param) from exc


async def copy(dispatcher: Dispatcher, registry: ModelRegistry, source: str, destination: str) -> None:
    """``/api/copy``: ``destination`` names ``source``'s file (and stored fields); ``UnknownModel`` if none,
    ``InvalidRequest`` for a destination that is no Ollama name or a full registry."""
    if not destination:
        raise InvalidRequest("destination is required", param="destination")
    name = normalize_model_name(ollama_models.parse_model_name(destination, "destination"))
    card = dispatcher.resolve(source)
    _put(registry, name, _derived(card, registry.get(card.name)), "destination")
    await _refresh(dispatcher)


async def delete(dispatcher: Dispatcher, registry: ModelRegistry, name: str) -> None:
    """``/api/delete``: unload, then remove a user model or hide another source's; ``UnknownModel`` if none,
    ``InvalidRequest`` for a name that is no Ollama name. A registry entry whose file has gone is removed too."""
    name = ollama_models.parse_model_name(name, "model")
    try:
        card = dispatcher.resolve(name)
    except UnknownModel:
        if registry.remove(normalize_model_name(name)):
            return
        raise
    await dispatcher.unload(card.name)
    if not registry.remove(card.name):
        registry.hide(card.name)
    await _refresh(dispatcher)


def _user_card(dispatcher: Dispatcher, name: str, entry: UserModel) -> ModelCard | None:
    """The card the catalog's user-model sources give ``entry`` (each reads the files of one format), or ``None``
    when none reads its file."""
    for source in dispatcher.catalog.sources:
        if isinstance(source, RegistrySource) and (card := source.card(name, entry)) is not None:
            return card
    return None


def _is_path(from_: str) -> bool:
    """Whether ``from`` names a file rather than a model, by its text alone (absolute, ``~``, ``./``, ``../``, or
    ending in ``.gguf``), so the answer never depends on which files exist."""
    return from_.startswith(("/", "~", ".")) or from_.lower().endswith(".gguf")


def _allowed_file(from_: str, roots: Sequence[Path]) -> str:
    """The file ``from_`` names, resolved (relative to ``roots[0]``, symlinks followed), if it lies under a root.

    Raises:
        InvalidRequest: outside every root, with one message whether or not the path exists; inside, when it
            names no file.
    """
    outside = InvalidRequest(
        f"'from' must be a GGUF file under the data directory ({roots[0]}) or MESHGATE_MODEL_DIRS", param="from"
    )
    try:
        path = (roots[0] / os.path.expanduser(from_)).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, an unreadable directory, a NUL byte
        raise outside from None
    if not any(path.is_relative_to(root) for root in roots):
        raise outside
    if not os.path.isfile(path):
        raise InvalidRequest(f"'from' names no file: {from_}", param="from")
    return str(path)


async def create(
    dispatcher: Dispatcher, registry: ModelRegistry, wire: ollama_models.CreateRequest, roots: Sequence[Path]
) -> AsyncIterator[bytes]:
    """``/api/create`` from a model file under ``roots`` (``model_roots``) or a model name; validates and registers
    before the first status line, so errors are real statuses. A file is a model when a user-model source of an
    enabled plugin reads it (``_user_card``; a GGUF needs the llama.cpp plugin)."""
    name = normalize_model_name(ollama_models.parse_model_name(wire.target, "model"))
    for field in ("files", "adapters", "quantize", "messages"):
        if getattr(wire, field):
            raise UnsupportedFeature(
                f"create with '{field}' is not supported; use 'from' with a GGUF path or a model name", param=field
            )
    if not wire.from_:
        raise InvalidRequest("neither 'from' nor 'files' was specified", param="from")
    overrides = {"system": wire.system, "template": wire.template, "parameters": wire.parameters}
    lines = [ollama_models.progress_line("parsing modelfile")]
    if _is_path(wire.from_):
        path = _allowed_file(wire.from_, roots)
        probe = UserModel(path=path, digest="", created=time.time())
        if await asyncio.to_thread(_user_card, dispatcher, name, probe) is None:
            raise InvalidRequest(f"'from' is not a model file meshgate can read: {wire.from_}", param="from")
        digest = await asyncio.to_thread(sha256_file, path)
        entry = _derived(ModelCard(name="", path=path, digest=digest), None, **overrides)
    else:
        card = dispatcher.resolve(wire.from_)
        entry = _derived(card, registry.get(card.name), **overrides)
    lines.append(ollama_models.progress_line(f"using existing layer sha256:{entry.digest}"))
    _put(registry, name, entry, "model")
    await _refresh(dispatcher)
    lines += [ollama_models.progress_line("writing manifest"), ollama_models.progress_line("success")]
    return _lines(lines)


async def pull(dispatcher: Dispatcher, registry: ModelRegistry, name: str) -> AsyncIterator[bytes]:
    """``/api/pull`` for a model meshgate has (shown again if hidden): the progress is the model's files read
    through (``gateway.models.pull``). Any other name fails as Ollama's pull of a name its registry lacks:
    ``pulling manifest``, then ``{"error": "pull model manifest: file does not exist"}`` (a 200 stream, or a 500
    without streaming)."""
    if name in registry.hidden() or normalize_model_name(name) in registry.hidden():
        registry.unhide(name)
        registry.unhide(normalize_model_name(name))
        await _refresh(dispatcher)
    try:
        card = dispatcher.resolve(name)
    except UnknownModel:
        no_manifest = ollama_models.error_line("pull model manifest: file does not exist") + b"\n"
        return _lines([ollama_models.progress_line("pulling manifest"), no_manifest])
    return pull_progress(card)


async def _lines(lines: list[bytes]) -> AsyncIterator[bytes]:
    for line in lines:
        yield line
