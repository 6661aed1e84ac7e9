"""The request middleware: one id per request, one log line when it is done, its metrics.

A raw ASGI wrapper around the Litestar app's handler (outside routing and the exception handlers, so unknown
paths, refused keys and rendered errors are all seen). When a request arrives it makes the request id (sent back
as ``x-request-id`` and ``request-id``) and a ``RequestRecord`` in the context (``telemetry.record``), which the
dispatcher fills as the request runs; when the app returns (after a stream's last byte) it counts the request in
``GatewayMetrics`` and logs one line on ``meshgate.requests``::

    request id=req_... protocol=openai method=POST path=/v1/chat/completions model=gemma3:270m key=3f2a9c01d4e5
    status=200 prompt_tokens=12 generated_tokens=40 ttft_ms=85 duration_ms=912 instance=5d0c2f1e9a7b
    class=interactive

(one line; ``-`` where a field does not apply; ``class``, a generation's priority class, only on generations;
``batch``, the job's id, only on a batch line's: each line is logged and counted as a request of its endpoint's,
with no HTTP request of its own, its ``key`` the job's owner;
``worker``, the process's index under ``meshgate serve --workers N``, only there). A
4xx/5xx line ends with ``error="..."``, the message the client got (read from the error body); a stream that
failed after its 200 carries its ``Failed`` message there too.
``key`` is the caller's key id (a stored key's id, ``boot:<n>`` for the n-th bootstrap key), never the key.
Probes (``GET``/``HEAD /``, ``/api/version``, ``/metrics``) that succeed are logged at DEBUG.

Nothing is recorded when metrics are off (``MESHGATE_METRICS=0``) and INFO is not logged: then only the request id
is added. Nothing is done per token here. Finished requests are counted and logged in batches, every
``REPORT_DELAY`` seconds or ``REPORT_MAX`` requests (as nginx buffers its access log): the request's own path only
appends to a list, and one pass over many records keeps the logging and metrics code warm, which cuts what they
cost a gateway under load by three quarters (``benchmarks/telemetry.py``). A line's time is still its request's
end. ``flush()`` reports what is pending at once: ``/metrics`` calls it before a scrape and the app's lifespan when
it stops, so neither a scrape nor a stop misses a request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from http import HTTPStatus
from typing import Any

import msgspec

from meshgate.gateway.telemetry.logs import Fields, plain_handler
from meshgate.gateway.telemetry.metrics import GatewayMetrics
from meshgate.gateway.telemetry.record import RequestRecord, bind, new_request_id, unbind

__all__ = ["REPORT_DELAY", "REPORT_MAX", "RequestTelemetry", "protocol_of"]

log = logging.getLogger("meshgate.requests")

REPORT_DELAY = 0.5
"""Seconds a finished request waits at most before it is logged and counted (with the others finished by then).
Longer batches cost less per request (``benchmarks/telemetry.py``: +2.5% at 0.5 s, +5-7% at 0.05 s)."""

REPORT_MAX = 1024
"""Finished requests held at most: one more is reported at once with them (a bound on memory under load)."""

_PROBES = frozenset({"/", "/api/version", "/metrics"})
_ERROR_BODY = 16 << 10  # bytes of an error body kept to find its message
_CLUSTER = ("/cluster", "/instances", "/events", "/keys")
_OPENAI = ("/v1/", "/chat/completions", "/responses", "/embeddings", "/models")


def protocol_of(path: str, headers: list[tuple[bytes, bytes]]) -> str:
    """The API a path belongs to: ``openai``, ``anthropic``, ``ollama``, ``cluster`` or ``other``."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/api/") or path == "/":
        return "ollama"
    if path.startswith(_OPENAI):
        if path.startswith("/v1/models") and any(k == b"anthropic-version" for k, _ in headers):
            return "anthropic"  # the model listing Anthropic clients share
        return "openai"
    if path.startswith(_CLUSTER):
        return "cluster"
    return "other"


