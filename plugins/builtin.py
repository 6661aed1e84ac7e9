"""The built-in llama.cpp plugin: the llama.cpp backend, the packaged and configured GGUF sources, the Hugging Face
checkpoints (``meshgate convert`` output and configured checkpoint directories), and
the registry of user models (Ollama ``/api/copy``, ``/api/create``; ``/api/delete`` hides the others).

Published as the ``llama_cpp`` entry point in meshgate's own ``pyproject.toml``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from meshgate.backends.base import Backend, ModelSource
from meshgate.backends.checkpoints import CheckpointSource
from meshgate.backends.llama_cpp import LlamaCppBackend
from meshgate.backends.llama_cpp.registry import HidingSource, ModelRegistry, RegistrySource
from meshgate.backends.llama_cpp.sources import GGUFPathSource, PackagedGGUFSource
from meshgate.plugins.hookspecs import hookimpl
from meshgate.plugins.settings import Settings


@hookimpl
def meshgate_register_backends(register: Callable[[Backend], None], settings: Settings,
                               http: httpx.AsyncClient) -> None:
    register(LlamaCppBackend(http, python=settings.runner_python, n_ctx=settings.n_ctx, threads=settings.threads,
                             cache_dir=str(Path(settings.data_dir) / "rpc-cache"), repack=settings.llama_repack,
                             parallel=settings.parallel, exact=settings.exact_batches))


@hookimpl
def meshgate_register_model_sources(register: Callable[[ModelSource], None], settings: Settings) -> None:
    registry = ModelRegistry(Path(settings.data_dir) / "registry.json")  # user models (Ollama copy/create/delete)
    register(RegistrySource(registry))
    register(HidingSource(PackagedGGUFSource(settings.models_dir), registry))
    if settings.models:
        register(HidingSource(GGUFPathSource(settings.model_paths(), Path(settings.data_dir)), registry))
    register(HidingSource(CheckpointSource(settings.models_dir / "hf", settings.model_paths()), registry))

