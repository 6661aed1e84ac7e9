"""Are a sequence's logits the same when its token is decoded alone and beside others in one ``llama_decode``?

Greedy text that does not depend on load needs every row of a batched decode to be bit-identical to the same
token decoded alone. This prefills ``--sequences`` different prompts (each on its own, as the runner does), then
decodes one more token of each: alone (the reference), then the first ``B`` sequences together for every batch
size ``B`` in ``--sizes``, and prints per size which rows differ and by how much (max |logit difference|) and
what the batch's decode took. The context is made as ``batch.Scheduler`` makes it. ``--tiled off`` (the default
here) turns ggml's tiled K-quant matmul off, ``--tiled on`` keeps llama.cpp's default (the kernel takes matmuls of
8 or more rows), ``--tiled force`` takes it for every size; ``--reference`` decodes the batches (not the single
rows) on ggml's reference matmuls, as the runner does (``backends.llama_cpp.cpu_kernels``; use it with ``--tiled
on``); ``--flash-attn``, ``--kv-unified``, ``--ubatch``, ``--type-k`` and ``--repack`` try other options.
``--trace B`` dumps every graph tensor (llama.cpp's ``cb_eval``) of the decode of ``B`` sequences and of each
alone, and prints for the first differing row the first op whose output differs: where the numbers part.

    .venv/bin/python benchmarks/row_exactness.py --sizes 1-16 [--tiled on|off|force]
    .venv/bin/python benchmarks/row_exactness.py --tiled on --trace 8
    .venv/bin/python benchmarks/row_exactness.py --tiled on --reference --sizes 2,4,7,8,9,12,16
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.determinism import prompts  # noqa: E402
from meshgate.backends.llama_cpp.batch import TILED_ENV  # noqa: E402
from meshgate.backends.llama_cpp.cpu_kernels import ReferenceKernels, cpu_backend  # noqa: E402
from meshgate.backends.llama_cpp.rpc import weight_repacking  # noqa: E402
from meshgate.backends.llama_cpp.sources import PackagedGGUFSource  # noqa: E402


class Tensor(ctypes.Structure):
    """The head of ggml.h's ``struct ggml_tensor`` (the vendored llama.cpp's layout), as far as ``name``."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


_DTYPES = {0: np.float32, 1: np.float16}  # GGML_TYPE_F32, GGML_TYPE_F16


def _array(t: Tensor) -> np.ndarray | None:
    dtype = _DTYPES.get(t.type)
    if dtype is None or not t.data:
        return None
    ne = [int(x) for x in t.ne]
    nb = [int(x) for x in t.nb]
    size = sum((n - 1) * s for n, s in zip(ne, nb, strict=True)) + np.dtype(dtype).itemsize
    raw = (ctypes.c_char * size).from_address(t.data)
    view = np.ndarray(shape=ne[::-1], dtype=dtype, buffer=raw, strides=nb[::-1])
    return np.array(view, dtype=np.float32)


class Recorder:
    """A ``cb_eval`` that keeps a copy of every F32/F16 node (name, op, src0 type, array) while ``on``."""

    def __init__(self, lib: Any) -> None:
        self.on = False
        self.nodes: list[tuple[str, int, int, np.ndarray]] = []

        def callback(pointer: int, ask: bool, _user: Any) -> bool:
            if not self.on:
                return False
            if ask:
                return True
            t = Tensor.from_address(pointer)
            arr = _array(t)
            if arr is not None:
                src0 = Tensor.from_address(t.src[0]).type if t.src[0] else -1
                self.nodes.append((t.name.decode(errors="replace"), t.op, src0, arr))
            return True

        self.callback = lib.ggml_backend_sched_eval_callback(callback)


def sizes(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, path: str) -> None:
        import llama_cpp as lib

        self.lib = lib
        with weight_repacking(args.repack):
            self.llm = lib.Llama(model_path=path, n_ctx=64, n_batch=64, n_threads=args.threads, verbose=False)
        n = args.sequences
        self.recorder = Recorder(lib)
        params = lib.llama_context_default_params()
        params.n_ctx = 512 * n
        params.n_batch = 512 + n
        params.n_ubatch = args.ubatch or params.n_batch
        params.n_seq_max = n
        params.kv_unified = args.kv_unified
        params.swa_full = True
        params.n_threads = params.n_threads_batch = args.threads
        params.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if args.flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.type_k = params.type_v = {"f16": 1, "f32": 0, "q8_0": 8}[args.type_k]
        params.cb_eval = self.recorder.callback
        self.ctx = lib.llama_init_from_model(self.llm._model.model, params)
        assert self.ctx, "no context"
        self.mem = lib.llama_get_memory(self.ctx)
        self.n_vocab = self.llm.n_vocab()
        self.batch = lib.llama_batch_init(512 + n, 0, 1)
        self.pos: list[int] = []
        self.next: list[int] = []
        for seq, text in enumerate(prompts(n)):
            chat = f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
            tokens = self.llm.tokenize(chat.encode(), add_bos=True, special=True)
            logits = self.decode([(seq, i, t) for i, t in enumerate(tokens)], last_only=True)
            self.pos.append(len(tokens))
            self.next.append(int(np.argmax(logits[0])))

    def decode(self, tokens: list[tuple[int, int, int]], *, last_only: bool = False) -> np.ndarray:
        b = self.batch
        for i, (seq, pos, token) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = token, pos, 1, seq
            b.logits[i] = not last_only or i == len(tokens) - 1
        b.n_tokens = len(tokens)
        assert self.lib.llama_decode(self.ctx, b) == 0
        rows = [len(tokens) - 1] if last_only else range(len(tokens))
        return np.array(
            [np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, r), shape=(self.n_vocab,)) for r in rows]
        )

    def step(self, seqs: list[int]) -> np.ndarray:
        """Decode the next token of ``seqs`` in one call, then forget it; the rows' logits."""
        logits = self.decode([(s, self.pos[s], self.next[s]) for s in seqs])
        for s in seqs:
            self.lib.llama_memory_seq_rm(self.mem, s, self.pos[s], -1)
        return logits

    def traced(self, seqs: list[int]) -> list[tuple[str, int, int, np.ndarray]]:
        self.recorder.nodes, self.recorder.on = [], True
        try:
            self.step(seqs)
        finally:
            self.recorder.on = False
        return self.recorder.nodes


