"""llama.cpp across RPC workers vs one process, at equal total threads.

    .venv/bin/python benchmarks/llama_rpc.py [--tokens 64] [--runs 3]

Starts meshgate's own runner and RPC worker processes on loopback (as node agents would) and prints, for each
configuration, prompt and decode tokens/s (from the runner's own timings), the ratio to one process, and the
resident memory of every process. Weight repacking is off everywhere, so every configuration computes the same
tokens (checked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshgate.backends.runner.client import RunnerClient  # noqa: E402
from meshgate.backends.runner.process import RunnerProcess  # noqa: E402
from meshgate.protocols.model import Request, Sampling, collect  # noqa: E402

PROMPT = (
    "Run {n}. The history of the printing press begins in the fifteenth century, when movable type changed "
    "how books were made. "
) * 6


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


async def worker(threads: int) -> RunnerProcess:
    return await RunnerProcess.start(
        [
            sys.executable,
            "-m",
            "meshgate.backends.llama_cpp.rpc",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--threads",
            str(threads),
        ],
        name="worker",
    )


async def configuration(
    gguf: str,
    layout: list[tuple[int | None, int, int]],
    head_threads: int,
    worker_threads: list[int],
    tokens: int,
    runs: int,
) -> dict:
    workers = [await worker(t) for t in worker_threads]
    shards = [(None if w is None else f"127.0.0.1:{workers[w].port}", a, b) for w, a, b in layout]
    head = await RunnerProcess.start(
        [
            sys.executable,
            "-m",
            "meshgate.backends.llama_cpp.runner",
            "--model",
            gguf,
            "--n-ctx",
            "1024",
            "--threads",
            str(head_threads),
            "--shards",
            json.dumps(shards),
        ],
        name="head",
    )
    try:
        async with httpx.AsyncClient() as http:
            client = RunnerClient(f"http://127.0.0.1:{head.port}", http)
            prompt_rates, decode_rates, texts = [], [], []
            for n in range(runs + 1):
                request = Request(
                    model="m", raw_prompt=PROMPT.format(n=n), max_tokens=tokens, sampling=Sampling(temperature=0.0)
                )
                response = await collect(client.generate(request))
                if n == 0:
                    continue  # warm-up
                u = response.usage
                prompt_rates.append(u.prompt_tokens / (u.prompt_ns / 1e9))
                decode_rates.append((u.completion_tokens - 1) / (u.eval_ns / 1e9))
                texts.append(response.text)
        memory = {"head": rss_mib(head.pid), **{f"worker {i}": rss_mib(w.pid) for i, w in enumerate(workers)}}
    finally:
        await head.stop()
        for w in workers:
            await w.stop()
    return {
        "prompt": statistics.median(prompt_rates),
        "decode": statistics.median(decode_rates),
        "memory": memory,
        "text": texts[0],
    }


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    data_dir = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
    gguf = str(next((data_dir / "models").glob("*.gguf")))
    configurations = {
        "one process, 2 threads": ([(None, 0, 18)], 2, []),
        "one process, 1 thread": ([(None, 0, 18)], 1, []),
        "2 workers x 1 thread (9+9 layers)": ([(0, 0, 9), (1, 9, 18)], 1, [1, 1]),
        "1 worker x 2 threads, whole model": ([(0, 0, 18)], 1, [2]),
        "head 1 thread (0-8) + 1 worker x 1 thread (9-17)": ([(None, 0, 9), (0, 9, 18)], 1, [1]),
    }
    results = {}
    for name, (layout, head_threads, worker_threads) in configurations.items():
        results[name] = await configuration(gguf, layout, head_threads, worker_threads, args.tokens, args.runs)
    base, single = results["one process, 2 threads"], results["one process, 1 thread"]
    print(f"Gemma 3 270M Q4_K_M, {args.tokens} tokens at temperature 0, median of {args.runs}; repacking off")
    print(
        f"{'configuration':50} {'prompt tok/s':>12} {'decode tok/s':>12} {'/2-thr':>7} {'/1-thr':>7}  same text"
        "  memory (MiB)"
    )
    for name, r in results.items():
        memory = ", ".join(f"{k} {v:.0f}" for k, v in r["memory"].items())
        print(
            f"{name:50} {r['prompt']:12.1f} {r['decode']:12.1f} {r['decode'] / base['decode']:7.3f} "
            f"{r['decode'] / single['decode']:7.3f}  {str(r['text'] == base['text']):9}  {memory}"
        )
    print(
        "ratios: decode tok/s over one process with 2 threads (/2-thr) and with 1 thread (/1-thr); a layer split "
        "runs its stages one after another, so each 1-thread stage compares with a 1-thread process. "
        "Target: >= 0.85 at equal threads."
    )


if __name__ == "__main__":
    asyncio.run(main())
