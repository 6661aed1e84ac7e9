"""Structured output on the MLX engine, run with the MLX venv's python (``test_mlx_engine.py`` starts it).

``python tests/mlx/structured_check.py MODEL_DIR CASES_JSON``: ``CASES_JSON`` is a list of ``{"format":
{"kind", "schema"}, "temperature", "seed"}``; one engine (``parallel`` = the number of cases) generates for all
of them at once, one thread each, so the constrained rows decode in one batch beside a free-text row. Prints
one JSON line: per case ``{"text", "finish"}`` or ``{"error", "param"}`` (an ``InvalidRequest`` the engine
raised before generating).
"""

from __future__ import annotations

import json
import os
import sys
import threading

from meshgate.backends.mlx.engine import MlxEngine
from meshgate.protocols.model import (
    Finished,
    InvalidRequest,
    Message,
    Request,
    ResponseFormat,
    Sampling,
    TextDelta,
    TextPart,
)


def _generate(engine: MlxEngine, case: dict, into: dict) -> None:
    fmt = case.get("format") or {}
    request = Request(
        model="tiny",
        messages=(Message(role="user", parts=(TextPart(text=case.get("prompt", "Answer in JSON")),)),),
        sampling=Sampling(temperature=case.get("temperature", 0.0), seed=case.get("seed", 0)),
        response_format=ResponseFormat(kind=fmt.get("kind", "text"), schema=fmt.get("schema")),
        max_tokens=case.get("max_tokens", 200),
    )
    texts = []
    try:
        for event in engine.generate(request, threading.Event()):
            if isinstance(event, TextDelta):
                texts.append(event.text)
            elif isinstance(event, Finished):
                into.update(text="".join(texts), finish=event.reason)
    except InvalidRequest as exc:
        into.update(error=str(exc), param=exc.param)


def main() -> None:
    cases = json.loads(sys.argv[2])
    engine = MlxEngine(sys.argv[1], parallel=len(cases))
    out: list[dict] = [{} for _ in cases]
    threads = [threading.Thread(target=_generate, args=(engine, c, out[i])) for i, c in enumerate(cases)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(240)
    widest = engine.health()["batch"]["widest"]
    engine.shutdown()
    print(json.dumps({"results": out, "widest": widest}), flush=True)
    os._exit(0)  # as rank_check.py: no MLX thread teardown at interpreter exit


if __name__ == "__main__":
    main()
