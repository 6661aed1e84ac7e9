"""What copying a cached prefix from one slot to another costs, against evaluating tokens.

The llama.cpp scheduler (``backends/llama_cpp/batch.py``) gives a job another slot's prefix by copying that slot's
whole KV stream (``llama_memory_seq_cp``; llama.cpp copies the buffers at the start of the next ``llama_decode``)
and cutting it back (``llama_memory_seq_rm``). This prefills ``--depth`` prompt tokens into sequence 0 of a context
made as the scheduler makes it (``--n-ctx`` cells a sequence, 2 sequences), then times, ``--repeat`` times each:

- copy: the copy into sequence 1, cut to the prefix, and the decode of one token after it (the copy lands there);
- 1 token: the same decode with the prefix already in sequence 1 (so copy minus this is the copy alone);
- ``MIN_REUSE`` tokens: evaluating that many prompt tokens at that depth (what a copy must save to pay).

    .venv/bin/python benchmarks/prefix_copy.py [--depth 4000] [--n-ctx 4096] [--threads 2] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llama_cpp  # noqa: E402

from meshgate.backends.llama_cpp.batch import CHUNK, MIN_REUSE, Scheduler  # noqa: E402
from meshgate.backends.llama_cpp.rpc import weight_repacking  # noqa: E402
from meshgate.backends.llama_cpp.sources import PackagedGGUFSource  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=4000, help="prefix tokens in the source sequence")
    parser.add_argument("--n-ctx", type=int, default=4096, help="KV cells of each sequence (what a copy moves)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = PackagedGGUFSource(Path(tmp)).models()[0].path
        with weight_repacking(False):  # as the engine loads it
            llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=args.threads, verbose=False)
        s = Scheduler(llm._model.model, n_ctx=args.n_ctx, parallel=2, n_threads=args.threads, is_eog=lambda _: False)
        try:
            measure(s, args)
        finally:
            s.free()


def measure(s: Scheduler, args: argparse.Namespace) -> None:
    lib, batch = llama_cpp, s.batch
    tokens = [2] + [(1000 + i * 7919) % 200000 for i in range(args.depth + MIN_REUSE)]

    def decode(seq: int, start: int, end: int) -> float:
        for n, pos in enumerate(range(start, end)):
            batch.token[n], batch.pos[n], batch.n_seq_id[n] = tokens[pos], pos, 1
            batch.seq_id[n][0], batch.logits[n] = seq, pos == end - 1
        batch.n_tokens = end - start
        began = time.perf_counter()
        if lib.llama_decode(s.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - began

    for start in range(0, args.depth, CHUNK):
        decode(0, start, min(args.depth, start + CHUNK))
    depth = args.depth
    copy, one, many = [], [], []
    for _ in range(args.repeat):
        lib.llama_memory_seq_rm(s.memory, 1, -1, -1)
        began = time.perf_counter()
        lib.llama_memory_seq_cp(s.memory, 0, 1, -1, -1)
        lib.llama_memory_seq_rm(s.memory, 1, depth, -1)
        decode(1, depth, depth + 1)
        copy.append(time.perf_counter() - began)
        lib.llama_memory_seq_rm(s.memory, 1, depth, -1)
        one.append(decode(1, depth, depth + 1))
        lib.llama_memory_seq_rm(s.memory, 1, depth, -1)
        many.append(decode(1, depth, depth + MIN_REUSE))
    ms = {name: 1000 * statistics.median(v) for name, v in (("copy", copy), ("one", one), ("many", many))}
    print(f"{args.n_ctx} cells a sequence, prefix {depth} tokens, {args.threads} threads, median of {args.repeat}")
    print(f"copy + 1 token decode: {ms['copy']:8.1f} ms   (the copy alone ~{ms['copy'] - ms['one']:.1f} ms)")
    print(f"1 token decode:        {ms['one']:8.1f} ms")
    print(f"{MIN_REUSE} prompt tokens:      {ms['many']:8.1f} ms")


if __name__ == "__main__":
    main()
