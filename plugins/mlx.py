"""The built-in MLX plugin: mlx-lm ranks over MLX's ring backend, for Hugging Face checkpoints.

Registered only where an interpreter with mlx-lm is known: ``MESHGATE_MLX_PYTHON`` (a runtime venv), or this
one when ``pip install "meshgate[mlx]"`` put mlx-lm beside meshgate. Its own settings (``MlxSettings``) are read
here, not by the core ``Settings``; its runners' KV tiers take the llama.cpp plugin's settings
(``MESHGATE_KV_RAM_MIB``, ``MESHGATE_KV_DISK_MIB``, ``MESHGATE_KV_DIR``: one budget per runner and one directory per
node, whichever runtime). Published as the ``mlx`` entry point.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from meshgate.backends.base import Backend
from meshgate.backends.mlx import MlxBackend
from meshgate.plugins.builtin import LlamaCppSettings, kv_tiers
from meshgate.plugins.hookspecs import hookimpl
from meshgate.plugins.settings import PluginSettings, Settings

__all__ = ["MlxSettings", "mlx_python"]

log = logging.getLogger("meshgate.plugins.mlx")


class MlxSettings(PluginSettings, frozen=True):
    """The MLX plugin's own settings, each from ``MESHGATE_<NAME>``.

    Attributes:
        mlx_python: Interpreter with ``mlx`` and ``mlx-lm`` for MLX ranks (default: this one, if it has them).
    """

    mlx_python: str | None = None


def mlx_python(settings: Settings) -> str | None:
    """The interpreter MLX ranks run with, or ``None`` when there is none."""
    own = MlxSettings.from_settings(settings)
    if own.mlx_python:
        return own.mlx_python
    return sys.executable if importlib.util.find_spec("mlx_lm") is not None else None


@hookimpl
def meshgate_register_backends(
    register: Callable[[Backend], None], settings: Settings, http: httpx.AsyncClient
) -> None:
    python = mlx_python(settings)
    if python is None:
        log.debug("no interpreter with mlx-lm (set MESHGATE_MLX_PYTHON): the MLX backend is off")
        return
    register(
        MlxBackend(
            http,
            python=python,
            n_ctx=settings.runner_context,
            runtime_dir=str(settings.run_dir),
            parallel=settings.parallel,
            **kv_tiers(LlamaCppSettings.from_settings(settings), Path(settings.data_dir)),
        )
    )
