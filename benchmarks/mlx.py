"""MLX on the real Gemma 3 270M: one process vs a 2-rank pipeline vs 2-rank tensor parallel, on loopback; or, with
``--streams N``, one rank decoding N requests at once (batched) against the same requests one at a time.

    .venv/bin/python benchmarks/mlx.py [--tokens 64] [--runs 3] [--python PATH] [--model DIR]
    .venv/bin/python benchmarks/mlx.py --streams 4 [--tokens 64] [--python PATH] [--model DIR]

Launches ranks through ``MlxBackend.launch`` exactly as node agents do (followers first, the head joins them over
the ring), then prints, per configuration, prompt and decode tokens/s (from the head's own timings, median of
``--runs``), the ratio to one process, the resident memory of every rank after the runs, and checks that every
configuration produced the same greedy text. ``--model`` defaults to the checkpoint the tests convert
(``.cache/test-data/converted/gemma3-270m-bf16``; made with ``meshgate convert`` when missing); ``--python``
to the MLX venv the tests make (``.cache/venvs/mlx``).

``--streams N``: one rank with ``--parallel N``; after a warm-up, N different prompts one after another, then
the same N at once; prints the aggregate tokens/s of each (completion tokens over wall time, prefill included),
the ratio, the engine's widest batch, and whether every prompt got the same greedy text both ways. On Linux the
``mlx-cpu`` wheel links netlib's reference BLAS (``mlx_cpu.libs/libblas-*.so.3.10.0``, ~5.5 GFLOP/s at any
batch size), so there a batch's matmuls cost about what its rows cost one at a time and the gain is small; an
optimized BLAS preloaded into the ranks (``LD_PRELOAD`` of OpenBLAS's ``libblas.so.3``; the rank processes
inherit the environment) makes batched steps nearly as cheap as single ones.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshgate.backends.base import ModelCard  # noqa: E402
from meshgate.backends.mlx import MlxBackend  # noqa: E402
from meshgate.backends.placement import Candidate, NodeId, Shard  # noqa: E402
from meshgate.protocols.model import Request, Sampling, TextDelta, Usage  # noqa: E402

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how books were made. "
) * 6
STREAM_PROMPTS = [PROMPT] + [
    sentence * 6
    for sentence in (
        "Rivers shape the land they cross, carving valleys and carrying soil down to the sea over many centuries. ",
        "A good recipe for bread needs only flour, water, salt and yeast, and a great deal of patience. ",
        "The first computers filled whole rooms and were programmed by plugging cables into large boards. ",
        "Migrating birds find their way across continents using the sun, the stars and the magnetic field. ",
        "Chess openings have names that recall the players and the places where they were first studied. ",
        "Glaciers store most of the fresh water on the planet and move slowly under their own weight. ",
        "Old lighthouses were kept by families who lived beside the lamp and tended it through every night. ",
    )
]


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


def placement(strategy: str, n_layers: int) -> Candidate:
    a, b = NodeId("a"), NodeId("b")
    half = n_layers // 2
    shards = {
        "single": (Shard(node_id=a, layer_start=0, layer_end=n_layers),),
        "pipeline": (
            Shard(node_id=a, layer_start=0, layer_end=half),
            Shard(node_id=b, layer_start=half, layer_end=n_layers),
        ),
        "tensor": (
            Shard(node_id=a, layer_start=0, layer_end=n_layers, tensor_rank=0, tensor_size=2),
            Shard(node_id=b, layer_start=0, layer_end=n_layers, tensor_rank=1, tensor_size=2),
        ),
    }[strategy]
    return Candidate(
        id=strategy,
        model="gemma",
        backend="mlx",
        strategy=strategy,  # type: ignore[arg-type]
        context=1024,
        shards=shards,
        memory_per_node={},
    )


async def launch(backend: MlxBackend, card: ModelCard, plan: Candidate) -> dict[str, object]:
    """Every rank of ``plan``, followers first, as their agents would have them up."""
    launched: dict[str, object] = {}
    for shard in sorted(plan.shards, key=lambda s: (s.layer_start, s.tensor_rank), reverse=True):

        async def peers() -> dict[str, str]:
            return {n: r.url for n, r in launched.items()}  # type: ignore[attr-defined]

        launched[shard.node_id] = await backend.launch(card, plan, shard, host="127.0.0.1", peers=peers)
    return launched


async def measure(backend: MlxBackend, card: ModelCard, strategy: str, tokens: int, runs: int) -> dict:
    plan = placement(strategy, backend.spec(card).n_layers)
    order = sorted(plan.shards, key=lambda s: (s.layer_start, s.tensor_rank))
    launched = await launch(backend, card, plan)
    try:
        runner = backend.connect(card, plan, {n: r.url for n, r in launched.items()})  # type: ignore[attr-defined]
        prompt_rates, decode_rates, text = [], [], ""
        for _ in range(runs + 1):  # the first run warms up (MLX compiles its kernels on first use)
            request = Request(model="gemma", raw_prompt=PROMPT, max_tokens=tokens, sampling=Sampling(temperature=0.0))
            events = [e async for e in runner.generate(request)]
            usage = [e for e in events if isinstance(e, Usage)][-1]
            prompt_rates.append(usage.prompt_tokens / (usage.prompt_ns / 1e9))
            decode_rates.append(usage.completion_tokens / (usage.eval_ns / 1e9))
            text = "".join(e.text for e in events if isinstance(e, TextDelta))
        memory = {
            f"rank {order.index(next(s for s in order if s.node_id == n))}": rss_mib(r.pid)  # type: ignore[attr-defined]
            for n, r in launched.items()
        }
        return {
            "prompt": statistics.median(prompt_rates[1:]),
            "decode": statistics.median(decode_rates[1:]),
            "memory": dict(sorted(memory.items())),
            "text": text,
            "prompt_tokens": usage.prompt_tokens,
        }
    finally:
        await asyncio.gather(*(r.stop() for r in launched.values()))  # type: ignore[attr-defined]


async def streams(backend: MlxBackend, card: ModelCard, n: int, tokens: int) -> dict:
    """``n`` prompts one at a time, then all at once, on one rank decoding up to ``n`` together."""
    plan = placement("single", backend.spec(card).n_layers)
    launched = await launch(backend, card, plan)
    try:
        runner = backend.connect(card, plan, {n: r.url for n, r in launched.items()})  # type: ignore[attr-defined]

        async def one(prompt: str, max_tokens: int = tokens) -> tuple[str, int]:
            request = Request(
                model="gemma", raw_prompt=prompt, max_tokens=max_tokens, sampling=Sampling(temperature=0.0)
            )
            events = [e async for e in runner.generate(request)]
            return "".join(e.text for e in events if isinstance(e, TextDelta)), [
                e for e in events if isinstance(e, Usage)
            ][-1].completion_tokens

        prompts = [STREAM_PROMPTS[i % len(STREAM_PROMPTS)] for i in range(n)]
        await asyncio.gather(*(one(p, 4) for p in prompts))  # warm-up: MLX compiles its kernels on first use
        started = time.perf_counter()
        alone = [await one(p) for p in prompts]
        alone_s = time.perf_counter() - started
        started = time.perf_counter()
        together = await asyncio.gather(*(one(p) for p in prompts))
        together_s = time.perf_counter() - started
        head = next(iter(launched.values()))
        health = (await backend.http.get(f"{head.url}/health")).json()  # type: ignore[attr-defined]
        return {
            "alone": sum(c for _, c in alone) / alone_s,
            "together": sum(c for _, c in together) / together_s,
            "same": [t for t, _ in alone] == [t for t, _ in together],
            "widest": health["batch"]["widest"],
            "tokens": [c for _, c in together],
        }
    finally:
        await asyncio.gather(*(r.stop() for r in launched.values()))  # type: ignore[attr-defined]


def default_model() -> Path:
    target = ROOT / ".cache" / "test-data" / "converted" / "gemma3-270m-bf16"
    if not (target / "config.json").exists():
        from meshgate.backends.llama_cpp.convert import convert
        from meshgate.backends.llama_cpp.sources import PackagedGGUFSource

        gguf = PackagedGGUFSource(ROOT / ".cache" / "test-data" / "models").models()[0].path
        convert(gguf, target, dtype="bfloat16", name="gemma3:270m-bf16")
    return target


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--python", default=str(ROOT / ".cache" / "venvs" / "mlx" / "bin" / "python"))
    parser.add_argument("--model", default=None)
    parser.add_argument("--streams", type=int, default=0, help="one rank: N requests at once vs one at a time")
    args = parser.parse_args()
    model = Path(args.model) if args.model else default_model()
    card = ModelCard(name="gemma", path=str(model), format="safetensors")
    if args.streams:
        async with httpx.AsyncClient(timeout=600) as http:
            backend = MlxBackend(
                http, python=args.python, runtime_dir=str(ROOT / ".cache" / "bench-mlx"), parallel=args.streams
            )
            r = await streams(backend, card, args.streams, args.tokens)
        print(
            f"MLX {model.name} (float32 compute on CPU), one rank, {args.streams} different prompts of ~130 tokens, "
            f"{args.tokens} greedy tokens each; aggregate tokens/s over wall time, prefill included"
        )
        print(f"{'1 at a time':16} {r['alone']:8.2f} tok/s")
        print(
            f"{f'{args.streams} at once':16} {r['together']:8.2f} tok/s  {r['together'] / r['alone']:.2f}x  "
            f"(widest batch {r['widest']}, completion tokens {r['tokens']})"
        )
        print(f"same greedy text alone and together: {r['same']}")
        return
    results = {}
    async with httpx.AsyncClient(timeout=600) as http:
        backend = MlxBackend(http, python=args.python, runtime_dir=str(ROOT / ".cache" / "bench-mlx"))
        for strategy in ("single", "pipeline", "tensor"):
            results[strategy] = await measure(backend, card, strategy, args.tokens, args.runs)
    base = results["single"]
    print(
        f"MLX {model.name} (float32 compute on CPU), prompt {base['prompt_tokens']} tokens, decode {args.tokens} "
        f"tokens, median of {args.runs} runs after a warm-up"
    )
    print(f"{'':10} {'prompt tok/s':>13} {'ratio':>6} {'decode tok/s':>13} {'ratio':>6}  resident memory per rank")
    for strategy, r in results.items():
        memory = ", ".join(f"{k} {v:.0f} MiB" for k, v in r["memory"].items())
        print(
            f"{strategy:10} {r['prompt']:13.1f} {r['prompt'] / base['prompt']:6.2f} {r['decode']:13.2f} "
            f"{r['decode'] / base['decode']:6.2f}  {memory}"
        )
    same = all(r["text"] == base["text"] for r in results.values())
    print(f"same greedy text in every configuration: {same}")


if __name__ == "__main__":
    asyncio.run(main())
