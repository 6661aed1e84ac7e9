"""Does greedy output depend on load? Each prompt alone, then the same prompts N at a time, in one runner engine.

Prints how many prompts gave different text under load, and for each the first token where they part with the
two candidates' log probabilities (a near-tie when the gap is small). Runs the llama.cpp engine in-process on the
packaged Gemma 3 270M GGUF (as the runner does); bounded: ``--prompts`` x ``--tokens``.

    .venv/bin/python benchmarks/determinism.py --prompts 32 --tokens 64 --parallel 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshgate.backends.llama_cpp.engine import LlamaEngine  # noqa: E402
from meshgate.backends.llama_cpp.sources import PackagedGGUFSource  # noqa: E402
from meshgate.protocols.model import Message, Request, Sampling, TextDelta, TextPart  # noqa: E402

SUBJECTS = [
    "the sea",
    "a mountain",
    "bread",
    "the moon",
    "a violin",
    "winter",
    "a red bicycle",
    "the library",
    "coffee",
    "a lighthouse",
    "rain",
    "an old clock",
    "the desert",
    "a garden",
    "trains",
    "the city at night",
]
ASKS = ["Write about {}.", "Describe {} in two sentences.", "What do you think of {}?", "Tell a story about {}."]


def prompts(n: int) -> list[str]:
    return [ASKS[(i // len(SUBJECTS)) % len(ASKS)].format(SUBJECTS[i % len(SUBJECTS)]) for i in range(n)]


def run(engine: LlamaEngine, text: str, tokens: int) -> list[tuple[str, float, tuple[tuple[str, float], ...]]]:
    request = Request(
        model="m",
        messages=(Message(role="user", parts=(TextPart(text=text),)),),
        max_tokens=tokens,
        sampling=Sampling(temperature=0.0),
        logprobs=True,
        top_logprobs=2,
    )
    out = []
    for event in engine.generate(request, threading.Event()):
        if isinstance(event, TextDelta):
            out += [(lp.token, lp.logprob, tuple((t.token, t.logprob) for t in lp.top)) for lp in event.logprobs]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--inexact", action="store_true", help="every sequence in one decode (no DECODE_GROUP)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = PackagedGGUFSource(Path(tmp)).models()[0].path
        engine = LlamaEngine(path, n_ctx=1024, parallel=args.parallel, exact=not args.inexact)
        texts = prompts(args.prompts)
        alone = [run(engine, t, args.tokens) for t in texts]
        with ThreadPoolExecutor(args.parallel) as pool:
            loaded = list(pool.map(lambda t: run(engine, t, args.tokens), texts))
    differ = 0
    for text, a, b in zip(texts, alone, loaded, strict=True):
        if [x[0] for x in a] == [x[0] for x in b]:
            continue
        differ += 1
        i = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x[0] != y[0])
        print(f"differs: {text!r} at token {i}: alone {a[i][2]}, loaded {b[i][2]}")
    print(
        f"{differ} of {len(texts)} prompts differ under load ({100 * differ / len(texts):.1f}%), "
        f"{args.tokens} greedy tokens each, {args.parallel} at a time; widest batch {engine.scheduler.widest}"
    )


if __name__ == "__main__":
    main()
