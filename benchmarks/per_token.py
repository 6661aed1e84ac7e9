"""Where a streamed token's time goes: the same greedy decode measured at each layer meshgate adds, in one run.

    .venv/bin/python benchmarks/per_token.py [--levels 1,8] [--tokens 128] [--threads 2] [--stages raw,...]
    .venv/bin/python benchmarks/per_token.py --interleave 6 --intervals 50 --tokens 256    # raw against gateway

Each stage decodes ``--tokens`` greedy tokens for N sequences at once (N in ``--levels``), on the packaged Gemma 3
270M GGUF with ``--threads`` llama.cpp threads, and reports its decode rate: tokens per second over the window in
which every sequence is past its first token and none has ended (so prefill and uneven ends are left out, the
same window at every stage). The stages, each a layer on top of the one before:

- ``raw``: llama.cpp alone through llama-cpp-python's low-level API (``concurrency.RawDecoder``): one
  ``llama_batch`` per step, greedy argmax, nothing else on the machine's cores; ``raw-ref``: the same with ggml's
  reference matmuls on for batches (what exact batches decode with: ``cpu_kernels``);
- ``scheduler``: meshgate's decode loop (``batch.Scheduler``) with a consumer thread per sequence that only takes
  the tokens off its queue;
- ``engine``: ``LlamaEngine.generate`` on a thread per request, as the runner runs it (detokenizing, stop
  strings, tool-call gates, events);
- ``runner``: a runner process over HTTP, read with the gateway's own ``RunnerClient``;
- ``gateway``: ``meshgate serve`` with its runner, read as OpenAI chat streams by an httpx client.

The difference between two stages is what that layer costs per token (1 sequence) or per step (N). Every loop
is bounded. ``--interleave N`` runs only raw and gateway, N rounds of the two back to back (ABBA), and reports each
round's ratio and their median: on a VM whose speed drifts by 10% between minutes, the ratio within a round is the
figure to trust. Run it on a quiet machine: another process on the cores changes every figure (llama.cpp's threads wait
for each other at every operation, so a thread that loses its core holds the others).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.concurrency import PROMPTS, SYSTEM, RawDecoder, packaged_gguf  # noqa: E402

STAGES = ("raw", "raw-ref", "scheduler", "engine", "runner", "gateway")


def window_rate(stamps: Sequence[Sequence[tuple[float, float]]]) -> float:
    """Tokens per second while every stream is past its first token and none has had its last."""
    start = max(s[0][0] for s in stamps)
    end = min(s[-1][0] for s in stamps)
    if end <= start:
        raise RuntimeError("the streams did not overlap: too few tokens")
    tokens = sum(k for s in stamps for t, k in s if start < t <= end)
    return tokens / (end - start)


def request(i: int, tokens: int):
    from meshgate.protocols.model import Message, Request, Sampling, TextPart

    prompt = PROMPTS[i % len(PROMPTS)]
    return Request(
        model="m",
        messages=(
            Message(role="system", parts=(TextPart(text=SYSTEM),)),
            Message(role="user", parts=(TextPart(text=prompt),)),
        ),
        sampling=Sampling(temperature=0.0),
        max_tokens=tokens,
    )


def threaded(n: int, one: Callable[[int, list[tuple[float, int]]], None]) -> float:
    stamps: list[list[tuple[float, int]]] = [[] for _ in range(n)]
    threads = [threading.Thread(target=one, args=(i, stamps[i])) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return window_rate(stamps)


class InProcess:
    """The scheduler and engine stages: one ``LlamaEngine`` loaded here."""

    def __init__(self, gguf: str, threads: int, parallel: int, n_ctx: int) -> None:
        from meshgate.backends.llama_cpp.engine import LlamaEngine

        self.engine = LlamaEngine(gguf, n_ctx=n_ctx, n_threads=threads, parallel=parallel)

    def scheduler(self, n: int, tokens: int) -> float:
        from meshgate.backends.llama_cpp.batch import Job

        engine = self.engine

        def one(i: int, stamps: list[tuple[float, int]]) -> None:
            prompt = engine.llm.tokenize(PROMPTS[i % len(PROMPTS)].encode())
            sampler = engine._sampler(request(i, tokens))
            job = Job(prompt=prompt, limit=tokens, sampler=sampler, cancel=threading.Event())
            engine.scheduler.submit(job)
            while job.out.get(timeout=600) is not None:
                stamps.append((time.perf_counter(), 1))

        return threaded(n, one)

    def generate(self, n: int, tokens: int) -> float:
        from meshgate.protocols.model import TextDelta

        def one(i: int, stamps: list[tuple[float, int]]) -> None:
            for event in self.engine.generate(request(i, tokens), threading.Event()):
                if isinstance(event, TextDelta):
                    stamps.append((time.perf_counter(), max(1, len(event.tokens))))

        return threaded(n, one)

    def close(self) -> None:
        self.engine.scheduler.close()


def runner_stage(
    gguf: str, threads: int, parallel: int, n_ctx: int, levels: list[int], tokens: int, interval_ms: int
) -> dict[int, float]:
    """A runner process (its own secret) holding tokens ``interval_ms`` after a write (``--stream-interval``), each
    level's streams read with ``RunnerClient``."""
    import httpx

    from meshgate.backends.runner.client import RunnerClient
    from meshgate.protocols.model import TextDelta

    env = {**os.environ, "MESHGATE_RUNNER_SECRET": "per-token-bench", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "meshgate.backends.llama_cpp.runner", "--model", gguf, "--n-ctx", str(n_ctx)]
    argv += ["--threads", str(threads), "--parallel", str(parallel), "--stream-interval", str(interval_ms / 1000)]
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL}
    proc = subprocess.Popen(argv, env=env, text=True, **pipes)
    try:
        port = None
        assert proc.stdout is not None
        for line in proc.stdout:
            if found := re.search(r"READY port=(\d+)", line):
                port = int(found.group(1))
                break
        if port is None:
            raise RuntimeError("the runner did not start")

        async def level(n: int) -> float:
            async with httpx.AsyncClient(timeout=600) as http:
                client = RunnerClient(f"http://127.0.0.1:{port}", http, secret="per-token-bench")
                stamps: list[list[tuple[float, int]]] = [[] for _ in range(n)]

                async def one(i: int) -> None:
                    async for event in client.generate(request(i, tokens)):
                        if isinstance(event, TextDelta):
                            stamps[i].append((time.perf_counter(), max(1, len(event.tokens))))

                await asyncio.gather(*(one(i) for i in range(n)))
                return window_rate(stamps)

        steady(lambda: asyncio.run(level(1)))
        return {n: max(asyncio.run(level(n)) for _ in range(3)) for n in levels}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class Gateway:
    """``meshgate serve`` on the packaged model (``MESHGATE_LLAMA_STREAM_INTERVAL_MS``), read as OpenAI chat streams
    by an httpx client; ``level(n)`` is one run of ``n`` streams. A content chunk carries one token or a burst: each
    counts its share of the stream's tokens (``usage``) by its share of the text."""

    def __init__(self, threads: int, parallel: int, n_ctx: int, interval_ms: int) -> None:
        from benchmarks.concurrency import calibrated
        from tests.conftest import Server

        data_dir = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
        env = {"MESHGATE_PARALLEL": str(parallel), "MESHGATE_LLAMA_STREAM_INTERVAL_MS": str(interval_ms)}
        self.threads = threads
        self.cpu: dict[int, list[tuple[float, float]]] = {}  # per level: relay and client ms of CPU a token, a run
        self.server = Server(data_dir, "--threads", str(threads), "--n-ctx", str(n_ctx), env=env)
        try:
            self.level(1, 4)  # loads the model
            calibrated(self.server.url, 600, lambda *a: None)
            settle()  # the node agent measures llama.cpp in a subprocess of its own at first: not beside a level
            steady(lambda: self.level(1, 32))
            self.cpu.clear()
        except BaseException:
            self.server.stop()
            raise

    def level(self, n: int, tokens: int) -> float:
        return asyncio.run(self._level(n, tokens))

    async def _level(self, n: int, tokens: int) -> float:
        import json

        import httpx

        stamps: list[list[tuple[float, float]]] = [[] for _ in range(n)]
        limits = httpx.Limits(max_connections=n + 4)
        async with httpx.AsyncClient(base_url=self.server.url, timeout=600, limits=limits, trust_env=False) as http:

            async def one(i: int) -> None:
                body = {
                    "model": "gemma3:270m",
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": PROMPTS[i % len(PROMPTS)]},
                    ],
                    "max_tokens": tokens,
                    "temperature": 0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                chunks: list[tuple[float, int]] = []  # (arrival, characters)
                total = 0
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                                chunks.append((time.perf_counter(), len(chunk["choices"][0]["delta"]["content"])))
                            if chunk.get("usage"):
                                total = chunk["usage"]["completion_tokens"]
                chars = sum(c for _, c in chunks) or 1
                stamps[i] = [(t, c * total / chars) for t, c in chunks]

            before = thread_seconds(self.server.proc.pid), time.process_time()
            await asyncio.gather(*(one(i) for i in range(n)))
            made = sum(sum(k for _, k in s) for s in stamps)
            relay = relay_ms(before[0], thread_seconds(self.server.proc.pid), made, self.threads)
            client = 1000 * (time.process_time() - before[1]) / max(made, 1.0)
            self.cpu.setdefault(n, []).append((relay, client))
            return window_rate(stamps)

    def least_cpu(self) -> dict[int, tuple[float, float]]:
        """Each level's least relay and client CPU a token over its runs: what the layers cost with the least
        interference."""
        return {n: (min(r for r, _ in runs), min(c for _, c in runs)) for n, runs in self.cpu.items()}

    def stop(self) -> None:
        self.server.stop()


