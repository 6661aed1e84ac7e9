"""vLLM on the real Gemma 3 270M: TP=1 vs TP=2 vs PP=2 on one node, side by side.

    .venv/bin/python benchmarks/vllm.py [--tokens 64] [--streams 8] [--eager] [--python PATH] [--model DIR]

Starts vLLM's OpenAI server through ``VllmBackend.launch`` exactly as a node agent does (one placement record per
mode: a ``single`` shard, two tensor ranks, two pipeline stages of 9 layers), then measures through ``VllmRunner``
(the gateway's client): startup seconds until ``/health`` answers, single-stream decode tok/s (one request,
``--tokens`` tokens, greedy), and aggregate tok/s of ``--streams`` concurrent requests; checks that every mode gave
the same greedy text. Prints one table. ``--eager`` skips torch.compile (the tests' fast start; slower decode);
without it vLLM compiles, which costs startup. ``--model`` defaults to the checkpoint the tests convert
(``.cache/test-data/converted/gemma3-270m-bf16``); ``--python`` to the vLLM venv the tests make.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshgate.backends.checkpoints import card_from_checkpoint, spec_from_checkpoint  # noqa: E402
from meshgate.backends.placement import Candidate, NodeId, Shard  # noqa: E402
from meshgate.backends.vllm import VllmBackend  # noqa: E402
from meshgate.protocols.model import Finished, Request, Sampling, TextDelta, Usage  # noqa: E402

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when movable type changed how books were made. "
)
MODES = {"TP=1": "single", "TP=2": "tensor", "PP=2": "pipeline"}


def placement(strategy: str, n_layers: int, name: str) -> Candidate:
    a = NodeId("a")
    half = n_layers // 2
    shards = {
        "single": (Shard(node_id=a, layer_start=0, layer_end=n_layers),),
        "tensor": tuple(
            Shard(node_id=a, layer_start=0, layer_end=n_layers, tensor_rank=r, tensor_size=2) for r in (0, 1)
        ),
        "pipeline": (
            Shard(node_id=a, layer_start=0, layer_end=half),
            Shard(node_id=a, layer_start=half, layer_end=n_layers),
        ),
    }[strategy]
    return Candidate(
        id=f"bench-{strategy}",
        model=name,
        backend="vllm",
        strategy=strategy,  # type: ignore[arg-type]
        context=1024,
        shards=shards,
        memory_per_node={},
    )


async def one(runner, name: str, tokens: int) -> tuple[str, int, float]:
    request = Request(model=name, raw_prompt=PROMPT, sampling=Sampling(temperature=0.0), max_tokens=tokens)
    text, generated, started, first = [], 0, time.monotonic(), None
    async for event in runner.generate(request):
        if isinstance(event, TextDelta):
            first = first or time.monotonic()
            text.append(event.text)
        elif isinstance(event, Usage):
            generated = event.completion_tokens
        elif not isinstance(event, Finished):
            raise RuntimeError(f"generation failed: {event}")
    return "".join(text), generated, time.monotonic() - started


async def measure(args: argparse.Namespace, mode: str, runtime: Path) -> dict:
    card = card_from_checkpoint(args.model)
    plan = placement(MODES[mode], spec_from_checkpoint(card.name, card.path).n_layers, card.name)
    async with httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_connections=64)) as http:
        backend = VllmBackend(
            http, python=args.python, runtime_dir=str(runtime), eager=args.eager, n_ctx=1024, ready_timeout=900
        )
        started = time.monotonic()
        launched = await backend.launch(card, plan, plan.shards[0], host="127.0.0.1", peers=None)  # type: ignore
        startup = time.monotonic() - started
        try:
            runner = backend.connect(card, plan, {"a": launched.url})
            await one(runner, card.name, 4)  # warm-up
            text, n, seconds = await one(runner, card.name, args.tokens)
            began = time.monotonic()
            many = await asyncio.gather(*(one(runner, card.name, args.tokens) for _ in range(args.streams)))
            wall = time.monotonic() - began
            return {
                "startup": startup,
                "single": n / seconds,
                "many": sum(m[1] for m in many) / wall,
                "text": text,
                "same": all(m[0] == text for m in many),
            }
        finally:
            await launched.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--python", default=str(ROOT / ".cache" / "venvs" / "vllm" / "bin" / "python"))
    parser.add_argument("--model", default=str(ROOT / ".cache" / "test-data" / "converted" / "gemma3-270m-bf16"))
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    runtime = Path(tempfile.mkdtemp(prefix="mg-vbench-"))  # short: vLLM's socket paths must fit 107 bytes
    results = {}
    try:
        for mode in args.modes.split(","):
            results[mode] = asyncio.run(measure(args, mode, runtime))
            r = results[mode]
            print(
                f"{mode}: ready in {r['startup']:.1f}s, 1 stream {r['single']:.1f} tok/s, {args.streams} streams "
                f"{r['many']:.1f} tok/s",
                flush=True,
            )
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
    print(f"\nGemma 3 270M bf16, vLLM {'eager' if args.eager else 'compiled'}, {args.tokens} tokens per request")
    print(f"{'mode':6} {'startup s':>10} {'1-stream tok/s':>15} {f'{args.streams}-stream tok/s':>15}  same text")
    reference = next(iter(results.values()))["text"]
    for mode, r in results.items():
        print(
            f"{mode:6} {r['startup']:10.1f} {r['single']:15.1f} {r['many']:15.1f}  "
            f"{r['same'] and r['text'] == reference}"
        )


if __name__ == "__main__":
    main()
