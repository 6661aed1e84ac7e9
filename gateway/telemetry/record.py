"""One request's facts as the gateway learns them, in a context variable the request's tasks share.

``gateway.telemetry.middleware`` creates a ``RequestRecord`` when a request arrives (its id is the one the
response carries in ``x-request-id``) and reads it when the response is done, for the request log line and the
metrics. In between, the code that knows a fact writes it: the auth guard's caller is read from the connection
state; the dispatcher notes the model asked for (``note_model``), a generation's class (``note_class``), the
replica that serves (``note_served``), an embedding's tokens (``note_embedded``) and, for a generation, the first
token's time, the last ``Usage`` (or, for a stream that did not finish, the deltas it relayed) and how the
stream ended (``gateway.serving.streams.relay``, through ``telemetry.observe``). Tasks a request starts copy the
context, so they see the same record; code that runs outside a request sees ``None``.

Imports the standard library only.
"""

from __future__ import annotations

import contextvars
import secrets
import time
from typing import Any

__all__ = [
    "RequestRecord",
    "current",
    "new_request_id",
    "note_class",
    "note_embedded",
    "note_model",
    "note_served",
]


class RequestRecord:
    """What one request did; ``None`` where it does not apply (no model, no generation)."""

    __slots__ = (
        "asked",
        "batch",
        "cache_note",
        "cached_tokens",
        "klass",
        "error",
        "first_token_at",
        "generated_tokens",
        "id",
        "instance",
        "ended_at",
        "model",
        "prompt_tokens",
        "resume_wait",
        "resumes",
        "started",
        # set when the response is done (``finished``), for the report that follows in a batch
        "bucket",
        "endpoint",
        "error_body",
        "finished_at",
        "method",
        "path",
        "protocol",
        "status",
    )

    def __init__(self, request_id: str) -> None:
        self.id = request_id
        self.started = time.perf_counter()
        self.asked: str | None = None  # the model name the client sent
        self.model: str | None = None  # the catalog model that served it
        self.instance: str | None = None
        self.klass: str | None = None  # a generation's class: interactive or batch (``gateway.serving.admission``)
        self.prompt_tokens: int | None = None
        self.generated_tokens: int | None = None
        self.cached_tokens = 0  # prompt tokens the runner took from its cache (a prefix it still held)
        self.cache_note = ""  # how the runner had them, when it weighed a peer's KV tier (``Usage.cache_note``)
        self.first_token_at: float | None = None  # perf_counter of the first generated token (text, reasoning, tool)
        self.ended_at: float | None = None  # perf_counter of the stream's end (its terminal event)
        self.error: str | None = None  # why a stream that had started failed (the status was sent already)
        self.resumes = 0  # times the stream moved to another replica after its own failed (``gateway.serving.resume``)
        self.resume_wait = 0.0  # seconds the client waited for those moves
        self.batch: str | None = None  # a batch line's job id (``gateway.batches``: no HTTP request of its own)

    def finished(self, scope: Any, status: int, error_body: bytes, protocol: str) -> None:
        """The response is done: what its report needs from the ASGI ``scope``, which is not kept."""
        caller = scope.get("state", {}).get("caller")  # the auth guard's ``Caller``
        endpoint = scope.get("path_template") or "other"  # Litestar's router sets it when a route matched
        bucket = getattr(caller, "bucket", "")
        self.ended(scope["method"], scope["path"], endpoint, status, protocol, error_body, bucket)

    def ended(
        self, method: str, path: str, endpoint: str, status: int, protocol: str, error_body: bytes, bucket: str
    ) -> None:
        """The request is done (``finished`` for an HTTP request; a batch line says its own)."""
        self.finished_at = time.perf_counter()
        self.status, self.error_body, self.protocol = status, error_body, protocol
        self.method, self.path, self.endpoint, self.bucket = method, path, endpoint, bucket


_current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("meshgate_request", default=None)


def current() -> RequestRecord | None:
    """The record of the request this code runs for, if any (and if telemetry is on)."""
    return _current.get()


def bind(record: RequestRecord | None) -> contextvars.Token[RequestRecord | None]:
    return _current.set(record)


def unbind(token: contextvars.Token[RequestRecord | None]) -> None:
    _current.reset(token)


def note_model(asked: str) -> None:
    """The model name a request asked for (the dispatcher calls it as it resolves the name)."""
    record = _current.get()
    if record is not None:
        record.asked = asked


def note_class(klass: str) -> None:
    """The class a generation waits in (``interactive`` or ``batch``), as the dispatcher settled it."""
    record = _current.get()
    if record is not None:
        record.klass = klass


def note_served(model: str, instance: str) -> None:
    """The model and the replica that serve a generation (again when a resume moves it)."""
    record = _current.get()
    if record is not None:
        record.model, record.instance = model, instance


def note_embedded(model: str, prompt_tokens: int) -> None:
    """An embedding request's model and the tokens it embedded (its log line's ``prompt_tokens``)."""
    record = _current.get()
    if record is not None:
        record.model, record.prompt_tokens, record.generated_tokens = model, prompt_tokens, 0


def new_request_id() -> str:
    """``req_`` and 24 hex digits, as the responses' ``x-request-id`` always looked."""
    return f"req_{secrets.token_hex(12)}"
