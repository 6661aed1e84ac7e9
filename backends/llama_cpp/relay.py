"""A job's tokens as events, read two ways: by a thread that waits on them, or pushed to the runner's event loop.

``TokenEvents`` is one request's text pipeline, token by token: detokenizing (UTF-8 pieces held until whole), stop
strings (``StopMatcher``; not for forced calls: the grammar ends those), tool calls (``tools.CallGate``), per-token
logprobs (``logprobs.LogprobAligner``, kept with their text past the stop matcher), and the token ids on the first
event each token produces. ``end`` makes the closing events (what the matchers held back, ``Usage``, ``Finished``)
or raises the job's failure.

Two readers use it:

- ``thread_events``: a generator for a thread of its own (``LlamaEngine.generate``, the ``Engine`` protocol), which
  waits on the job's queue and sends keep-alives while the prompt is prefilled.
- ``Pushed``: the runner's event loop itself (``LlamaEngine.open_stream``, ``runner.server``). The scheduler puts the
  tokens in the job's queue without waking anyone and calls the job's ``wake`` once per step (``batch.Scheduler``:
  one call for every stream of the step), and the loop ``poll``s each stream's queue without blocking. So a token
  costs the runner one thread hand-off per step, not two per token (the scheduler waking the request's thread,
  that thread waking the loop), and nothing in it can wait.

Runs only in the runner process; imports protocols and the engine's own modules.
"""

from __future__ import annotations

import codecs
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from meshgate.backends.llama_cpp.batch import Job
from meshgate.backends.llama_cpp.logprobs import LogprobAligner
from meshgate.backends.llama_cpp.sampling import GrammarStuck
from meshgate.backends.llama_cpp.tools import CallGate, call_mode
from meshgate.backends.runner.stops import StopMatcher
from meshgate.protocols.model import (
    Event,
    Failed,
    Finished,
    GatewayError,
    KeepAlive,
    Request,
    TokenLogprob,
    Usage,
)

__all__ = ["PREFILL_PING", "REPLAYED", "Pushed", "TokenEvents", "thread_events"]

PREFILL_PING = float(os.environ.get("MESHGATE_KEEPALIVE") or 2.0)
"""Seconds between keep-alives while a prompt is prefilled (the gateway's ``keepalive`` setting, which runners
inherit from its environment): a long prompt on a CPU takes minutes, and clients give up on a stream that stays
silent (Claude Code after 300 s, proxies often after 60 s)."""

REPLAYED = TokenLogprob(token="", logprob=0.0)
"""The logprob entry of a resumed request's replayed tokens: their events are the client's already, never sent."""


class TokenEvents:
    """One request's tokens turned into its events (see the module docstring)."""

    def __init__(self, piece: Callable[[int], bytes], request: Request) -> None:
        self.piece = piece  # a token's bytes
        self.stopper = StopMatcher(request.stop if call_mode(request) != "forced" else ())
        self.gate = CallGate(request)
        self.aligner = LogprobAligner() if request.logprobs else None
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.finish = Finished(reason="length")
        self.count = 0  # tokens taken, replayed ones included
        self.ids: list[int] = []  # taken since the last event that carried ids
        self.stopped = False  # the answer is whole (a stop string, a whole tool call): the job is told to stop

    def token(self, token: int, entry: Any) -> list[Event]:
        """The events ``token`` (with its logprob ``entry``) completes."""
        self.count += 1
        self.ids.append(token)
        decoded = self.decoder.decode(self.piece(token))
        aligner = self.aligner
        if aligner is not None:
            aligner.add(decoded, entry)
        text, matched = self.stopper.feed(decoded)
        events: list[Event] = []
        for event in self.gate.feed(text, aligner.take(text) if aligner is not None else ()):
            if self.ids:
                event = msgspec.structs.replace(event, tokens=tuple(self.ids))
                self.ids.clear()
            events.append(event)
        if matched is not None:
            self.finish = Finished(reason="stop_sequence", stop_sequence=matched)
            self.stopped = True
        elif self.gate.done:
            self.finish = Finished(reason="stop")
            self.stopped = True
        return events

    def end(self, job: Job, n_prompt: int, load_ns: int, started: int, first_token_at: int | None) -> list[Event]:
        """The closing events, once the job's tokens ended or this stopped it; ``[]`` for a cancelled job; the job's
        failure is raised (``GatewayError``)."""
        finish = self.finish
        if not self.stopped:  # the job's tokens ended: its reason says why
            if isinstance(job.failure, GrammarStuck):  # the schema passed the checks: ours to fix, a 500
                raise GatewayError(f"structured output failed: {job.failure}") from job.failure
            if job.failure is not None:
                raise GatewayError(str(job.failure)) from job.failure
            if job.end == "cancelled":
                return []
            finish = Finished(reason="stop") if job.end == "stop" else finish
        cut = finish.reason == "stop_sequence"
        rest = "" if cut else self.stopper.flush() + self.decoder.decode(b"", final=True)
        last = self.aligner.rest() if self.aligner is not None and not cut else ()
        events = list(self.gate.feed(rest, last))
        held, finish = self.gate.close(finish)
        events += held
        ended = time.perf_counter_ns()
        first = first_token_at or ended
        usage = Usage(
            prompt_tokens=n_prompt,
            completion_tokens=self.count,
            cached_tokens=job.cached,  # taken from a slot's cache or the KV tier, not evaluated again
            cache_note=job.note,
            load_ns=load_ns,
            prompt_ns=first - started,
            eval_ns=ended - first,
        )
        return [*events, usage, finish]


