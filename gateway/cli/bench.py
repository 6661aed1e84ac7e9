"""``meshgate bench``: prompt and generation speed of a running gateway, the way llama-bench and exo bench report it.

    meshgate bench --model gemma3:270m [--prompt-tokens 128,512] [--gen-tokens 64,128] [--concurrency 1,4,8]
                   [--repetitions 3] [--url http://127.0.0.1:11434] [--api-key K] [--json] [--plot FILE]

It is a client: it speaks HTTP to any gateway (its own or another machine's) and imports nothing of the server.
For every (prompt length, generation length, concurrency) cell and every repetition it sends ``c`` streamed
``/v1/completions`` requests at once (a raw prompt, no chat template, so the prompt is exactly what is counted;
``temperature`` 0, ``max_tokens`` = the generation length, ``stream_options.include_usage``) and measures, from the
client:

- prompt tok/s: each stream's ``usage.prompt_tokens`` over its TTFT (request sent to first token), averaged over
  the streams: prefill speed, queueing included (as a user sees it);
- gen tok/s: the tokens after each stream's first (``usage.completion_tokens`` - 1) over the span from the first
  stream's first token to the last stream's last token: the decode throughput of all ``c`` streams together;
- TTFT p50/p99 over the streams and inter-token latency p50/p99 over every gap between consecutive token chunks.

Each figure is computed per repetition and shown as mean +- stdev over the repetitions. Token counts are the
server's own (``usage``). Prompts are words that are one token each in common tokenizers, sized by calibration
(one-token requests, read back through ``usage.prompt_tokens``, corrected until the count is exact), and each stream
gets its own word order so no prompt cache serves one stream from another's prefix. A model may end a stream before
``max_tokens`` (its end-of-sequence token); the measured counts are reported beside the requested ones.

The placement (``GET /instances``: backend, strategy, nodes and runner memory per node) needs an admin key on a
gateway with auth; without one the results are shown without it. Progress goes to stderr; the report (a table,
or ``--json``'s document) to stdout; ``--plot`` writes a PNG through ``gateway.cli.bench_report``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["Cell", "Run", "Stream", "add_arguments", "main", "percentile", "spread"]

WORDS = (
    "the of and to in is that for it as with was on be at by this had not are but from or have an they which one "
    "you were her all she there would their we him been has when who will more no if out so said what up its about "
    "into than them can only other new some could time these two may then do first any my now such like our over "
    "man me even most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old year off come since "
    "against go came right used take three"
).split()
"""Words that are one token each (with their leading space) in Gemma's, Llama's and Qwen's tokenizers."""


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def spread(values: list[float]) -> dict[str, float]:
    """Mean and sample stdev (0 for one value) of the finite ``values``; nan when there are none."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"mean": float("nan"), "stdev": float("nan")}
    return {"mean": statistics.fmean(finite), "stdev": statistics.stdev(finite) if len(finite) > 1 else 0.0}


def prompt_text(words: int, seed: int) -> str:
    """``words`` words in an order of their own for ``seed`` (so two streams share no prefix)."""
    order = list(WORDS)
    random.Random(seed).shuffle(order)
    return " ".join(itertools.islice(itertools.cycle(order), max(1, words)))


@dataclass
class Stream:
    """One streamed completion as the client saw it (``perf_counter`` seconds)."""

    sent: float
    stamps: list[float]
    prompt_tokens: int
    completion_tokens: int

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.sent


@dataclass
class Run:
    """One repetition of a cell: ``c`` streams at once, and its figures."""

    streams: list[Stream]
    prompt_tps: float = 0.0
    gen_tps: float = 0.0
    ttft_p50: float = 0.0
    ttft_p99: float = 0.0
    itl_p50: float = 0.0
    itl_p99: float = 0.0

    def __post_init__(self) -> None:
        s = self.streams
        self.prompt_tps = statistics.fmean(x.prompt_tokens / x.ttft for x in s)
        span = max(x.stamps[-1] for x in s) - min(x.stamps[0] for x in s)
        decoded = sum(max(0, x.completion_tokens - 1) for x in s)
        self.gen_tps = decoded / span if span > 0 and decoded else float("nan")
        ttfts = [x.ttft for x in s]
        gaps = [b - a for x in s for a, b in itertools.pairwise(x.stamps)]
        self.ttft_p50, self.ttft_p99 = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
        self.itl_p50, self.itl_p99 = percentile(gaps, 0.5), percentile(gaps, 0.99)


METRICS = ("prompt_tps", "gen_tps", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


@dataclass
class Cell:
    """One (prompt length, generation length, concurrency) combination and its repetitions."""

    prompt_tokens: int
    gen_tokens: int
    concurrency: int
    runs: list[Run] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        streams = [x for r in self.runs for x in r.streams]
        return {
            "prompt_tokens": self.prompt_tokens,
            "gen_tokens": self.gen_tokens,
            "concurrency": self.concurrency,
            "repetitions": len(self.runs),
            "measured_prompt_tokens": statistics.fmean(x.prompt_tokens for x in streams),
            "measured_gen_tokens": statistics.fmean(x.completion_tokens for x in streams),
            **{m: spread([getattr(r, m) for r in self.runs]) for m in METRICS},
            "runs": [{m: getattr(r, m) for m in METRICS} for r in self.runs],
        }


class BenchError(Exception):
    """The gateway refused or broke a request; the message says what it answered."""


def _error(status: int, body: bytes) -> BenchError:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:300].decode(errors="replace")
    return BenchError(f"HTTP {status}: {message}")


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> Stream:
    """One streamed ``/v1/completions`` request read to its end, each token chunk stamped on arrival."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stamps: list[float] = []
    usage: dict[str, int] = {}
    sent = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise _error(response.status_code, await response.aread())
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise BenchError(f"the stream failed: {chunk['error'].get('message', chunk['error'])}")
            if chunk.get("choices") and chunk["choices"][0].get("finish_reason") is None:
                stamps.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    if not stamps or not usage:
        raise BenchError("the stream ended without tokens or usage (does the gateway honour include_usage?)")
    return Stream(sent, stamps, usage["prompt_tokens"], usage["completion_tokens"])