def _row(arr: np.ndarray, width: int, row: int) -> np.ndarray | None:
    """Row ``row`` of a node computed for ``width`` tokens: along the first axis (outermost) of that size."""
    for axis, n in enumerate(arr.shape):
        if n == width:
            return np.take(arr, row, axis=axis)
    return None


def _ggml(name: str, restype: Any) -> Any:
    import llama_cpp

    fn = getattr(ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so")), name)
    fn.argtypes, fn.restype = [ctypes.c_int], restype
    return fn


def _op(op: int) -> str:
    return _ggml("ggml_op_name", ctypes.c_char_p)(op).decode()


def _type(t: int) -> str:
    return _ggml("ggml_type_name", ctypes.c_char_p)(t).decode() if t >= 0 else "-"


def trace(bench: Bench, width: int) -> None:
    batch = bench.traced(list(range(width)))
    ref = bench.step(list(range(width)))
    rows = [r for r in range(width) if not np.array_equal(ref[r], bench.step([r])[0])]
    print(f"{width} together: rows {rows} differ from their single decodes")
    for row in rows[:3]:
        alone = bench.traced([row])
        print(f"row {row}: {len(alone)} nodes alone, {len(batch)} in the batch")
        shown = 0
        for (name, op, src0, arr), (_, _, _, big) in zip(alone, batch, strict=False):
            mine = _row(big, width, row) if width > 1 else big
            if mine is None or mine.size != arr.size:
                continue
            diff = float(np.max(np.abs(mine.reshape(-1) - arr.reshape(-1))))
            if diff > 0:
                print(f"  differs: {name!r} {_op(op)} src0 {_type(src0)} shape={arr.shape} max|d|={diff:.3g}")
                shown += 1
                if shown >= 4:
                    break
        if not shown:
            print("  no common node differs (differences in nodes not matched by name/shape)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="1-16", help="batch sizes, e.g. 1-16 or 4,7,8,16")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--flash-attn", action="store_true")
    parser.add_argument("--kv-unified", action="store_true")
    parser.add_argument("--ubatch", type=int, default=0, help="n_ubatch (default: n_batch, as the runner)")
    parser.add_argument("--type-k", default="f16", choices=["f16", "f32", "q8_0"], help="KV cache type (K and V)")
    parser.add_argument("--repack", action="store_true", help="let llama.cpp repack weights (use_extra_bufts)")
    parser.add_argument("--reference", action="store_true", help="batches on ggml's reference matmuls (as the runner)")
    parser.add_argument("--trace", type=int, default=0, help="find the first differing op at this batch size")
    parser.add_argument("--model", default="", help="a GGUF (default: the packaged Gemma 3 270M)")
    parser.add_argument(
        "--tiled", default="off", choices=["off", "on", "force"], help="ggml's tiled K-quant matmul (see above)"
    )
    args = parser.parse_args()
    os.environ[TILED_ENV] = "0" if args.tiled == "off" else "1"  # read by ggml at its first matmul
    os.environ["GGML_CPU_TILED_MM_FORCE"] = "1" if args.tiled == "force" else "0"
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or PackagedGGUFSource(Path(tmp)).models()[0].path
        bench = Bench(args, path)
        if args.trace:
            trace(bench, args.trace)
            return
        single = np.array([bench.step([s])[0] for s in range(args.sequences)])
        kernels: Any = contextlib.nullcontext()
        if args.reference:
            backend = cpu_backend(bench.ctx)
            if backend is None:
                sys.exit("this context's CPU backend was not found")
            kernels = ReferenceKernels(backend)
        exact = True
        for width in sizes(args.sizes):
            started = time.perf_counter()
            with kernels:
                logits = bench.step(list(range(width)))
            took = (time.perf_counter() - started) * 1000
            diffs = np.max(np.abs(logits - single[:width]), axis=1)
            bad = {r: float(d) for r, d in enumerate(diffs) if d > 0}
            exact &= not bad
            detail = ", ".join(f"{r}: {d:.3g}" for r, d in bad.items()) or "all exact"
            print(f"{width:3d} sequences: {len(bad)} rows differ ({detail}); {took:.1f} ms")
        print("every row exact" if exact else "some rows differ")


if __name__ == "__main__":
    main()
