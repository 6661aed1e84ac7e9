"""What the KV tier saves: time to first token from each home of a prompt's KV, and prefill spent by agents taking
turns on fewer slots than agents.

Runs the llama.cpp scheduler (``backends/llama_cpp/batch.py``) on the packaged Gemma 3 270M in this process, as a
runner runs it, with its tier (``backends/runner/kvtier.py``) in host memory and in a temporary directory:

1. A ``--prefix``-token prompt (an agent's system prompt and tools), greedy ``--tokens`` tokens, time to first
   token: cold (no tier); warm in its slot (the same prompt again, no tier: slot reuse); from the RAM tier (a
   fresh scheduler, its slots empty, the same tier); from disk after a restart (a fresh tier over the directory:
   its host memory empty; the entry is read, checked and restored). Every answer's tokens are compared with cold.
2. ``--agents`` agents with distinct ``--agent-prefix``-token prompts take ``--turns`` turns each, in rounds, on a
   runner with ``--slots`` slots (each turn adds the answer and a new question): prompt tokens evaluated in turns
   2 and later, and the share of each agent's prefix restored rather than evaluated, without and with the tier.

With ``--peers``, runner processes too: one over the table's disk tier, a second that fetches the prompt from it on
demand (over loopback HTTP, the link taken to be ``--bandwidth``), a third told to warm from it (a new replica).

    .venv/bin/python benchmarks/kv_cache.py [--prefix 8000 18714] [--peers] [--agents 12] [--agent-prefix 2500]

Measured 2026-12-05 on the 2-core box, quiet, 2 threads. Exact mode (the default: an entry is restored at its
last restore point and its last chunk, 1-256 tokens, evaluated again), ``--prefix 8000 18714`` (prompts of exactly
that many tokens):

    | from                                      | TTFT 8,000 | TTFT 18,714 | same tokens as cold |
    | cold                                      | 43.93 s    | 161.06 s    | -                   |
    | warm in its slot (exact reuse)            | 0.55 s     | 0.49 s      | yes                 |
    | RAM tier, slots empty                     | 0.31 s     | 0.26 s      | yes                 |
    | RAM tier, whole entry (the inexact mode)  | 0.01 s     | 0.01 s      | yes                 |
    | disk tier after a restart                 | 0.40 s     | 0.43 s      | yes                 |

``--prefix 8000 18714 --peers --skip agents``: the prompts' text is cut where it tokenizes to exactly 8,000 and
18,714 tokens (``exact_text``); the peer's link taken as 1 GB/s, over loopback. Run 2026-12-07, quiet box:

    | from                          | TTFT 8,000 (54.6 MiB)        | TTFT 18,714 (86.1 MiB)       | same as cold |
    | cold                          | 53.97 s                      | 194.95 s                     | -            |
    | RAM tier, slots empty         | 0.38 s                       | 0.30 s                       | yes          |
    | disk tier after a restart     | 0.50 s                       | 0.41 s                       | yes          |
    | a peer's tier                 | 0.65 s (estimate 0.06 s,     | 0.69 s (estimate 0.09 s,     | yes          |
    |                               |  fetched in 0.12 s)          |  fetched in 0.19 s)          |              |
    | a new replica, warmed         | 0.39 s                       | 0.44 s                       | yes          |

Exact mode evaluates the prompt's tokens past its last multiple of 256 again, on every restore path: 64 and 26
tokens here. A prompt just short of a multiple pays up to 255: at 18,883 tokens (195 past) the same table read
RAM tier 1.13 s, a peer's tier 1.40 s (estimate 0.09 s), a warmed replica 1.23 s (2026-12-05, when ``--peers``
took the uncut text of about ``--prefix`` tokens).

    12 agents, 3 turns, 4 slots (``--skip ttft --agent-prefix 2300``: prefixes of 2,395 tokens): prompt tokens
    evaluated per turn, share of the prefixes restored or reused in turns 2-3
    | no tier        | 28,740 / 29,066 / 29,392 | 0%     |
    | tier, exact    | 28,740 /  1,418 /  1,744 | 96.7%  |  (85.9% before the tail restore point)
    | tier, inexact  | 28,740 /    326 /    326 | 100%   |
    ``--agent-prefix 2500`` (2,587 tokens): no tier 31,044 / 31,370 / 31,696, 0%; exact 31,044 / 650 / 976, 99.4%;
    inexact 31,044 / 326 / 326, 100%.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import llama_cpp  # noqa: E402

from meshgate.backends.llama_cpp import LlamaCppRunner  # noqa: E402
from meshgate.backends.llama_cpp.batch import MIN_REUSE, Job, Scheduler  # noqa: E402
from meshgate.backends.llama_cpp.engine import kv_namespace  # noqa: E402
from meshgate.backends.llama_cpp.rpc import weight_repacking  # noqa: E402
from meshgate.backends.llama_cpp.sampling import Sampler  # noqa: E402
from meshgate.backends.llama_cpp.sources import PackagedGGUFSource  # noqa: E402
from meshgate.backends.runner.client import RunnerClient  # noqa: E402
from meshgate.backends.runner.kvtier import KVTier  # noqa: E402
from meshgate.backends.runner.process import RunnerProcess  # noqa: E402
from meshgate.protocols.model import Request, Sampling, TextDelta, Usage  # noqa: E402
from tests.llama.scheduling import running  # noqa: E402

GREEDY = dict(top_k=40, top_p=1.0, min_p=0.0, repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
WORDS = "the parser reads each token of the file and the linter reports a warning when a rule fails".split()


def scheduler(llm, slots: int, n_ctx: int, threads: int, tier: KVTier | None):
    return running(llm, slots, tier, n_ctx=n_ctx, threads=threads)


def ask(
    s: Scheduler, prompt: list[int], tokens: int, tier: KVTier | None, ends: bool = False
) -> tuple[list[int], float, Job]:
    """Greedy ``tokens`` after ``prompt``; seconds to the first token (the tier lookup included)."""
    started = time.perf_counter()
    job = Job(
        prompt=prompt, limit=tokens, sampler=Sampler(s.n_vocab, temp=0.0, seed=0, **GREEDY), cancel=threading.Event()
    )
    if tier is not None:
        job.scope = ""
        job.restore = tier.find("", prompt, usable=MIN_REUSE, ends=ends, whole=ends)  # as the engine looks up
    s.submit(job)
    out, first = [], 0.0
    while (item := job.out.get(timeout=1800)) is not None:
        if not out:
            first = time.perf_counter() - started
        out.append(item[0])
    return out, first, job


def text(llm, name: str, n: int, cut: bool = False) -> tuple[str, list[int]]:
    """A plain prompt of about ``n`` tokens (``cut``: its first ``n`` tokens exactly, its text then no longer
    theirs) and its tokens, as a runner tokenizes a plain prompt."""
    words = [f"{name}:"]
    while True:
        words += [f"{WORDS[(len(words) * 7 + len(name)) % len(WORDS)]}{len(words) % 97}" for _ in range(64)]
        prompt = " ".join(words)
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        if len(tokens) >= n:
            return prompt, tokens[:n] if cut else tokens


def exact_text(llm, name: str, n: int) -> tuple[str, list[int]]:
    """A plain prompt whose text is exactly ``n`` tokens (for runner processes, which take text): ``text`` cut at
    the shortest length that tokenizes to ``n`` (found by bisection), else the nearest length above."""
    prompt, _ = text(llm, name, n)

    def count(k: int) -> int:
        return len(llm.tokenize(prompt[:k].encode(), add_bos=True, special=False))

    lo, hi = 0, len(prompt)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) < n else (lo, mid)
    k = next((k for k in range(lo, min(lo + 16, len(prompt)) + 1) if count(k) == n), lo)
    return prompt[:k], llm.tokenize(prompt[:k].encode(), add_bos=True, special=False)


def ttft_table(llm, args, directory: Path, prefix: int) -> None:
    raw, prompt = exact_text(llm, "System", prefix) if args.peers else text(llm, "System", prefix, cut=True)
    tier = KVTier(args.namespace, ram_budget=4 << 30, directory=directory, disk_budget=8 << 30)
    with scheduler(llm, 2, args.n_ctx, args.threads, tier) as s:
        cold, t_cold, _ = ask(s, prompt, args.tokens, tier)  # evaluated, kept
        warm, t_warm, job = ask(s, prompt, args.tokens, None)  # no tier lookup: its slot's prefix
        rows = [("cold", t_cold, True, 0), ("warm in its slot", t_warm, warm == cold, job.cached)]
    tier.flush()
    with scheduler(llm, 2, args.n_ctx, args.threads, tier) as s:
        again, t_ram, job = ask(s, prompt, args.tokens, tier)
    rows.append(("RAM tier (slots empty)", t_ram, again == cold, job.cached))
    with scheduler(llm, 2, args.n_ctx, args.threads, tier) as s:  # the inexact mode: the entry's end, no prefill
        again, t_end, job = ask(s, prompt, args.tokens, tier, ends=True)
    rows.append(("RAM tier, whole (inexact)", t_end, again == cold, job.cached))
    tier.close()
    restarted = KVTier(args.namespace, ram_budget=4 << 30, directory=directory, disk_budget=8 << 30)
    with scheduler(llm, 2, args.n_ctx, args.threads, restarted) as s:
        again, t_disk, job = ask(s, prompt, args.tokens, restarted)
    rows.append(("disk tier after a restart", t_disk, again == cold, job.cached))
    size = sum(f.stat().st_size for f in directory.glob("*.kv"))
    print(f"\n{len(prompt)}-token prompt, {args.tokens} greedy tokens, {args.threads} threads")
    print(f"(entry: {size / 2**20:.1f} MiB)")
    print(f"{'from':28} {'TTFT s':>9} {'restored':>9}  same tokens as cold")
    for name, seconds, same, cached in rows:
        print(f"{name:28} {seconds:9.2f} {cached:9d}  {same}")
    if args.peers:
        for name, seconds, same, cached, note in asyncio.run(from_peers(args, directory, raw, cold)):
            print(f"{name:28} {seconds:9.2f} {cached:9d}  {same}  {note}")


async def from_peers(args, directory: Path, prompt: str, cold: list[int]) -> list[tuple]:
    """Runner processes: ``a`` over the table's disk tier, ``b`` fetching from it on demand, ``c`` warmed from it."""
    rows, processes = [], []
    scratch = tempfile.TemporaryDirectory(prefix="kv-peers-")
    try:
        async with httpx.AsyncClient(timeout=1800) as http:
            runners = []
            for name, kv in (("a", directory), ("b", None), ("c", None)):
                kv = kv or Path(scratch.name) / name
                argv = [sys.executable, "-m", "meshgate.backends.llama_cpp.runner", "--model", args.gguf]
                argv += ["--n-ctx", str(args.n_ctx), "--parallel", "2", "--threads", str(args.threads)]
                argv += ["--kv-ram", str(4 << 30), "--kv-dir", str(kv), "--kv-disk", str(8 << 30)]
                processes.append(await RunnerProcess.start(argv, name=name, ready_timeout=300))
                runners.append(LlamaCppRunner(RunnerClient(f"http://127.0.0.1:{processes[-1].port}", http)))
            a, b, c = runners
            peer = {"url": a.client.base_url, "bandwidth": args.bandwidth, "latency": 0.0005}
            await b.kv("peers", {"peers": [peer]})
            tokens, seconds, usage = await ask_runner(b, prompt, args.tokens)
            size = sum(f.stat().st_size for f in directory.glob("*.kv"))
            estimate = size / args.bandwidth
            rows.append(("from a peer (loopback)", seconds, tokens == cold, usage.cached_tokens, usage.cache_note))
            rows.append(("  transfer estimate", estimate, True, 0, f"at {args.bandwidth / 1e6:.0f} MB/s"))
            await c.kv("warm", {"url": a.client.base_url, "count": 16})
            while (await c.health())["kv_tier"]["warmed"] < 1:
                await asyncio.sleep(0.1)
            tokens, seconds, usage = await ask_runner(c, prompt, args.tokens)
            rows.append(("a new replica, warmed", seconds, tokens == cold, usage.cached_tokens, ""))
    finally:
        for process in processes:
            await process.stop()
        scratch.cleanup()
    return rows


