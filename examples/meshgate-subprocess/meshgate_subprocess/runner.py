"""The runner process: ``python -m meshgate_subprocess.runner [--host H] [--port P]``.

``ShoutEngine`` is a toy model: it answers the last user message (or the raw prompt) with its words upper-cased,
one word at a time at ``PACE`` seconds a word, as a small model streams tokens. meshgate's runner ``serve`` puts it
on the internal streaming protocol (``POST /generate`` as NDJSON events, ``POST /tokenize``, ``GET /health``), for
callers that present the cluster secret ``RunnerProcess`` put in this process's environment. It prints the ready
line the backend's ``launch`` waits for and exits when the gateway that started it goes away.

Runs only in the runner process: imports ``meshgate`` (its internal types) and ``serve``, never the gateway.
``serve`` is not among the names ``meshgate`` exports, so it comes from its module, ``meshgate.backends.runner.server``.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Iterator
from typing import Any

import meshgate

__all__ = ["PACE", "ShoutEngine", "main"]

PACE = 0.01
"""Seconds between two words of an answer (a hundred words a second), so streaming and cancelling can be seen."""


def prompt_words(request: meshgate.Request) -> list[str]:
    """The words the toy reads: the last message's text, or the raw prompt of a plain completion."""
    text = request.messages[-1].text if request.messages else (request.raw_prompt or "")
    return text.split()


class ShoutEngine:
    """The runner server's ``Engine``: synchronous; ``generate`` runs on a thread of its own per request."""

    parallel = 4
    """Generations the server runs at once: the toy keeps no state between requests, so they may overlap."""

    def __init__(self, pace: float = PACE) -> None:
        if pace < 0:
            raise ValueError(f"--pace must be 0 or more seconds, not {pace}")
        self.pace = pace

    def generate(self, request: meshgate.Request, cancel: threading.Event) -> Iterator[meshgate.Event]:
        """Stream the upper-cased words, then ``Usage`` and exactly one ``Finished``.

        ``cancel`` is set when the gateway goes away mid-answer (its client disconnected): stop at once; the
        server ends the stream for us.
        """
        words = prompt_words(request)
        limit = len(words) if request.max_tokens is None else min(len(words), request.max_tokens)
        yield meshgate.Usage(prompt_tokens=len(words))
        for i, word in enumerate(words[:limit]):
            if i and cancel.wait(self.pace):  # sleeps one pace, or wakes up early when cancelled
                print(f"meshgate-subprocess runner: cancelled after {i} of {limit} words", file=sys.stderr, flush=True)
                return
            yield meshgate.TextDelta(text=word.upper() if i == 0 else " " + word.upper())
        yield meshgate.Usage(prompt_tokens=len(words), completion_tokens=limit)
        yield meshgate.Finished(reason="length" if limit < len(words) else "stop")

    def count_tokens(self, request: meshgate.Request, cancel: threading.Event) -> dict[str, int]:
        """``POST /tokenize``'s answer: the prompt's tokens (here: the words of every message and the raw prompt)."""
        return {"count": sum(len(m.text.split()) for m in request.messages) + len((request.raw_prompt or "").split())}

    def health(self) -> dict[str, Any]:
        """``GET /health``: facts about the loaded model (the server adds its request counts)."""
        return {"model": "shout", "pace": self.pace}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="meshgate-subprocess-runner")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (the ready line says which)")
    parser.add_argument("--pace", type=float, default=PACE, help="seconds between two words")
    args = parser.parse_args(argv)
    try:
        engine = ShoutEngine(args.pace)  # a real runtime loads its weights here
    except Exception as exc:  # noqa: BLE001 - whatever stops the load, the supervisor is told why; nothing is served
        print(f"MESHGATE_RUNNER_FAILED {exc}", flush=True)  # the supervisor's failure line
        sys.exit(1)
    meshgate.serve(engine, args.host, args.port)


if __name__ == "__main__":
    main()