class RequestTelemetry:
    """Wraps ``app`` (an ASGI callable); ``state`` is the Litestar app's state (its ``plane`` once started)."""

    def __init__(self, app: Any, state: Any, metrics: GatewayMetrics | None, *, worker: int | None = None) -> None:
        self.app = app
        self.worker = worker  # ``serve --workers``: this process's index, a field of every request line
        self.state = state
        self.metrics = metrics
        self._finished: list[RequestRecord] = []
        self._timer: asyncio.TimerHandle | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = new_request_id()
        rid = header.encode()
        record = RequestRecord(header) if self.metrics is not None or log.isEnabledFor(logging.INFO) else None
        status = 0
        complete = False
        error_body = b""

        async def send_with_id(message: Any) -> None:
            nonlocal status, complete, error_body
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid), (b"request-id", rid)]
            elif message["type"] == "http.response.body":
                complete = not message.get("more_body", False)
                if status >= 400 and record is not None and len(error_body) < _ERROR_BODY:
                    error_body += message.get("body", b"")
            await send(message)

        if record is None:
            await self.app(scope, receive, send_with_id)
            return
        token = bind(record)
        try:
            await self.app(scope, receive, send_with_id)
        except BaseException as exc:
            if not status:
                status, record.error = 500, f"internal error: {type(exc).__name__}"
            raise
        finally:
            unbind(token)
            if status and not complete and not record.error:
                record.error = "the response was cut short (the client went away)"
            record.finished(scope, status or 499, error_body, protocol_of(scope["path"], scope["headers"]))
            self.add(record)

    def add(self, record: RequestRecord) -> None:
        """Report ``record``, finished (``RequestRecord.ended``), with the next batch of lines: a request's, or a
        batch line's (``gateway.batches.worker`` runs lines outside any HTTP request)."""
        self._finished.append(record)
        if len(self._finished) >= REPORT_MAX:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(REPORT_DELAY, self.flush)

    def flush(self) -> None:
        """Log and count every finished request not reported yet."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        finished, self._finished = self._finished, []
        handler = plain_handler(log, logging.INFO)  # the CLI's own output: the batch's lines in one write
        lines: list[str] = []
        wall = time.time() - time.perf_counter()  # a line's time is its request's end, not the batch's
        for record in finished:
            try:
                line = self._report(record)
                if line is None:
                    continue
                level, fields = line
                if handler is not None and level == logging.INFO:
                    lines.append(handler.line(wall + record.finished_at, "INFO", log.name, fields))
                else:  # logged as ``log.log`` would, without its search of the stack for the caller's line
                    entry = log.makeRecord(log.name, level, "", 0, fields, (), None)
                    entry.created = wall + record.finished_at
                    entry.msecs = int(entry.created * 1000) % 1000
                    log.handle(entry)
            except Exception:  # a request that cannot be reported must not lose the others' lines
                log.exception("could not report request %s", record.id)
        if handler is not None:
            handler.write_lines(lines)

    def _report(self, record: RequestRecord) -> tuple[int, Fields] | None:
        """Counts ``record`` in the metrics; its log line's level and fields, ``None`` if it is not logged."""
        path, method, status, protocol = record.path, record.method, record.status, record.protocol
        ended = record.finished_at
        model = self._model(record)
        if self.metrics is not None:
            self.metrics.observe(record, protocol, record.endpoint, model, str(status), ended)
        quiet = status < 400 and path in _PROBES and method in ("GET", "HEAD")
        level = logging.DEBUG if quiet else logging.INFO
        if not log.isEnabledFor(level):
            return None
        first = record.first_token_at
        fields: dict[str, str | int | None] = {
            "id": record.id,
            "protocol": protocol,
            "method": method,
            "path": path[:512],
            "model": (record.asked or "-")[:256] if model in ("-", "other") else model,
            "key": record.bucket.removeprefix("key:") if record.bucket.startswith(("key:", "boot:")) else None,
            "status": status,
            "prompt_tokens": record.prompt_tokens,
            "generated_tokens": record.generated_tokens,
            "ttft_ms": None if first is None else round((first - record.started) * 1000),
            "duration_ms": round((ended - record.started) * 1000),
            "instance": record.instance,
        }
        if self.worker is not None:
            fields["worker"] = self.worker
        if record.klass is not None:
            fields["class"] = record.klass
        if record.batch is not None:
            fields["batch"] = record.batch
        if record.resumes:
            fields["resumes"], fields["resume_wait_ms"] = record.resumes, round(record.resume_wait * 1000)
        if record.cached_tokens:
            fields["cached_tokens"] = record.cached_tokens
        if record.cache_note:
            fields["kv"] = record.cache_note[:512]
        error = _reason(record.error_body, status) if status >= 400 else record.error
        if error:
            fields["error"] = error[:1024]
        return level, Fields("request", fields)

    def _model(self, record: RequestRecord) -> str:
        """The ``model`` label: the catalog model that served or was asked for, ``other``, or ``-`` (none)."""
        if record.model is not None:
            return record.model
        if record.asked is None:
            return "-"
        catalog = getattr(getattr(self.state, "plane", None), "catalog", None)
        try:
            return catalog.resolve(record.asked).name if catalog is not None else "other"
        except Exception:  # UnknownModel: a name the catalog lacks
            return "other"


def _reason(body: bytes, status: int) -> str:
    """The message an error response gave its client (each protocol's envelope), else the status' phrase."""
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        decoded = None
    if isinstance(decoded, dict):
        error = decoded.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]  # OpenAI, Anthropic
        if isinstance(error, str):
            return error  # Ollama, the agent
        if isinstance(decoded.get("detail"), str):
            return decoded["detail"]  # Litestar's own
    text = body.decode("utf-8", "replace").strip()
    if text and decoded is None:
        return text
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return f"status {status}"
