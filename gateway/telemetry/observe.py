"""What a generation's event stream tells the request's telemetry record, noted as the stream passes.

``gateway.serving.streams.relay`` calls ``note`` for the events it watches: every event until the first token (its
time), then only ``Usage`` and the end (one set lookup per event); the deltas after the first token are counted,
not looked at, and ``note_relayed`` turns that count into the generated tokens of a stream that ended without
its final ``Usage`` (its client went away, or it failed).

Imports the internal model and the telemetry record only.
"""

from __future__ import annotations

import time

from meshgate.gateway.telemetry.record import RequestRecord
from meshgate.protocols.model import (
    Event,
    Failed,
    Finished,
    KeepAlive,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
)

__all__ = ["AFTER_FIRST_TOKEN", "UNTIL_FIRST_TOKEN", "note", "note_relayed"]

AFTER_FIRST_TOKEN: frozenset[type] = frozenset({Usage, Finished, Failed})
UNTIL_FIRST_TOKEN: frozenset[type] = AFTER_FIRST_TOKEN | {TextDelta, ReasoningDelta, ToolCallDelta, KeepAlive}


def note(record: RequestRecord | None, event: Event) -> frozenset[type]:
    """Put what ``event`` tells into ``record``; the event types to watch from now on."""
    if record is None:
        return frozenset()
    if isinstance(event, Usage):
        record.prompt_tokens, record.generated_tokens = event.prompt_tokens, event.completion_tokens
        record.cached_tokens = event.cached_tokens
        record.cache_note = event.cache_note or record.cache_note
    elif isinstance(event, Finished | Failed):
        record.ended_at = time.perf_counter()
        if isinstance(event, Failed):
            record.error = event.error.message
    elif record.first_token_at is None and not isinstance(event, KeepAlive):  # a prefill's keep-alive is no token
        record.first_token_at = time.perf_counter()
    return UNTIL_FIRST_TOKEN if record.first_token_at is None else AFTER_FIRST_TOKEN


def note_relayed(record: RequestRecord, after_first: int) -> None:
    """A stream that did not finish has no final ``Usage`` (its first one counts the prompt only): its generated
    tokens are the deltas relayed, the first token and ``after_first`` more, unless a ``Usage`` said more."""
    finished = record.ended_at is not None and record.error is None
    if finished or record.first_token_at is None:
        return
    if after_first + 1 > (record.generated_tokens or 0):
        record.generated_tokens = after_first + 1
