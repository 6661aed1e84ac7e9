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

    .venv/bin/python benchmarks/kv_cache.py [--prefix 8000] [--agents 12] [--agent-prefix 2500] [--turns 3]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import llama_cpp  # noqa: E402

from meshgate.backends.llama_cpp.batch import MIN_REUSE, Job, Scheduler  # noqa: E402
from meshgate.backends.llama_cpp.rpc import weight_repacking  # noqa: E402
from meshgate.backends.llama_cpp.sampling import Sampler  # noqa: E402
from meshgate.backends.llama_cpp.sources import PackagedGGUFSource  # noqa: E402
from meshgate.backends.runner.kvtier import KVTier  # noqa: E402

GREEDY = dict(top_k=40, top_p=1.0, min_p=0.0, repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
WORDS = "the parser reads each token of the file and the linter reports a warning when a rule fails".split()


@contextmanager
def scheduler(llm, slots: int, n_ctx: int, threads: int, tier: KVTier | None):
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    s = Scheduler(
        llm._model.model,
        n_ctx=n_ctx,
        parallel=slots,
        n_threads=threads,
        is_eog=lambda t: bool(llama_cpp.llama_vocab_is_eog(vocab, t)),
        tier=tier,
    )
    thread = threading.Thread(target=s.run, daemon=True)
    thread.start()
    try:
        yield s
    finally:
        s.close()
        thread.join(60)
        s.free()


def ask(s: Scheduler, prompt: list[int], tokens: int, tier: KVTier | None) -> tuple[list[int], float, Job]:
    """Greedy ``tokens`` after ``prompt``; seconds to the first token (the tier lookup included)."""
    started = time.perf_counter()
    job = Job(
        prompt=prompt, limit=tokens, sampler=Sampler(s.n_vocab, temp=0.0, seed=0, **GREEDY), cancel=threading.Event()
    )
    if tier is not None:
        job.scope = ""
        job.restore = tier.find("", prompt, usable=MIN_REUSE)
    s.submit(job)
    out, first = [], 0.0
    while (item := job.out.get(timeout=1800)) is not None:
        if not out:
            first = time.perf_counter() - started
        out.append(item[0])
    return out, first, job


def text(llm, name: str, n: int) -> list[int]:
    words = [f"{name}:"] + [f"{WORDS[(i * 7 + len(name)) % len(WORDS)]}{i % 97}" for i in range(n)]
    tokens = llm.tokenize(" ".join(words).encode(), add_bos=True, special=True)
    assert len(tokens) >= n, (len(tokens), n)
    return tokens[:n]


def ttft_table(llm, args, directory: Path) -> None:
    prompt = text(llm, "System", args.prefix)
    rows = []
    with scheduler(llm, 2, args.n_ctx, args.threads, None) as s:
        cold, t_cold, _ = ask(s, prompt, args.tokens, None)
        warm, t_warm, _ = ask(s, prompt, args.tokens, None)
    rows += [("cold", t_cold, cold == cold, 0), ("warm in its slot", t_warm, warm == cold, len(prompt) - 1)]
    tier = KVTier("bench", ram_budget=4 << 30, directory=directory, disk_budget=8 << 30)
    with scheduler(llm, 2, args.n_ctx, args.threads, tier) as s:
        ask(s, prompt, args.tokens, tier)  # evaluated cold again, kept
    tier.flush()
    with scheduler(llm, 2, args.n_ctx, args.threads, tier) as s:
        again, t_ram, job = ask(s, prompt, args.tokens, tier)
    rows.append(("RAM tier (slots empty)", t_ram, again == cold, job.cached))
    tier.close()
    restarted = KVTier("bench", ram_budget=4 << 30, directory=directory, disk_budget=8 << 30)
    with scheduler(llm, 2, args.n_ctx, args.threads, restarted) as s:
        again, t_disk, job = ask(s, prompt, args.tokens, restarted)
    rows.append(("disk tier after a restart", t_disk, again == cold, job.cached))
    size = sum(f.stat().st_size for f in directory.glob("*.kv"))
    print(
        f"\n{len(prompt)}-token prompt, {args.tokens} greedy tokens, {args.threads} threads "
        f"(entry on disk: {size / 2**20:.1f} MiB)"
    )
    print(f"{'from':28} {'TTFT s':>9} {'restored':>9}  same tokens as cold")
    for name, seconds, same, cached in rows:
        print(f"{name:28} {seconds:9.2f} {cached:9d}  {same}")
    print(f"{'from a peer':28} {'n/a':>9}  (not built yet)")


def agents(llm, args, tier: KVTier | None) -> tuple[list[int], float]:
    """Prompt tokens evaluated per round, and the share of turn 2+ agents' prefixes restored or reused."""
    prefixes = [text(llm, f"Agent {i}", args.agent_prefix) for i in range(args.agents)]
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
                answer, _, job = ask(s, prompt, args.tokens, tier)
                evaluated += len(prompt) - job.cached
                if turn:
                    shared += len(prefixes[i])
                    saved += min(job.cached, len(prefixes[i]))
                history[i] = prompt + answer
            spent.append(evaluated)
    return spent, saved / shared if shared else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=8000)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--agents", type=int, default=12)
    parser.add_argument("--agent-prefix", type=int, default=2500)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--n-ctx", type=int, default=20480)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip", choices=["ttft", "agents"], default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (gguf,) = PackagedGGUFSource(Path(tmp) / "models").models()
        with weight_repacking(False):
            llm = llama_cpp.Llama(model_path=gguf.path, n_ctx=64, n_batch=64, n_threads=args.threads, verbose=False)
        if args.skip != "ttft":
            ttft_table(llm, args, Path(tmp) / "kv")
        if args.skip != "agents":
            n_ctx = args.n_ctx
            args.n_ctx = min(n_ctx, args.agent_prefix + args.turns * (args.tokens + 64) + 64)
            without, share_without = agents(llm, args, None)
            with tempfile.TemporaryDirectory() as kv:
                tier = KVTier("bench", ram_budget=4 << 30, directory=kv, disk_budget=8 << 30)
                with_tier, share_with = agents(llm, args, tier)
                stats = tier.stats()
            print(f"\n{args.agents} agents, {args.agent_prefix}-token prefixes, {args.turns} turns, {args.slots} slots")
            print(
                f"{'':12} "
                + " ".join(f"{f'turn {t + 1}':>9}" for t in range(args.turns))
                + "  prefix restored/reused (turns 2+)"
            )
            print(f"{'no tier':12} " + " ".join(f"{n:9d}" for n in without) + f"  {share_without:.1%}")
            print(f"{'with tier':12} " + " ".join(f"{n:9d}" for n in with_tier) + f"  {share_with:.1%}")
            print(
                f"tier: {stats['ram_bytes'] / 2**20:.0f} MiB RAM of {stats['ram_budget'] / 2**30:.0f} GiB, "
                f"{stats['disk_bytes'] / 2**20:.0f} MiB disk, hits {stats['hits_ram']} RAM / {stats['hits_disk']} disk"
            )


if __name__ == "__main__":
    main()