def gateway_stage(
    threads: int,
    parallel: int,
    n_ctx: int,
    levels: list[int],
    tokens: int,
    interval_ms: int,
    cpu: dict[int, tuple[float, float]],
) -> dict[int, float]:
    """Each level's best of three runs through a ``Gateway``; ``cpu`` gets the least CPU a token of each."""
    gateway = Gateway(threads, parallel, n_ctx, interval_ms)
    try:
        rates = {n: max(gateway.level(n, tokens) for _ in range(3)) for n in levels}
        cpu.update(gateway.least_cpu())
        return rates
    finally:
        gateway.stop()


def interleaved(
    raw: RawDecoder, gateway: Gateway, levels: list[int], tokens: int, rounds: int
) -> dict[int, list[tuple[float, float]]]:
    """``rounds`` pairs of runs a level, raw llama.cpp and the gateway back to back, in ABBA order (raw first in
    even rounds): each pair shares the machine's state of the moment, so the ratio within a pair is free of the
    drift between minutes that moves either rate more than the relay costs. Both are loaded the whole time; the
    one not measured is idle."""
    pairs: dict[int, list[tuple[float, float]]] = {n: [] for n in levels}
    for r in range(rounds):
        for n in levels:
            if r % 2 == 0:
                raw_rate = raw.decode_rate(n, tokens, PROMPTS)
                gateway_rate = gateway.level(n, tokens)
            else:
                gateway_rate = gateway.level(n, tokens)
                raw_rate = raw.decode_rate(n, tokens, PROMPTS)
            pairs[n].append((raw_rate, gateway_rate))
    return pairs