async def prompt_tokens(client: httpx.AsyncClient, model: str, prompt: str) -> int:
    """The server's count of ``prompt``'s tokens (a one-token completion's ``usage.prompt_tokens``)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = await client.post("/v1/completions", json=body)
    if response.status_code != 200:
        raise _error(response.status_code, response.content)
    return int(response.json()["usage"]["prompt_tokens"])


async def calibrate(client: httpx.AsyncClient, model: str, target: int, tries: int = 4) -> int:
    """How many words make a ``target``-token prompt (exact when the words are one token each)."""
    words = max(1, target - 1)
    for _ in range(tries):
        counted = await prompt_tokens(client, model, prompt_text(words, seed=0))
        if counted == target or (counted > target and words == 1):
            break
        words = max(1, words + target - counted)
    return words


async def run_cell(client: httpx.AsyncClient, model: str, cell: Cell, words: int, seeds: Iterator[int]) -> Run:
    """``cell.concurrency`` streams at once, each with a word order of its own (the next of ``seeds``: no prompt of
    the whole bench, or of an earlier one on the same gateway, is reused from a slot's cache)."""
    mine = [next(seeds) for _ in range(cell.concurrency)]
    streams = await asyncio.gather(
        *(stream_completion(client, model, prompt_text(words, seed), cell.gen_tokens) for seed in mine)
    )
    return Run(list(streams))


async def placement(client: httpx.AsyncClient, model: str) -> dict[str, Any] | None:
    """Where ``model`` runs (``GET /instances``), ready instances first; ``None`` if the key may not see it."""
    response = await client.get("/instances")
    if response.status_code != 200:
        return None
    names = {model, model.removesuffix(":latest"), model if ":" in model else f"{model}:latest"}
    mine = [i for i in response.json() if i["model"] in names]
    mine.sort(key=lambda i: i["state"]["state"] != "ready")
    if not mine:
        return None
    instance, where = mine[0], mine[0]["placement"]
    return {
        "instance": instance["id"],
        "state": instance["state"]["state"],
        "backend": where["backend"],
        "strategy": where["strategy"],
        "context": where["context"],
        "nodes": [
            {k: s[k] for k in ("node_id", "layer_start", "layer_end", "tensor_rank", "tensor_size")}
            for s in where["shards"]
        ],
        "memory_per_node": where["memory_per_node"],
    }


async def bench(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    """Every cell and repetition; the document ``--json`` prints."""
    top = max(args.concurrency)
    limits = httpx.Limits(max_connections=top + 4, max_keepalive_connections=top + 4)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    async with httpx.AsyncClient(
        base_url=args.url, timeout=timeout, limits=limits, trust_env=False, headers=_auth(args)
    ) as client:
        words = {}
        for n in args.prompt_tokens:
            say(f"sizing a {n}-token prompt (the first request loads {args.model} if it is not yet placed)")
            words[n] = await calibrate(client, args.model, n)
        cells = [Cell(p, g, c) for p in args.prompt_tokens for g in args.gen_tokens for c in args.concurrency]
        total, done = len(cells) * args.repetitions, 0
        seeds = itertools.count(random.SystemRandom().randrange(1, 1 << 40))  # seed 0 sized the prompts
        for cell in cells:
            for rep in range(args.repetitions):
                done += 1
                label = f"c={cell.concurrency} prompt={cell.prompt_tokens} gen={cell.gen_tokens}"
                say(f"[{done}/{total}] {label} rep {rep + 1}/{args.repetitions}")
                cell.runs.append(await run_cell(client, args.model, cell, words[cell.prompt_tokens], seeds))
        where = await placement(client, args.model)
    return {
        "url": args.url,
        "model": args.model,
        "endpoint": "/v1/completions",
        "placement": where,
        "results": [cell.summary() for cell in cells],
    }


def _auth(args: argparse.Namespace) -> dict[str, str]:
    """``--api-key``, else ``$MESHGATE_API_KEY``, else what ``meshgate keys`` reads (``$MESHGATE_ADMIN_KEY``, the
    first of ``$MESHGATE_API_KEYS``)."""
    listed = [k.strip() for k in os.environ.get("MESHGATE_API_KEYS", "").split(",") if k.strip()]
    key = (
        args.api_key
        or os.environ.get("MESHGATE_API_KEY")
        or os.environ.get("MESHGATE_ADMIN_KEY")
        or next(iter(listed), None)
    )
    return {"authorization": f"Bearer {key}"} if key else {}


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated whole numbers such as 1,4,8; got {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers of at least 1; got {text!r}")
    return sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``meshgate bench`` options."""
    p.add_argument("--url", default="http://127.0.0.1:11434", help="the gateway (default %(default)s)")
    p.add_argument("--api-key", help="a key (default $MESHGATE_API_KEY, else $MESHGATE_ADMIN_KEY / _API_KEYS)")
    p.add_argument("--model", "-m", default="gemma3:270m", help="the model to measure (default %(default)s)")
    p.add_argument("--prompt-tokens", "-p", type=_sizes, default=[128, 512], help="prompt lengths (128,512)")
    p.add_argument("--gen-tokens", "-n", type=_sizes, default=[64, 128], help="tokens to generate (64,128)")
    p.add_argument("--concurrency", "-c", type=_sizes, default=[1, 4, 8], help="streams at once (1,4,8)")
    p.add_argument("--repetitions", "-r", type=int, default=3, help="runs of each combination (3)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (600)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--plot", metavar="FILE", help="also write a PNG of tok/s and TTFT against concurrency")


def main(args: argparse.Namespace) -> int:
    """Run ``meshgate bench``; 0 on success, 1 when the gateway fails a request, 2 for bad options."""
    from meshgate.gateway.cli import bench_report

    if args.repetitions < 1:
        print("--repetitions must be at least 1", file=sys.stderr)
        return 2
    if args.plot and not bench_report.can_plot():
        print(bench_report.NO_MATPLOTLIB, file=sys.stderr)
        return 2
    args.url = args.url.rstrip("/")

    def say(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        document = asyncio.run(bench(args, say))
    except (BenchError, httpx.HTTPError) as exc:
        print(f"meshgate bench: {exc or type(exc).__name__} ({args.url})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("meshgate bench: interrupted; nothing reported", file=sys.stderr)
        return 130
    if args.plot:
        bench_report.plot(document, args.plot)
        say(f"wrote {args.plot}")
    print(bench_report.to_json(document) if args.json else bench_report.table(document))
    return 0
