"""Long prompts on the llama.cpp runner: prefill speed at depth, and how long a short request waits behind one.

Part 1 prefills a ``--depths`` token prompt (plain text made here, the same every run) through meshgate's
``batch.Scheduler`` (the runner's context: full-size sliding-window cache, no flash attention, chunks of
``CHUNK``) and through llama.cpp alone (low-level ``llama_decode``, one sequence, ubatches of 512 as llama.cpp's
default) with each settings variant: full SWA cache or not, flash attention or not. It prints seconds, prompt
tok/s, whether the next ``--greedy`` greedy tokens are the runner's, and the largest logit difference of the
prompt's last token from the runner's settings (0 means the same numbers: the same greedy text for any prompt).

Part 2 starts a ``--ttft-depth`` token prompt on a ``Scheduler``, submits a short chat prompt once the long one
has ``--ttft-at`` tokens in its cache (default: all but the last two chunks) and a chunk is being decoded, and
prints the short request's time to first token and the long prompt's prefill time, with the old policy (oldest
prompt first, a chunk never stopped: ``Scheduler(fair=False)``) and the new one (shortest remaining first, the
chunk in flight stopped for a newcomer).

The box's load average is printed with each table: other work on the cores slows every figure.

Measured 2026-12-02 on the 2-core box while other test suites ran (load average 5-9, so every rate is ~1/4 to
1/6 of an idle box's; compare rows, not absolutes), 8,192 tokens, greedy 16:

    | 8192 tokens                                        |     s | tok/s | greedy = runner's | max abs dlogit |
    | llama.cpp alone: full SWA cache, no FA (runner's)  | 244.4 |  33.5 | yes               | 0              |
    | meshgate Scheduler (parallel 4)                    | 182.1 |  45.0 | yes               | -              |
    | llama.cpp alone: full SWA cache, flash attention   | 178.2 |  46.0 | NO                | 1.14           |
    | llama.cpp alone: SWA-sized cache, no FA            |  87.1 |  94.1 | NO                | 0.91           |
    | llama.cpp alone: SWA-sized cache, flash attention  |  80.0 | 102.3 | yes (16 tokens)   | 0.99           |

    short request submitted at depth 7,168 of an 8,192-token prompt
    | policy                                 | short: first token | short: 8 tokens | long prefill | preempted |
    | oldest first (old)                     |            27.95 s |         28.15 s |      133.2 s | 0         |
    | shortest first, chunk preempted (new)  |             0.27 s |         15.73 s |       91.4 s | 1         |

    short request at depth 27,648 of a 28,672-token prompt (``--skip-prefill --ttft-depth 28672 --policies new``,
    load average 8-14: the long prefill took 1,927 s, 4.4x the 438 s of an idle box)
    | shortest first, chunk preempted (new)  |             2.45 s |        128.3 s |     1926.6 s | 1         |

    the same on the quiet box (load average 0.2-1.9, the same day, after slots began sharing prefixes):
    | shortest first, chunk preempted (new)  |             0.10 s |         21.7 s |      322.8 s | 1         |

The short request's later tokens wait for the long prompt's chunks (one chunk a step: ~18 s at 28k here).

    .venv/bin/python benchmarks/prefill.py                    # 8k, every variant; TTFT at 4k (~6 min, 2 cores)
    .venv/bin/python benchmarks/prefill.py --depths 8192,28672 --ttft-depth 28672   # ~1 h on 2 cores
    .venv/bin/python benchmarks/prefill.py --depths 28672 --variants swa-fa,swa --skip-ttft
    .venv/bin/python benchmarks/prefill.py --skip-prefill --ttft-depth 28672 --policies new
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshgate.backends.llama_cpp.batch import CHUNK, Job, Scheduler  # noqa: E402
from meshgate.backends.llama_cpp.rpc import weight_repacking  # noqa: E402
from meshgate.backends.llama_cpp.sampling import Sampler  # noqa: E402
from meshgate.backends.llama_cpp.sources import PackagedGGUFSource  # noqa: E402

VARIANTS = {  # name: (full-size SWA cache, flash attention)
    "full": (True, False),
    "full-fa": (True, True),
    "swa": (False, False),
    "swa-fa": (False, True),
}
NAMES = {
    "full": "full SWA cache, no FA (runner's)",
    "full-fa": "full SWA cache, flash attention",
    "swa": "SWA-sized cache, no FA",
    "swa-fa": "SWA-sized cache, flash attention",
}
SHORT = "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
WORDS = (
    "river stone lantern harbor winter orchard signal copper meadow engine letter garden thunder window market "
    "bridge candle forest compass ladder violin morning silver island shadow feather kitchen mountain station"
).split()


def long_text(llm: Any, n: int) -> list[int]:
    """``n`` tokens of plain made-up prose, the same every run."""
    rng = random.Random(7)
    sentences = []
    while True:
        words = [rng.choice(WORDS) for _ in range(rng.randrange(6, 14))]
        sentences.append(f"The {' '.join(words)} came back on day {len(sentences)}.")
        if len(sentences) % 200 == 0:
            tokens = llm.tokenize(" ".join(sentences).encode(), add_bos=True)
            if len(tokens) >= n:
                return tokens[:n]


def load(path: str) -> Any:
    import llama_cpp

    with weight_repacking(False):  # as the runner loads it
        return llama_cpp.Llama(model_path=path, n_ctx=64, n_batch=64, n_threads=2, verbose=False)


def raw(llm: Any, tokens: list[int], swa_full: bool, flash: bool, greedy: int, threads: int) -> dict[str, Any]:
    """llama.cpp alone: one sequence, ubatches of 512; prefill seconds, then ``greedy`` greedy tokens."""
    import llama_cpp as lib

    params = lib.llama_context_default_params()
    params.n_ctx = len(tokens) + greedy + 64
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = 1
    params.swa_full = swa_full
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lib.llama_init_from_model(llm._model.model, params)
    batch = lib.llama_batch_init(512, 0, 1)
    n_vocab = llm.n_vocab()

    def decode(start: int, chunk: list[int]) -> np.ndarray:
        for i, token in enumerate(chunk):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = token, start + i, 1, 0
            batch.logits[i] = i == len(chunk) - 1
        batch.n_tokens = len(chunk)
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, len(chunk) - 1), shape=(n_vocab,)).copy()

    try:
        started = time.perf_counter()
        for start in range(0, len(tokens), 512):
            logits = decode(start, tokens[start : start + 512])
        seconds = time.perf_counter() - started
        last, out = logits, []
        for i in range(greedy):
            out.append(int(logits.argmax()))
            logits = decode(len(tokens) + i, [out[-1]])
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
    return {"seconds": seconds, "greedy": out, "logits": last}


def _job(llm: Any, tokens: list[int], limit: int) -> Job:
    sampler = Sampler(
        llm.n_vocab(),
        temp=0.0,
        top_k=40,
        top_p=1.0,
        min_p=0.0,
        repeat_penalty=1.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        seed=0,
    )
    return Job(prompt=tokens, limit=limit, sampler=sampler, cancel=threading.Event())


def scheduler(llm: Any, n_ctx: int, parallel: int, threads: int, fair: bool = True) -> Scheduler:
    s = Scheduler(
        llm._model.model, n_ctx=n_ctx, parallel=parallel, n_threads=threads, is_eog=lambda _: False, fair=fair
    )
    threading.Thread(target=s.run, daemon=True).start()
    return s


def _tokens(job: Job) -> tuple[list[int], list[float]]:
    tokens, times = [], []
    while (item := job.out.get()) is not None:
        times.append(time.perf_counter())
        tokens.append(item[0])
    return tokens, times


def through_scheduler(llm: Any, tokens: list[int], greedy: int, parallel: int, threads: int) -> dict[str, Any]:
    s = scheduler(llm, len(tokens) + greedy + 64, parallel, threads)
    try:
        job = _job(llm, tokens, greedy)
        started = time.perf_counter()
        s.submit(job)
        out, times = _tokens(job)
    finally:
        s.close()
        time.sleep(0.5)
        s.free()
    return {"seconds": times[0] - started, "greedy": out, "logits": None}


def ttft(llm: Any, tokens: list[int], at: int, fair: bool, parallel: int, threads: int) -> dict[str, Any]:
    """Submit a short prompt once the long one holds ``at`` tokens and a chunk is in flight; the waits."""
    s = scheduler(llm, len(tokens) + 64, parallel, threads, fair=fair)
    try:
        long_job = _job(llm, tokens, 1)
        short_job = _job(llm, llm.tokenize(SHORT.encode(), add_bos=True, special=True), 8)
        started = time.perf_counter()
        s.submit(long_job)
        results: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: results.update(long=_tokens(long_job)))
        reader.start()
        while not (long_job.fed >= at and s._inflight is long_job):
            time.sleep(0.005)
        submitted = time.perf_counter()
        s.submit(short_job)
        short, short_times = _tokens(short_job)
        reader.join()
        long_times = results["long"][1]
    finally:
        s.close()
        time.sleep(0.5)
        s.free()
    return {
        "short_ttft": short_times[0] - submitted,
        "short_done": short_times[-1] - submitted,
        "long_prefill": long_times[0] - started,
        "preempted": s.preempted,
        "short": short,
    }


def load_avg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF path (default: the packaged Gemma 3 270M)")
    parser.add_argument("--depths", default="8192", help="prompt lengths for part 1, comma separated")
    parser.add_argument(
        "--variants",
        default="scheduler," + ",".join(VARIANTS),
        help="part 1's rows (the runner's settings, full, always)",
    )
    parser.add_argument("--greedy", type=int, default=16, help="greedy tokens compared after each prompt")
    parser.add_argument("--ttft-depth", type=int, default=4096, help="the long prompt of part 2")
    parser.add_argument("--ttft-at", type=int, default=None, help="submit the short one at this depth")
    parser.add_argument("--policies", default="old,new", help="part 2's rows: old (oldest first), new")
    parser.add_argument("--parallel", type=int, default=4, help="the scheduler's slots (the runner's default)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-ttft", action="store_true")
    args = parser.parse_args()
    path = args.model or PackagedGGUFSource(Path(__file__).resolve().parent.parent / ".cache/test-data/models")
    path = path if isinstance(path, str) else path.models()[0].path
    llm = load(path)
    print(f"{Path(path).name}, {args.threads} threads, {os.cpu_count()} cores, chunk {CHUNK}")

    if not args.skip_prefill:
        variants = args.variants.split(",")
        for depth in [int(d) for d in args.depths.split(",")]:
            tokens = long_text(llm, depth)
            rows = []
            reference = None
            print(f"\nprefill of {depth} tokens (load average before: {load_avg()})", flush=True)
            for name in ["full", *[v for v in variants if v != "full"]]:  # the runner's numbers first: the reference
                if name == "scheduler":
                    result = through_scheduler(llm, tokens, args.greedy, args.parallel, args.threads)
                    label = f"meshgate Scheduler (parallel {args.parallel})"
                else:
                    result = raw(llm, tokens, *VARIANTS[name], args.greedy, args.threads)
                    label = f"llama.cpp alone: {NAMES[name]}"
                reference = reference or result
                same = "yes" if result["greedy"] == reference["greedy"] else "NO"
                diff = (
                    "-" if result["logits"] is None else f"{np.abs(result['logits'] - reference['logits']).max():.3g}"
                )
                rows.append((label, result["seconds"], depth / result["seconds"], same, diff))
                print(f"  {label:<52} {result['seconds']:7.1f} s {depth / result['seconds']:7.1f} tok/s", flush=True)
            print(f"\n| {depth} tokens | s | prompt tok/s | greedy {args.greedy} = runner's | max abs dlogit |")
            print("|---|---:|---:|---|---:|")
            for label, seconds, rate, same, diff in rows:
                print(f"| {label} | {seconds:.1f} | {rate:.1f} | {same} | {diff} |")
            print(f"(load average after: {load_avg()})", flush=True)

    if not args.skip_ttft:
        tokens = long_text(llm, args.ttft_depth)
        at = args.ttft_at if args.ttft_at is not None else max(0, (len(tokens) - 1) // CHUNK - 1) * CHUNK
        print(f"\nshort request ({SHORT!r}) submitted at depth {at} of a {len(tokens)}-token prompt", flush=True)
        print(f"(load average before: {load_avg()})")
        rows = []
        for fair in [policy == "new" for policy in args.policies.split(",")]:
            r = ttft(llm, tokens, at, fair, args.parallel, args.threads)
            label = "shortest first, chunk preempted (new)" if fair else "oldest first (old)"
            rows.append((label, r))
            print(f"  {label}: {r}", flush=True)
        print("\n| policy | short: first token | short: 8 tokens | long prompt's prefill | chunks preempted |")
        print("|---|---:|---:|---:|---:|")
        for label, r in rows:
            print(
                f"| {label} | {r['short_ttft']:.2f} s | {r['short_done']:.2f} s | {r['long_prefill']:.1f} s "
                f"| {r['preempted']} |"
            )
        same = all(r["short"] == rows[0][1]["short"] for _, r in rows)
        print(f"same short text under every policy: {same}; load average after: {load_avg()}")


if __name__ == "__main__":
    main()
