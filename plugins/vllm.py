"""The built-in vLLM plugin: vLLM's OpenAI server as the head runner, tensor and pipeline parallel, Ray across nodes.

Registered only where an interpreter with vLLM is known: ``MESHGATE_VLLM_PYTHON`` (a runtime venv), or this one
when ``pip install "meshgate[vllm]"`` put vLLM beside meshgate. Published as the ``vllm`` entry point.
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
from meshgate.plugins.settings import Settings

log = logging.getLogger("meshgate.plugins.vllm")


def vllm_python(settings: Settings) -> str | None:
    """The interpreter vLLM heads and Ray workers run with, or ``None`` when there is none."""
    if settings.vllm_python:
        return settings.vllm_python
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


@hookimpl
def meshgate_register_backends(register: Callable[[Backend], None], settings: Settings,
                               http: httpx.AsyncClient) -> None:
    python = vllm_python(settings)
    if python is None:
        log.debug("no interpreter with vLLM (set MESHGATE_VLLM_PYTHON): the vLLM backend is off")
        return
    register(VllmBackend(http, python=python, runtime_dir=str(settings.run_dir), n_ctx=settings.n_ctx,
                         tensor_per_node=settings.vllm_tensor_parallel,
                         pipeline_per_node=settings.vllm_pipeline_parallel, kv_cache_gib=settings.vllm_kv_cache_gib,
                         eager=settings.vllm_eager))