def thread_events(
    text: TokenEvents,
    job: Job,
    request: Request,
    cancel: threading.Event,
    n_prompt: int,
    load_ns: int,
    started: int,
) -> Iterator[Event]:
    """The job's events for a thread that waits on them; a resumed request's tokens first, as if generated (their
    events are the ones the failed replica sent, with the same ``tokens`` on each)."""
    first_token_at = None
    ping_at = time.monotonic() + PREFILL_PING
    replayed = iter([(token, REPLAYED) for token in request.resume])
    while not text.stopped:
        item = next(replayed, None)
        if item is None:
            try:
                item = job.out.get(timeout=0.1)
            except queue.Empty:
                if cancel.is_set():
                    return
                if first_token_at is None and time.monotonic() >= ping_at:
                    ping_at += PREFILL_PING
                    yield KeepAlive()  # still prefilling: tell the client the stream is alive
                continue
            if item is None:
                break
            if first_token_at is None:
                first_token_at = time.perf_counter_ns()
        yield from text.token(*item)
    job.done.set()
    yield from text.end(job, n_prompt, load_ns, started, first_token_at)


class Pushed:
    """A job read by the event loop: ``poll`` takes whatever tokens its queue holds, never waiting; the job's
    ``wake`` (set before it was submitted) says when there may be more."""

    def __init__(self, text: TokenEvents, job: Job, request: Request, opening: Usage, load_ns: int) -> None:
        self.text = text
        self.job = job
        self.opening = opening  # the first event: the prompt's size, before any token
        self.n_prompt = opening.prompt_tokens
        self.load_ns = load_ns
        self.started = time.perf_counter_ns()
        self.first_token_at: int | None = None
        self.ping_at = time.monotonic() + PREFILL_PING
        self.replayed = deque((token, REPLAYED) for token in request.resume)
        self.done = False

    def poll(self) -> tuple[list[Event], bool]:
        """The events of the tokens that came since the last call, and whether they end the stream (the last one is
        then ``Finished``, or ``Failed``; none after a cancel)."""
        text, job, events = self.text, self.job, []
        while self.replayed and not text.stopped:
            events += text.token(*self.replayed.popleft())
        while not text.stopped:
            try:
                item = job.out.get_nowait()
            except queue.Empty:
                if self.first_token_at is None and time.monotonic() >= self.ping_at:
                    self.ping_at += PREFILL_PING
                    events.append(KeepAlive())
                return events, False
            if item is None:
                break
            if self.first_token_at is None:
                self.first_token_at = time.perf_counter_ns()
            events += text.token(*item)
        job.done.set()
        self.done = True
        try:
            events += text.end(job, self.n_prompt, self.load_ns, self.started, self.first_token_at)
        except GatewayError as exc:
            events.append(Failed(error=exc.info()))
        return events, True

    def close(self) -> None:
        """The reader is gone (the stream ended, or its client did): the job leaves its slot at the next step."""
        self.job.done.set()
