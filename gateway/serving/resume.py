"""A client's stream that outlives its replica: when the replica fails mid-stream, the stream goes on on another.

A generation's events come from one replica's runner. When that runner dies, its node goes away or the link to it
fails, the runner client ends the stream with a ``Failed`` whose kind is ``BackendUnavailable`` or
``BackendTimeout``. ``resumable`` catches that ``Failed`` before it reaches the client and asks ``Resume`` (the
dispatcher's) for the same request on another replica with ``Request.resume`` set to the token ids the client's
events carried (each delta's ``tokens``). That replica takes those tokens as its own output (prefilled after the
prompt; the grammar, stop strings and tool-call state go through them), sends their events again and generates
the rest; the events the client already has are skipped here, counted by kind-blind position (a backend's events
for a given token sequence are the same whichever replica made them), or as one delta carrying all their tokens
from a backend that cannot replay them event by event (vLLM). So the client sees one unbroken stream in
its protocol, its usage counting everything it received, and under greedy decoding the text it would have got
from an undisturbed run (batching is exact: the text does not depend on the load).

A stream is resumable while every token it sent is known: no content yet (a plain retry), or a backend that puts
``tokens`` on its deltas (llama.cpp's and MLX's runners do; vLLM's does for plain text: its streams with a
response format, tools or log probabilities fail mid-stream, see ``backends.vllm.runner``).
While the new replica is found, placed or prefilled the client gets keep-alives. A stream resumes at most
``MAX_RESUMES`` times; when no replica takes over within ``resume_wait`` seconds, or the new one fails to start,
the client gets the original ``Failed``: its protocol's mid-stream error, as without resume. Each resume is
counted on the request's telemetry record (``resumes``, ``resume_wait``): the request log and ``/metrics``.

Imports protocols, the telemetry record and ``gateway.serving.streams`` only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from meshgate.gateway.serving.streams import aclose
from meshgate.gateway.telemetry import record as telemetry
from meshgate.protocols.model import (
    Event,
    Failed,
    Finished,
    GatewayError,
    KeepAlive,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
    error_from_info,
)

__all__ = ["MAX_RESUMES", "RESUMABLE", "Resume", "resumable"]

log = logging.getLogger("meshgate.resume")

RESUMABLE = frozenset({"BackendUnavailable", "BackendTimeout"})
"""The failures a stream resumes after: its replica is gone or silent. A runner's own error (a grammar that cannot
go on, a bad request) would fail on any replica and goes to the client."""

MAX_RESUMES = 3
"""Replicas one stream may move to: a request that kills every runner it lands on is not retried for ever."""

_CONTENT: frozenset[type] = frozenset({TextDelta, ReasoningDelta, ToolCallDelta})

Resume = Callable[[tuple[int, ...], GatewayError], Awaitable[AsyncIterator[Event]]]
"""Start the request again on another replica with these tokens as its output so far (its ``Request.resume``),
after this failure of the one before; the new replica's events (it closes its slot when they end or are closed).
Raises ``GatewayError`` when none can take over."""


async def resumable(
    events: AsyncIterator[Event], resume: Resume, *, wait: float, keepalive: float, seen: Event | None = None
) -> AsyncIterator[Event]:
    """``events``, continued on another replica (``resume``) when they fail as ``RESUMABLE``; ``seen`` is an event
    the caller took from ``events`` before (it counts as sent)."""
    progress = _Progress()
    if seen is not None:
        progress.sent_event(seen)
    resumes = 0
    current = events
    try:
        while True:
            failed: Failed | None = None
            async for event in current:
                if isinstance(event, _Content):
                    if progress.replayed(event):
                        continue
                    progress.sent_event(event)
                elif isinstance(event, Usage) and progress.fresh:
                    progress.held = event  # the new replica's prompt count: the stream's own came first
                    continue
                elif isinstance(event, Failed) and progress.may_resume(event, resumes):
                    failed = event
                    break
                elif isinstance(event, Finished | Failed) and progress.held is not None:
                    yield progress.held  # a resumed stream that sent no more content still ends with its count
                progress.held = None
                yield event
            if failed is None:
                return
            await aclose(current)
            began = time.perf_counter()
            moved = asyncio.ensure_future(_bounded(resume(tuple(progress.tokens), error_from_info(failed.error)), wait))
            try:
                while not moved.done():
                    await asyncio.wait({moved}, timeout=keepalive)
                    if not moved.done():
                        yield KeepAlive()
                current = moved.result()
            except GatewayError as exc:
                log.warning("stream not resumed after %s: %s", failed.error.message, exc.message)
                yield failed
                return
            finally:
                if not moved.done():  # the client left while it waited
                    moved.cancel()
                    await asyncio.wait({moved})  # it may have got its replica's stream all the same
                if not moved.cancelled() and moved.exception() is None and moved.result() is not current:
                    await aclose(moved.result())  # a stream no one will read: free its slot
            resumes += 1
            progress.resumed()
            _note_resume(time.perf_counter() - began)
            log.info("stream resumed after %s with %d tokens sent", failed.error.kind, len(progress.tokens))
    finally:
        await aclose(current)


_Content = TextDelta | ReasoningDelta | ToolCallDelta


class _Progress:
    """What a stream has sent its client, and what a resumed replica must skip of its replay."""

    __slots__ = ("exact", "fresh", "held", "sent", "skip", "skip_tokens", "tokens")

    def __init__(self) -> None:
        self.sent = 0  # content events relayed to the client
        self.tokens: list[int] = []  # the ids they carried
        self.exact = True  # every token sent is known (the first delta carried ids)
        self.skip = 0  # the resumed replica's replayed content events still to drop
        self.skip_tokens = 0  # the tokens they carry
        self.fresh = False  # resumed, and none of the new replica's own content relayed yet
        self.held: Usage | None = None  # the new replica's Usage while ``fresh``

    def sent_event(self, event: Event) -> None:
        if not isinstance(event, _Content):
            return
        self.sent += 1
        self.fresh = False
        if event.tokens:
            self.tokens.extend(event.tokens)
        elif self.sent == 1:
            self.exact = False  # a backend that can resume puts the first token's id on the first delta

    def may_resume(self, failed: Failed, resumes: int) -> bool:
        return failed.error.kind in RESUMABLE and resumes < MAX_RESUMES and (self.exact or not self.sent)

    def replayed(self, event: _Content) -> bool:
        """Whether ``event`` replays one the client has: it is among the first ``sent`` content events of a resumed
        replica and does not carry tokens beyond those sent. A replica that replays event by event (llama.cpp,
        MLX) sends the same events again; one that cannot (vLLM) sends one delta carrying every sent token."""
        if self.skip and (self.skip_tokens > 0 or not event.tokens):
            self.skip -= 1
            self.skip_tokens -= len(event.tokens)
            return True
        self.skip = 0
        return False

    def resumed(self) -> None:
        self.skip, self.skip_tokens, self.fresh, self.held = self.sent, len(self.tokens), True, None


async def _bounded(start: Awaitable[AsyncIterator[Event]], wait: float) -> AsyncIterator[Event]:
    """``start``'s stream, or ``GatewayError`` when it takes longer than ``wait`` seconds."""
    try:
        return await asyncio.wait_for(start, wait)
    except TimeoutError:
        raise GatewayError(f"no replica took the stream over within {wait:g} s") from None


def _note_resume(waited: float) -> None:
    record = telemetry.current()
    if record is not None:
        record.resumes += 1
        record.resume_wait += waited
