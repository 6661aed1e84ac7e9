"""The built-in ``models`` plugin: the user-model registry and the Hugging Face checkpoints, for every backend.

Registers the Hugging Face checkpoint directories (``meshgate convert`` output under ``<data_dir>/models/hf`` and
configured checkpoint directories, ``backends.checkpoints.CheckpointSource``) and the user models (Ollama
``/api/copy``, ``/api/create``; ``/api/delete`` hides the others) that are checkpoint directories. It belongs to no
runtime, so disabling one (``MESHGATE_DISABLED_PLUGINS=llama_cpp``) keeps MLX and vLLM models listed; the plugins
of file formats (``llama_cpp`` for GGUF) register the user models of their format beside their own sources
(``backends.registry``).

Its sources come after other plugins' (``trylast``), so a backend plugin's own listing of a model wins: the
catalog lists the first model of a name, and a user model shadows the others of its name wherever it is listed.

Published as the ``models`` entry point in meshgate's own ``pyproject.toml``.
"""

from __future__ import annotations

from collections.abc import Callable

from meshgate.backends.base import ModelSource
from meshgate.backends.checkpoints import CheckpointSource, read_checkpoint
from meshgate.backends.registry import HidingSource, ModelRegistry, RegistrySource
from meshgate.plugins.hookspecs import hookimpl
from meshgate.plugins.settings import Settings


@hookimpl(trylast=True)
def meshgate_register_model_sources(register: Callable[[ModelSource], None], settings: Settings) -> None:
    registry = ModelRegistry.in_data_dir(settings.data_dir)
    register(RegistrySource(registry, read_checkpoint))
    register(HidingSource(CheckpointSource(settings.models_dir / "hf", settings.model_paths()), registry))