def pairs_table(pairs: dict[int, list[tuple[float, float]]], interval_ms: int) -> str:
    lines = [
        f"Interleaved, gateway at {interval_ms} ms: each round's raw and gateway tok/s and their ratio",
        "| streams | rounds | raw tok/s (median) | gateway tok/s (median) | ratio median | ratio range |",
        "|---|---|---|---|---|---|",
    ]
    for n, runs in pairs.items():
        ratios = sorted(g / r for r, g in runs)
        raw_m = statistics.median(r for r, _ in runs)
        gw_m = statistics.median(g for _, g in runs)
        lines.append(
            f"| {n} | {len(runs)} | {raw_m:.1f} | {gw_m:.1f} | {statistics.median(ratios):.3f}x | "
            f"{ratios[0]:.3f}-{ratios[-1]:.3f}x |"
        )
        lines.append("| | | " + ", ".join(f"{r:.1f}/{g:.1f}" for r, g in runs) + " | | | |")
    return "\n".join(lines)


def thread_seconds(pid: int) -> dict[int, float]:
    """Seconds on a CPU of each thread of ``pid`` and of its descendants' threads, by thread id."""
    pids, children = [pid], {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    for parent in pids:
        pids.extend(children.get(parent, []))
    seconds = {}
    for one in pids:
        for task in Path(f"/proc/{one}/task").glob("*"):
            try:  # nanoseconds on a CPU (the scheduler's own count; stat's ticks are 10 ms)
                seconds[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
            except (OSError, ValueError, IndexError):
                continue
    return seconds


def relay_ms(before: dict[int, float], after: dict[int, float], tokens: float, compute: int) -> float:
    """Milliseconds of CPU a token outside the ``compute`` busiest threads (llama.cpp's) between two readings."""
    used = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    return 1000 * sum(used[compute:]) / max(tokens, 1.0)


def steady(run: Callable[[], float], tries: int = 6) -> None:
    """Warm-up: ``run`` until two runs in a row agree within 5% (the first streams after a start stall now and then
    for seconds: imports, first allocations, the tier's first writes)."""
    previous = 0.0
    for _ in range(tries):
        rate = run()
        if previous and abs(rate - previous) <= 0.05 * previous:
            return
        previous = rate


def settle(limit: float = 120.0) -> None:
    """Wait (at most ``limit`` seconds) until the machine's CPUs are idle for a second: 90% or more."""

    def times() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:8]]
        return values[3] + values[4], sum(values)

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        idle, total = times()
        time.sleep(1.0)
        idle2, total2 = times()
        if (idle2 - idle) >= 0.9 * max(1, total2 - total):
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,8")
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of each stream (greedy)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parallel", type=int, default=8, help="the runner's slots (MESHGATE_PARALLEL)")
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--stages", default=",".join(STAGES))
    parser.add_argument(
        "--intervals",
        default="0,50",
        help="the runner's stream interval(s) in ms (MESHGATE_LLAMA_STREAM_INTERVAL_MS): runner and gateway rows each",
    )
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        help="rounds of raw and gateway runs back to back (ABBA), a ratio a round, instead of the stages one after "
        "another (each interval in turn; --stages is then ignored)",
    )
    args = parser.parse_args()
    intervals = [int(v) for v in args.intervals.split(",")]
    levels = [int(n) for n in args.levels.split(",")]
    stages = [s for s in args.stages.split(",") if s]
    data_dir = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
    gguf = str(packaged_gguf(data_dir))
    if args.interleave:
        raw = RawDecoder(gguf, args.threads, args.n_ctx)
        raw.decode_rate(1, 4, PROMPTS)
        for ms in intervals:
            gateway = Gateway(args.threads, args.parallel, args.n_ctx, ms)
            try:
                pairs = interleaved(raw, gateway, levels, args.tokens, args.interleave)
            finally:
                gateway.stop()
            print(pairs_table(pairs, ms), flush=True)
            cpu_line = ", ".join(f"{n}: {r:.3f} / {c:.3f}" for n, (r, c) in gateway.least_cpu().items())
            print(f"CPU a token, ms, relay / client (least of the rounds): {cpu_line}\n", flush=True)
        return
    rates: dict[str, dict[int, float]] = {}
    cpu: dict[str, dict[int, tuple[float, float]]] = {}  # gateway rows: relay and client ms of CPU a token
    if "raw" in stages or "raw-ref" in stages:
        raw = RawDecoder(gguf, args.threads, args.n_ctx)
        raw.decode_rate(1, 4, PROMPTS)
        if "raw" in stages:
            rates["raw"] = {n: max(raw.decode_rate(n, args.tokens, PROMPTS) for _ in range(2)) for n in levels}
        if "raw-ref" in stages:
            rates["raw-ref"] = {n: max(raw_reference(raw, n, args.tokens) for _ in range(2)) for n in levels}
    if "scheduler" in stages or "engine" in stages:
        here = InProcess(gguf, args.threads, args.parallel, args.n_ctx)
        try:
            here.generate(1, 8)
            if "scheduler" in stages:
                rates["scheduler"] = {n: max(here.scheduler(n, args.tokens) for _ in range(2)) for n in levels}
            if "engine" in stages:
                rates["engine"] = {n: max(here.generate(n, args.tokens) for _ in range(2)) for n in levels}
        finally:
            here.close()
    for k, ms in enumerate(intervals):  # an interval named twice runs twice (alternate them: the box drifts)
        if "runner" in stages:
            row = f"runner, {ms} ms" + (f" ({k + 1})" if intervals.count(ms) > 1 else "")
            rates[row] = runner_stage(gguf, args.threads, args.parallel, args.n_ctx, levels, args.tokens, ms)
    for k, ms in enumerate(intervals):
        if "gateway" in stages:
            row = f"gateway, {ms} ms" + (f" ({k + 1})" if intervals.count(ms) > 1 else "")
            cpu[row] = {}
            rates[row] = gateway_stage(args.threads, args.parallel, args.n_ctx, levels, args.tokens, ms, cpu[row])
    print(table(rates, levels, args))
    if cpu:
        print("\nCPU a token, ms: gateway + runner outside llama.cpp's threads / the client (least of 3 runs)")
        for row, by_level in cpu.items():
            print(f"| {row} | " + " | ".join(f"{n}: {r:.3f} / {c:.3f}" for n, (r, c) in by_level.items()) + " |")


