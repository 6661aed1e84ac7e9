"""Batch jobs and files as the two protocols show them, from the stored records (``cluster.batch_store``).

OpenAI (``openai: types/batch.py``, ``file_object.py``): a ``batch`` object with ``status``, ``request_counts``
(``completed`` lines that succeeded, ``failed`` lines that errored), unix-second times, the output and error file
ids; output and error files in OpenAI's line format::

    {"id": "batch_req_...", "custom_id": "...", "response": {"status_code", "request_id", "body"}, "error": null}

where a line that was never run (expired, cancelled) has ``"response": null`` and an ``error`` with a ``code``.

Anthropic (``anthropic: types/messages/message_batch*.py``): a ``message_batch`` with ``processing_status``
(``in_progress``, ``canceling``, ``ended``), ``request_counts`` (every line ``processing`` until the batch ends, as
the API counts them), RFC 3339 times, a ``results_url`` once it ended; results as JSONL of
``{"custom_id", "result": {"type": "succeeded", "message"} | {"type": "errored", "error"} | {"type": "canceled"} |
{"type": "expired"}}``.

Pure functions of records; no I/O.
"""

from __future__ import annotations

import datetime
from typing import Any

import msgspec

from meshgate.gateway.cluster.batch_store import FileRecord, Job, LineResult, Progress

__all__ = ["anthropic_batch", "anthropic_results", "openai_batch", "openai_file", "openai_output_files", "page"]

_encode = msgspec.json.Encoder().encode


def _secs(at: float | None) -> int | None:
    return None if at is None else int(at)


def openai_file(record: FileRecord) -> dict[str, Any]:
    return {
        "id": record.id,
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "filename": record.filename,
        "purpose": record.purpose,
        "status": "processed",
        "expires_at": record.expires_at,
        "status_details": None,
    }


def openai_batch(job: Job, progress: Progress) -> dict[str, Any]:
    errors = None
    if job.errors:
        data = [{"code": e.code, "message": e.message, "line": e.line, "param": e.param} for e in job.errors]
        errors = {"object": "list", "data": data}
    return {
        "id": job.id,
        "object": "batch",
        "endpoint": job.endpoint,
        "model": job.model,
        "errors": errors,
        "input_file_id": job.input_file_id,
        "completion_window": job.completion_window,
        "status": job.status,
        "output_file_id": job.output_file_id,
        "error_file_id": job.error_file_id,
        "created_at": int(job.created_at),
        "in_progress_at": _secs(job.in_progress_at),
        "expires_at": int(job.expires_at),
        "finalizing_at": _secs(job.finalizing_at),
        "completed_at": _secs(job.completed_at),
        "failed_at": _secs(job.failed_at),
        "expired_at": _secs(job.expired_at),
        "cancelling_at": _secs(job.cancelling_at),
        "cancelled_at": _secs(job.cancelled_at),
        "request_counts": {
            "total": job.total,
            "completed": progress.count("succeeded"),
            "failed": progress.count("errored"),
        },
        "metadata": job.metadata,
    }


_NOT_RUN = {
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
    "canceled": ("batch_cancelled", "This request was not executed because the batch was cancelled."),
}


def _openai_line(result: LineResult) -> bytes:
    line: dict[str, Any] = {"id": f"batch_req_{result.request_id or result.index}", "custom_id": result.custom_id}
    if result.outcome in _NOT_RUN:
        code, message = _NOT_RUN[result.outcome]
        line.update(response=None, error={"code": code, "message": message})
    else:
        response = {"status_code": result.status, "request_id": result.request_id, "body": result.body}
        line.update(response=response, error=None)
    return _encode(line) + b"\n"


def openai_output_files(results: list[LineResult]) -> tuple[bytes, bytes]:
    """The output file (lines that succeeded) and the error file (every other line), JSONL, in line order."""
    output = b"".join(_openai_line(r) for r in results if r.outcome == "succeeded")
    errors = b"".join(_openai_line(r) for r in results if r.outcome != "succeeded")
    return output, errors


def _rfc3339(at: float | None) -> str | None:
    if at is None:
        return None
    return datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat().replace("+00:00", "Z")


def anthropic_status(job: Job) -> str:
    if job.status == "cancelling":
        return "canceling"
    return "in_progress" if job.status in ("validating", "in_progress", "finalizing") else "ended"


def anthropic_batch(job: Job, progress: Progress, base_url: str) -> dict[str, Any]:
    status = anthropic_status(job)
    ended = status == "ended"
    counts = {outcome: progress.count(outcome) if ended else 0 for outcome in ("succeeded", "errored", "expired")}
    counts["canceled"] = progress.count("canceled") if ended else 0
    counts["processing"] = job.total - sum(counts.values())
    ended_at = job.completed_at or job.cancelled_at or job.expired_at or job.failed_at
    return {
        "id": job.id,
        "type": "message_batch",
        "processing_status": status,
        "request_counts": counts,
        "ended_at": _rfc3339(ended_at) if ended else None,
        "created_at": _rfc3339(job.created_at),
        "expires_at": _rfc3339(job.expires_at),
        "archived_at": None,
        "cancel_initiated_at": _rfc3339(job.cancelling_at),
        "results_url": f"{base_url.rstrip('/')}/v1/messages/batches/{job.id}/results" if ended else None,
    }


def anthropic_results(results: list[LineResult]) -> bytes:
    """The results JSONL: one ``MessageBatchIndividualResponse`` per line, in line order."""
    lines = []
    for r in results:
        result: dict[str, Any]
        if r.outcome == "succeeded":
            result = {"type": "succeeded", "message": r.body}
        elif r.outcome == "errored":
            result = {"type": "errored", "error": r.body}
        else:
            result = {"type": r.outcome}
        lines.append(_encode({"custom_id": r.custom_id, "result": result}) + b"\n")
    return b"".join(lines)


def page(items: list[Any], ids: list[str], *, after: str | None, before: str | None, limit: int) -> tuple[list, bool]:
    """``items`` (newest first, ``ids`` alike) after the id ``after`` or before the id ``before``, at most
    ``limit``, and whether more remain in that direction."""
    if after is not None:
        start = ids.index(after) + 1 if after in ids else len(ids)
        chosen = items[start : start + limit]
        return chosen, start + limit < len(items)
    if before is not None:
        end = ids.index(before) if before in ids else 0
        chosen = items[max(0, end - limit) : end]
        return chosen, end - limit > 0
    return items[:limit], len(items) > limit