async def ask_runner(runner: LlamaCppRunner, prompt: str, tokens: int) -> tuple[list[int], float, Usage]:
    """Greedy ``tokens`` after the plain ``prompt`` from a runner process; seconds to the first token."""
    request = Request(model="m", raw_prompt=prompt, max_tokens=tokens, sampling=Sampling(temperature=0.0))
    started, first, out, usage = time.perf_counter(), 0.0, [], Usage()
    async for event in runner.generate(request):
        if isinstance(event, TextDelta):
            first = first or time.perf_counter() - started
            out += list(event.tokens)
        elif isinstance(event, Usage):
            usage = event
    return out, first, usage


def agents(llm, args, tier: KVTier | None, exact: bool) -> tuple[list[int], float]:
    """Prompt tokens evaluated per round, and the share of turn 2+ agents' prefixes restored or reused."""
    prefixes = [text(llm, f"Agent {i}", args.agent_prefix)[1] for i in range(args.agents)]
    history = [list(p) for p in prefixes]
    spent, shared, saved = [], 0, 0
    with scheduler(llm, args.slots, args.n_ctx, args.threads, tier) as s:
        for turn in range(args.turns):
            evaluated = 0
            for i in range(args.agents):
                question = llm.tokenize(
                    f" Question {turn} for agent {i}: what next?".encode(), add_bos=False, special=True
                )
                prompt = history[i] + question
                answer, _, job = ask(s, prompt, args.tokens, tier, ends=not exact)
                evaluated += len(prompt) - job.cached
                if turn:
                    shared += len(prefixes[i])
                    saved += min(job.cached, len(prefixes[i]))
                history[i] = prompt + answer
            spent.append(evaluated)
    return spent, saved / shared if shared else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, nargs="+", default=[8000])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--agents", type=int, default=12)
    parser.add_argument("--agent-prefix", type=int, default=2500)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--n-ctx", type=int, default=20480)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", choices=["ttft", "agents"], default=None)
    parser.add_argument(
        "--peers",
        action="store_true",
        help="also from a peer runner process and a warmed one (else prompts of exactly --prefix tokens)",
    )
    parser.add_argument("--bandwidth", type=float, default=1e9, help="bytes/s the peer link is taken to have")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (gguf,) = PackagedGGUFSource(Path(tmp) / "models").models()
        args.gguf = gguf.path
        args.namespace = kv_namespace(gguf.path, "", (), llama_cpp.__version__)  # what its runner processes use
        with weight_repacking(False):
            llm = llama_cpp.Llama(model_path=gguf.path, n_ctx=64, n_batch=64, n_threads=args.threads, verbose=False)
        if args.skip != "ttft":
            for n, prefix in enumerate(args.prefix):
                ttft_table(llm, args, Path(tmp) / f"kv{n}", prefix)
        if args.skip != "agents":
            n_ctx = args.n_ctx
            args.n_ctx = min(n_ctx, args.agent_prefix + args.turns * (args.tokens + 64) + 64)
            rows = [("no tier", *agents(llm, args, None, exact=True))]
            for name, exact in (("tier, exact", True), ("tier, inexact", False)):
                with tempfile.TemporaryDirectory() as kv:
                    tier = KVTier(args.namespace, ram_budget=4 << 30, directory=kv, disk_budget=8 << 30)
                    rows.append((name, *agents(llm, args, tier, exact=exact)))
            print(f"\n{args.agents} agents, {args.agent_prefix}-token prefixes, {args.turns} turns, {args.slots} slots")
            turns = " ".join(f"{f'turn {t + 1}':>9}" for t in range(args.turns))
            print(f"{'prompt tokens evaluated':24} {turns}  prefix restored or reused (turns 2+)")
            for name, spent, share in rows:
                print(f"{name:24} " + " ".join(f"{n:9d}" for n in spent) + f"  {share:.1%}")


if __name__ == "__main__":
    main()
