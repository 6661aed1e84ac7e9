"""One rank of MLX engine checks, run with the MLX venv's python (``test_mlx_engine.py`` starts it).

``python tests/mlx/rank_check.py RUNS_JSON [max_tokens]``: ``RUNS_JSON`` is a list of runs, each
``{"model": DIR, "mode": "single"|"tensor"|"pipeline", "layers": [[s, e], ...] (one range per rank) or null,
"dtype": a compute dtype or null}``
(with ``"expect_error": true`` the load must fail with ``ValueError``, reported as ``{"error"}``),
done one after another in the same processes (imports cost ~10 s per launch on 2 cores, so one launch checks
many things). Per run, rank 0 (or the only process) greedily generates for ``PROMPTS`` one at a time, then for
all of them at once (``together``: one thread per prompt, as the runner's server calls a batching engine; each
starts once the previous one has its third token, so each joins a batch that is already decoding and the rows
leave at different steps); followers follow; every rank leaves each run through the head's shutdown barrier.
At the end every rank prints one JSON line ``{"rank", "max_rss_kb", "runs": [{"health", "sharded",
"weight_bytes", "results": [{"prompt", "tokens", "text", "finish"}], "together": [the same], "batch": {the
scheduler's counters after the together pass}}]}`` (``health``, ``results``, ``together`` and ``batch`` on the
head only; ``sharded``: the class of layer 0's ``q_proj``, or of the first layer this rank holds), then leaves
with ``os._exit`` (a thread that ran MLX's compiled functions frees their cache at its exit and needs the GIL
then: an interpreter already finalizing aborts instead).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading

import mlx.core as mx

from meshgate.backends.mlx.engine import MlxEngine
from meshgate.protocols.model import Finished, Message, Request, Sampling, TextDelta, TextPart, Usage

# the last prompt outgrows the tiny gemma3's sliding window (8 tokens) in the prompt itself
PROMPTS = [
    "Hello world",
    "The quick brown fox",
    "Ranks talk over a ring of sockets. Rank zero is the head: it reads the request, the others follow.",
]


def _run(group: object, run: dict, limit: int) -> dict:
    rank = group.rank() if group is not None else 0
    layers = run.get("layers")
    try:
        engine = MlxEngine(
            run["model"],
            group=group,
            mode=run["mode"],
            layers=tuple(layers[rank]) if layers else None,
            dtype=run.get("dtype"),
            parallel=len(PROMPTS),
        )
    except ValueError as exc:  # a bad placement: every rank must refuse it alike (and none may hang)
        if run.get("expect_error"):
            return {"error": str(exc)}
        raise
    held = next(layer for layer in engine.model.layers if layer is not None)
    out = {"sharded": type(held.self_attn.q_proj).__name__, "weight_bytes": engine.weight_bytes}
    if engine.rank != 0:
        engine.follow()
        return out
    results = [_generate(engine, prompt, limit) for prompt in PROMPTS]
    together: list[dict] = [{} for _ in PROMPTS]
    started = [threading.Event() for _ in PROMPTS]
    threads = [
        threading.Thread(
            target=_generate, args=(engine, p, limit, together[i], started[i + 1] if i + 1 < len(PROMPTS) else None)
        )
        for i, p in enumerate(PROMPTS)
    ]
    for thread, go in zip(threads, [threading.Event(), *started[1:]], strict=True):
        if thread is not threads[0]:
            go.wait(120)
        thread.start()
    for thread in threads:
        thread.join(120)
    batch = engine.health()["batch"]
    engine.shutdown()
    return out | {"health": engine.health(), "results": results, "together": together, "batch": batch}


def _generate(
    engine: MlxEngine, prompt: str, limit: int, into: dict | None = None, third: threading.Event | None = None
) -> dict:
    """One greedy generation; ``third`` is set once it has its third token (or has ended)."""
    request = Request(
        model="tiny",
        messages=(Message(role="user", parts=(TextPart(text=prompt),)),),
        sampling=Sampling(temperature=0.0),
        max_tokens=limit,
    )
    texts, finish, count = [], None, None
    try:
        for event in engine.generate(request, threading.Event()):
            if isinstance(event, TextDelta):
                texts.append(event.text)
                if len(texts) == 3 and third is not None:
                    third.set()
            elif isinstance(event, Finished):
                finish = event.reason
            elif isinstance(event, Usage):
                count = event.completion_tokens
    finally:
        if third is not None:
            third.set()
    found = {"prompt": prompt, "text": "".join(texts), "finish": finish, "completion_tokens": count}
    if into is None:  # one at a time: the engine's own record of the picks is this generation's
        return found | {"tokens": engine.last_tokens}
    into.update(found)
    return found


def main() -> None:
    group = mx.distributed.init(strict=True, backend="ring") if os.environ.get("MLX_HOSTFILE") else None
    runs = json.loads(sys.argv[1])
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    done = [_run(group, run, limit) for run in runs]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rank": group.rank() if group is not None else 0, "max_rss_kb": rss, "runs": done}), flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
