"""ggml's CPU reference kernels for batched decodes, so every row of a decode gets the numbers it gets alone.

ggml's tiled K-quant matmul takes decodes of 8 or more sequences and sums in another order than a single
sequence's ``vec_dot`` (``batch.TILED_ENV``). ``ggml_backend_cpu_set_use_ref(backend, true)`` sends the CPU
backend's matmuls back to ``vec_dot`` whatever their width. The scheduler turns it on for each decode of several
sequences and off again for prompt chunks, which keep the tiled kernel's numbers (the ones a prompt gets
alone) and its speed. Measured on Gemma 3 270M Q4_K_M, 2 threads (``benchmarks/row_exactness.py
--reference``): every row of 8, 9, 12 and 16 sequences is bit-identical to its single decode, and a decode of 8
costs what it costs with the tiled kernel (65.9 ms against 68.8 ms); without it 5 of 8 rows differ by up to
0.67 in a logit.

llama.h does not hand out a context's CPU backend, so ``cpu_backend(ctx)`` looks for it among the pointer-sized
words at the start of the ``llama_context`` object (the context keeps its CPU backend there): the word that points
at a backend whose first word is the CPU backend's guid, the one static address every CPU backend shares (read
once from a CPU backend made for the purpose). Every word is read through ``/proc/self/mem``, and no address found
by the scan is dereferenced in this process: reading that file succeeds even on pages the process may not touch
(guard pages, reserved arenas), so testing a candidate with ``ggml_backend_is_cpu`` itself, as an earlier version
did, could fault on one (a segfault seen once in CI). Nothing found (another llama.cpp layout, no ``/proc``) gives
``None``, and the scheduler decodes in groups below the tiled kernel's gate instead (``batch.DECODE_GROUP``).

Runs only in the runner process; imports llama_cpp (its bundled libggml-cpu) and ctypes.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import Any

__all__ = ["ReferenceKernels", "cpu_backend"]

_SCAN = 4096
"""Bytes of the ``llama_context`` object searched for its CPU backend (the pointer sits ~700 bytes in)."""


def _loaded(name: str) -> str:
    """The path of llama_cpp's ``name`` library as this process has it mapped.

    The wheel ships ``libggml-cpu.so`` and ``libggml-cpu.so.0`` as two files, not a link, and libllama loads the
    second: opening the first would map another copy, with statics (the CPU guid) of its own.
    """
    import llama_cpp

    folder = Path(llama_cpp.__file__).parent / "lib"
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if path.startswith(f"{folder}/{name}.so"):
                return path
    return str(folder / f"{name}.so")


@functools.cache
def _ggml_cpu() -> Any:
    lib = ctypes.CDLL(_loaded("libggml-cpu"))  # llama_cpp's own copy, the one its contexts run on
    lib.ggml_backend_cpu_init.argtypes = []
    lib.ggml_backend_cpu_init.restype = ctypes.c_void_p
    lib.ggml_backend_cpu_set_use_ref.argtypes = [ctypes.c_void_p, ctypes.c_bool]
    lib.ggml_backend_cpu_set_use_ref.restype = None
    return lib


@functools.cache
def _cpu_guid() -> int:
    """The address of the CPU backend's guid: the first word of every CPU backend (``ggml_backend.guid``)."""
    base = ctypes.CDLL(_loaded("libggml-base"))
    base.ggml_backend_free.argtypes = [ctypes.c_void_p]
    base.ggml_backend_free.restype = None
    backend = _ggml_cpu().ggml_backend_cpu_init()
    if not backend:
        raise OSError("ggml_backend_cpu_init returned NULL")
    try:
        return ctypes.c_void_p.from_address(backend).value or 0  # our own backend: safe to read
    finally:
        base.ggml_backend_free(backend)


def cpu_backend(ctx: Any) -> int | None:
    """The address of ``ctx``'s (a ``llama_context_p``) CPU backend, or ``None`` where it cannot be found."""
    try:
        guid = _cpu_guid()
        memory = open("/proc/self/mem", "rb", buffering=0)  # noqa: SIM115  # closed below
    except (OSError, AttributeError):
        return None
    with memory:

        def word(address: int) -> int | None:
            try:
                memory.seek(address)
                raw = memory.read(8)
            except (OSError, ValueError, OverflowError):
                return None
            return int.from_bytes(raw, "little") if len(raw) == 8 else None

        base = ctypes.cast(ctx, ctypes.c_void_p).value or 0
        found: set[int] = set()
        for offset in range(0, _SCAN, 8) if base and guid else ():
            candidate = word(base + offset)
            if candidate is None:
                break  # the end of what is mapped
            if candidate < 1 << 16 or candidate % 8:
                continue
            if word(candidate) == guid:  # a backend starts with its guid's address
                found.add(candidate)
    return found.pop() if len(found) == 1 else None


class ReferenceKernels:
    """``with kernels:`` runs what it holds on ggml's reference (``vec_dot``) matmuls; the CPU backend of one
    context, used from the thread that decodes on it."""

    def __init__(self, backend: int) -> None:
        self._set = _ggml_cpu().ggml_backend_cpu_set_use_ref
        self._backend = ctypes.c_void_p(backend)

    def __enter__(self) -> None:
        self._set(self._backend, True)

    def __exit__(self, *exc: object) -> None:
        self._set(self._backend, False)
