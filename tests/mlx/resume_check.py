"""Resumed streams on the MLX engine, run with the MLX venv's python (``test_mlx_engine.py`` starts it).

``python tests/mlx/resume_check.py MODEL_DIR CASES_JSON``: ``CASES_JSON`` is a list of ``{"prompt", "format",
"temperature", "seed", "max_tokens"}``. For each case the engine generates undisturbed, then again with
``Request.resume`` set to the token ids of its first 1, 2, ... content events (a stream that moved here from a
failed replica after that many events), all cuts of a case side by side in one batch. Prints one JSON line: per
case ``{"whole": [[text, ids], ...], "finish", "resumed": {cut: {"events": [[text, ids], ...], "finish"}}}``.
"""

from __future__ import annotations

import json
import os
import sys
import threading

from meshgate.backends.mlx.engine import MlxEngine
from meshgate.protocols.model import Finished, Message, Request, ResponseFormat, Sampling, TextDelta, TextPart


def _request(case: dict, resume: tuple[int, ...] = ()) -> Request:
    fmt = case.get("format") or {}
    return Request(
        model="tiny",
        messages=(Message(role="user", parts=(TextPart(text=case["prompt"]),)),),
        sampling=Sampling(temperature=case.get("temperature", 0.0), seed=case.get("seed", 0)),
        response_format=ResponseFormat(kind=fmt.get("kind", "text"), schema=fmt.get("schema")),
        max_tokens=case.get("max_tokens", 24),
        resume=resume,
    )


def _run(engine: MlxEngine, request: Request, into: dict) -> None:
    events = []
    for event in engine.generate(request, threading.Event()):
        if isinstance(event, TextDelta):
            events.append([event.text, list(event.tokens)])
        elif isinstance(event, Finished):
            into["finish"] = event.reason
    into["events"] = events


def main() -> None:
    cases = json.loads(sys.argv[2])
    engine = MlxEngine(sys.argv[1], parallel=4)
    report = []
    for case in cases:
        whole: dict = {}
        _run(engine, _request(case), whole)
        cuts = [c for c in (1, 2, len(whole["events"]) // 2, len(whole["events"]) - 1) if 0 < c < len(whole["events"])]
        resumed: dict = {c: {} for c in cuts}
        threads = []
        for cut in cuts:
            ids = tuple(t for _, tokens in whole["events"][:cut] for t in tokens)
            thread = threading.Thread(target=_run, args=(engine, _request(case, ids), resumed[cut]))
            threads.append(thread)
            thread.start()
        for thread in threads:
            thread.join(240)
        report.append({"whole": whole["events"], "finish": whole["finish"], "resumed": resumed})
    engine.shutdown()
    print(json.dumps(report), flush=True)
    os._exit(0)  # as rank_check.py: no MLX thread teardown at interpreter exit


if __name__ == "__main__":
    main()