def raw_reference(raw: RawDecoder, n: int, tokens: int) -> float:
    """``raw``'s decode with ggml's reference matmuls on for the whole run (``cpu_kernels``), if they can be had."""
    import llama_cpp as lib

    from meshgate.backends.llama_cpp.cpu_kernels import ReferenceKernels, cpu_backend

    made, free = lib.llama_init_from_model, lib.llama_free
    kernels: list[ReferenceKernels] = []

    def init(model, params):  # the raw loop's context, with the reference kernels on for its whole run
        ctx = made(model, params)
        backend = cpu_backend(ctx)
        if backend is not None:
            kernels.append(ReferenceKernels(backend))
            kernels[-1].__enter__()
        return ctx

    def release(ctx):  # off again before the context (and its backend) goes
        while kernels:
            kernels.pop().__exit__(None, None, None)
        free(ctx)

    lib.llama_init_from_model, lib.llama_free = init, release
    try:
        return raw.decode_rate(n, tokens, PROMPTS)
    finally:
        lib.llama_init_from_model, lib.llama_free = made, free


def table(rates: dict[str, dict[int, float]], levels: list[int], args: argparse.Namespace) -> str:
    base = rates.get("raw", {})
    lines = [
        f"Gemma 3 270M Q4_K_M, greedy, {args.tokens} tokens a stream, {args.threads} llama.cpp threads, "
        f"{args.parallel} slots; decode rate in tok/s (x raw; ms a step more than raw)",
        "| stage | " + " | ".join(f"{n} stream{'s' if n > 1 else ''}" for n in levels) + " |",
        "|---" * (len(levels) + 1) + "|",
    ]
    for stage, by_level in rates.items():
        cells = []
        for n in levels:
            rate = by_level[n]
            if stage == "raw" or n not in base:
                cells.append(f"{rate:.1f}")
            else:
                extra = (n / rate - n / base[n]) * 1000
                cells.append(f"{rate:.1f} ({rate / base[n]:.2f}x; {extra:+.2f} ms)")
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
