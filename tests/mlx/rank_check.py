"""One rank of an MLX engine check, run with the MLX venv's python (``test_mlx_engine.py`` starts it).

``python tests/mlx/rank_check.py MODEL_DIR [max_tokens]``: rank 0 (or the only process) greedily generates for
``PROMPTS`` and prints one JSON line ``{"ranks", "sharded", "results": [{"prompt", "tokens", "text",
"finish"}]}``; followers follow; every rank leaves through the head's shutdown barrier.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import mlx.core as mx

from backends.mlx.engine import MlxEngine
from protocols.model import Finished, Message, Request, Sampling, TextDelta, TextPart

PROMPTS = ["Hello world", "The quick brown fox", "Ranks talk over a ring"]


def main() -> None:
    group = mx.distributed.init(strict=True, backend="ring") if os.environ.get("MLX_HOSTFILE") else None
    engine = MlxEngine(sys.argv[1], group=group)
    if engine.rank != 0:
        engine.follow()
        return
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    results = []
    for prompt in PROMPTS:
        request = Request(model="tiny", messages=(Message(role="user", parts=(TextPart(text=prompt),)),),
                          sampling=Sampling(temperature=0.0), max_tokens=limit)
        events = list(engine.generate(request, threading.Event()))
        results.append({"prompt": prompt, "tokens": engine.last_tokens,
                        "text": "".join(e.text for e in events if isinstance(e, TextDelta)),
                        "finish": next(e.reason for e in events if isinstance(e, Finished))})
    sharded = type(engine.model.model.layers[0].self_attn.q_proj).__name__
    engine.shutdown()
    print(json.dumps({"ranks": engine.lockstep.size, "sharded": sharded, "results": results}), flush=True)


if __name__ == "__main__":
    main()
