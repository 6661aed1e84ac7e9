"""One rank of MLX engine checks, run with the MLX venv's python (``test_mlx_engine.py`` starts it).

``python tests/mlx/rank_check.py RUNS_JSON [max_tokens]``: ``RUNS_JSON`` is a list of runs, each
``{"model": DIR, "mode": "single"|"tensor"|"pipeline", "layers": [[s, e], ...] (one range per rank) or null}``
(with ``"expect_error": true`` the load must fail with ``ValueError``, reported as ``{"error"}``),
done one after another in the same processes (imports cost ~10 s per launch on 2 cores, so one launch checks
many things). Per run, rank 0 (or the only process) greedily generates for ``PROMPTS``; followers follow; every
rank leaves each run through the head's shutdown barrier. At the end every rank prints one JSON line
``{"rank", "max_rss_kb", "runs": [{"health", "sharded", "weight_bytes", "results": [{"prompt", "tokens", "text",
"finish"}]}]}`` (``health`` and ``results`` on the head only; ``sharded``: the class of layer 0's ``q_proj``,
or of the first layer this rank holds).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading

import mlx.core as mx

from backends.mlx.engine import MlxEngine
from protocols.model import Finished, Message, Request, Sampling, TextDelta, TextPart

# the last prompt outgrows the tiny gemma3's sliding window (8 tokens) in the prompt itself
PROMPTS = ["Hello world", "The quick brown fox",
           "Ranks talk over a ring of sockets. Rank zero is the head: it reads the request, the others follow."]


def _run(group: object, run: dict, limit: int) -> dict:
    rank = group.rank() if group is not None else 0
    layers = run.get("layers")
    try:
        engine = MlxEngine(run["model"], group=group, mode=run["mode"],
                           layers=tuple(layers[rank]) if layers else None)
    except ValueError as exc:  # a bad placement: every rank must refuse it alike (and none may hang)
        if run.get("expect_error"):
            return {"error": str(exc)}
        raise
    held = next(layer for layer in engine.model.layers if layer is not None)
    out = {"sharded": type(held.self_attn.q_proj).__name__, "weight_bytes": engine.weight_bytes}
    if engine.rank != 0:
        engine.follow()
        return out
    results = []
    for prompt in PROMPTS:
        request = Request(model="tiny", messages=(Message(role="user", parts=(TextPart(text=prompt),)),),
                          sampling=Sampling(temperature=0.0), max_tokens=limit)
        events = list(engine.generate(request, threading.Event()))
        results.append({"prompt": prompt, "tokens": engine.last_tokens,
                        "text": "".join(e.text for e in events if isinstance(e, TextDelta)),
                        "finish": next(e.reason for e in events if isinstance(e, Finished))})
    engine.shutdown()
    return out | {"health": engine.health(), "results": results}


def main() -> None:
    group = mx.distributed.init(strict=True, backend="ring") if os.environ.get("MLX_HOSTFILE") else None
    runs = json.loads(sys.argv[1])
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    done = [_run(group, run, limit) for run in runs]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rank": group.rank() if group is not None else 0, "max_rss_kb": rss, "runs": done}), flush=True)


if __name__ == "__main__":
    main()
