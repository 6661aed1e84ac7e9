"""Making, cancelling and ending batch jobs: every change of a job's record is a compare-and-set on what was read
(``BatchStore.update_job``), so two gateways deciding at once cannot both apply a change; the loser reads again.

    create_job(...)   the lines checked (``lines.check``), bad ones answered at once; status ``validating``
    start(job)        validating -> in_progress (the first worker that sees it)
    cancel(job)       validating | in_progress -> cancelling; the workers drain what has not started
    finalize(job)     in_progress | cancelling -> finalizing -> completed | cancelled | expired, with the output
                      and error files (OpenAI) written from the results; a gateway that dies in ``finalizing`` is
                      replaced: any worker redoes a finalization older than ``STALE_FINALIZING`` seconds

Imports the batch store, the views and ``lines``.
"""

from __future__ import annotations

import secrets
import time
from typing import Literal

import msgspec

from meshgate.gateway.batches import lines as batch_lines
from meshgate.gateway.batches.views import openai_output_files
from meshgate.gateway.cluster.batch_store import BatchStore, FileRecord, Job, LineResult
from meshgate.protocols.model import InvalidRequest

__all__ = ["WINDOW", "cancel", "create_job", "finalize", "new_id", "start"]

WINDOW = 24 * 3600.0
"""A batch's completion window (``24h``, the only one either API offers)."""
STALE_FINALIZING = 60.0
"""Seconds after which a job still ``finalizing`` is finalized again by any gateway (its finalizer died)."""


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


async def create_job(
    store: BatchStore,
    *,
    api: Literal["openai", "anthropic"],
    endpoint: str,
    lines: list[bytes],
    owner: str,
    models: tuple[str, ...],
    tenant: str,
    weight: float,
    input_file_id: str = "",
    metadata: dict[str, str] | None = None,
) -> Job:
    """A new job over ``lines`` (stored ``Line`` JSON); each line is checked as its endpoint would check it, and one
    it would refuse is answered now with that error (it fails alone)."""
    now = time.time()
    checked = [batch_lines.check(endpoint, i, line) for i, line in enumerate(lines)]
    done = [r for r in checked if r is not None]
    job = Job(
        id=new_id("msgbatch_" if api == "anthropic" else "batch_"),
        api=api,
        endpoint=endpoint,
        status="validating",
        created_at=now,
        expires_at=now + WINDOW,
        total=len(lines),
        input_file_id=input_file_id,
        metadata=metadata,
        model=next((m for m in map(batch_lines.model_of, lines) if m), None),
        owner=owner,
        models=models,
        tenant=tenant,
        weight=weight,
    )
    await store.create_job(job, lines, done)
    return job


async def start(store: BatchStore, job: Job) -> bool:
    """validating -> in_progress; False if another gateway changed it first."""
    return await store.update_job(msgspec.structs.replace(job, status="in_progress", in_progress_at=time.time()))


async def cancel(store: BatchStore, job_id: str) -> Job | None:
    """Ask for ``job_id`` to stop: ``cancelling`` (lines not started are cancelled by the workers, running ones
    finish); a job that already ended is returned as it is. None: no such job."""
    for _ in range(10):
        job = await store.get_job(job_id)
        if job is None or job.status not in ("validating", "in_progress"):
            return job
        cancelling = msgspec.structs.replace(job, status="cancelling", cancelling_at=time.time())
        if await store.update_job(cancelling):
            return msgspec.structs.replace(cancelling, epoch=job.epoch + 1)
    raise InvalidRequest("the batch is changing too fast to cancel; retry")


_ENDS = {"in_progress": "completed", "cancelling": "cancelled"}


async def finalize(store: BatchStore, job: Job, *, expired: bool = False) -> bool:
    """End ``job`` (every line is done): ``finalizing``, the files, then its last status. False if another gateway
    changed the job first (it finalizes it, or did)."""
    stale = job.status == "finalizing" and time.time() - (job.finalizing_at or 0) > STALE_FINALIZING
    if job.status == "finalizing" and not stale:
        return False
    end = "expired" if expired else _ENDS.get(job.status, "completed")
    if stale:  # what the finalizer that died was ending it as
        end = "expired" if job.expired_at else ("cancelled" if job.cancelling_at else "completed")
    finalizing = msgspec.structs.replace(job, status="finalizing", finalizing_at=time.time())
    if expired:
        finalizing = msgspec.structs.replace(finalizing, expired_at=time.time())
    if not stale and not await store.update_job(finalizing):
        return False
    if not stale:
        finalizing = msgspec.structs.replace(finalizing, epoch=job.epoch + 1)
    output_id = error_id = None
    if job.api == "openai":
        output_id, error_id = await _write_files(store, finalizing, await store.results(job.id))
    now = time.time()
    times = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at", "failed": "failed_at"}
    ended = msgspec.structs.replace(
        finalizing, status=end, output_file_id=output_id, error_file_id=error_id, **{times[end]: now}
    )
    return await store.update_job(ended)


async def _write_files(store: BatchStore, job: Job, results: list[LineResult]) -> tuple[str | None, str | None]:
    """The output and error files of ``job`` (ids made from the job's, so a second finalizer writes the same)."""
    output, errors = openai_output_files(results)
    ids: list[str | None] = []
    for suffix, content in (("output", output), ("errors", errors)):
        if not content:
            ids.append(None)
            continue
        file_id = f"file-{job.id.removeprefix('batch_')}-{suffix}"
        record = FileRecord(
            id=file_id,
            bytes=len(content),
            created_at=int(time.time()),
            filename=f"{job.id}_{suffix}.jsonl",
            purpose="batch_output",
            owner=job.owner,
        )
        await store.put_file(record, content)
        ids.append(file_id)
    return ids[0], ids[1]
