"""Batch jobs in the state store: uploaded files, jobs, and each job's lines claimed once by whichever gateway runs
them (``BatchStore``; ``MemoryBatchStore`` here, ``redis_batches.RedisBatchStore`` shared by several gateways).

A job (``Job``) is a record written only by compare-and-set on its ``epoch`` (``update_job``), so two gateways
that both decide to finalize or cancel it cannot both win. Its lines live beside it: each line's body (what to
run), a queue of lines not yet claimed, the claims, and the results. A line moves one way::

    pending --claim(holder, lease)--> claimed --finish(holder, result)--> done
                 ^                       |
                 +--- requeue_expired ---+   (the lease ran out: its gateway died or stalled)

``claim`` takes the next pending line for ``lease`` seconds; the holder ``renew``s it while the line runs.
``finish`` writes the result only while the holder still has the claim and no result exists, in one atomic step:
a line is answered at most once even when a slow gateway's lease expired and another gateway ran it again (the
slow one's late result is refused). ``requeue_expired`` puts lines whose lease ran out back in the queue (never a
finished line). ``drain`` ends every pending line with an outcome (``canceled`` on cancel, ``expired`` past the
completion window) without running it. Leases are timed by the store's clock (Redis ``TIME``; here the monotonic
clock), so gateways whose clocks differ agree on when a lease ran out.

Why the state store and not a directory: several gateways share the work, and each must read every job's bodies
and write its results; a directory is shared only on one machine. Bodies are bounded (``Settings.batch_max_bytes``)
so they stay a small part of what Redis holds. With the embedded memory store (one gateway, no Redis) jobs live in
the gateway's memory and end with it, as every other piece of cluster state there does.

Imports msgspec only; nothing imports this but the gateway.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Literal, Protocol, runtime_checkable

import msgspec

__all__ = [
    "ACTIVE",
    "BatchStore",
    "FileRecord",
    "Job",
    "JobError",
    "LineResult",
    "MemoryBatchStore",
    "Outcome",
    "Progress",
    "Status",
]

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]
"""A job's status, in OpenAI's words (Anthropic's ``processing_status`` is read from it)."""
ACTIVE: frozenset[str] = frozenset({"validating", "in_progress", "finalizing", "cancelling"})
"""The statuses of jobs the workers still have something to do for."""
Outcome = Literal["succeeded", "errored", "canceled", "expired"]


class FileRecord(msgspec.Struct, frozen=True, kw_only=True):
    """An uploaded (or generated) file: OpenAI's ``FileObject`` fields and whose it is (``owner``, ``""``: anyone's)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    expires_at: int | None = None
    owner: str = ""


class JobError(msgspec.Struct, frozen=True, kw_only=True):
    """Why a job failed as a whole (OpenAI's ``BatchError``)."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """A batch job: what it runs (``api``, ``endpoint``), its times (unix seconds), its files and who it runs for
    (``owner``: a key's bucket; ``models``, ``tenant``, ``weight``: what that key may use and its share)."""

    id: str
    api: Literal["openai", "anthropic"]
    endpoint: str
    status: Status
    created_at: float
    expires_at: float
    total: int
    input_file_id: str = ""
    completion_window: str = "24h"
    in_progress_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: tuple[JobError, ...] = ()
    metadata: dict[str, str] | None = None
    model: str | None = None
    owner: str = ""
    models: tuple[str, ...] = ()
    tenant: str = ""
    weight: float = 1.0
    epoch: int = 0


class LineResult(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What became of one line: its HTTP ``status`` and response ``body`` (JSON) when it ran or was refused."""

    index: int
    custom_id: str
    outcome: Outcome
    status: int = 0
    request_id: str = ""
    body: msgspec.Raw = msgspec.Raw(b"null")  # ``null``: a line that never ran


class Progress(msgspec.Struct, frozen=True):
    """A job's lines now: waiting, claimed (running somewhere), and done by outcome."""

    pending: int = 0
    claimed: int = 0
    done: dict[str, int] = msgspec.field(default_factory=dict)

    def count(self, outcome: Outcome) -> int:
        return self.done.get(outcome, 0)


encode = msgspec.json.Encoder().encode
job_json = msgspec.json.Decoder(Job)
file_json = msgspec.json.Decoder(FileRecord)
result_json = msgspec.json.Decoder(LineResult)


@runtime_checkable
class BatchStore(Protocol):
    """Files, jobs and their lines, shared by every gateway (the module docstring). Every method is safe to call
    concurrently. ``lines`` are the bodies to run, in order (index = position)."""

    async def put_file(self, record: FileRecord, content: bytes) -> None: ...
    async def get_file(self, file_id: str) -> FileRecord | None: ...
    async def file_content(self, file_id: str) -> bytes | None: ...
    async def files(self) -> list[FileRecord]:
        """Every file, oldest first."""
        ...

    async def delete_file(self, file_id: str) -> bool: ...
    async def create_job(self, job: Job, lines: list[bytes], done: list[LineResult]) -> None:
        """Store a new job, its lines, and the results of lines that failed before running (``done``); every other
        line is pending."""
        ...

    async def get_job(self, job_id: str) -> Job | None: ...
    async def jobs(self) -> list[Job]:
        """Every job, oldest first."""
        ...

    async def active(self) -> list[str]:
        """Ids of the jobs whose status is in ``ACTIVE``."""
        ...

    async def update_job(self, job: Job) -> bool:
        """Write ``job`` if the stored one's epoch is ``job.epoch`` (what the writer read); the stored record's
        epoch is then one more. False, and nothing written, otherwise."""
        ...

    async def delete_job(self, job_id: str) -> bool:
        """Forget a job and its lines."""
        ...

    async def claim(self, job_id: str, holder: str, lease: float) -> tuple[int, bytes] | None:
        """The next pending line (index, body), now claimed by ``holder`` for ``lease`` seconds; None if none."""
        ...

    async def renew(self, job_id: str, index: int, holder: str, lease: float) -> bool:
        """Extend ``holder``'s claim on a line; False if it no longer holds it."""
        ...

    async def release(self, job_id: str, index: int, holder: str) -> bool:
        """Give a claimed, unfinished line back to the queue (a gateway stopping)."""
        ...

    async def finish(self, job_id: str, result: LineResult, holder: str) -> bool:
        """Write ``result`` if ``holder`` still holds the line's claim and it has no result; the claim ends."""
        ...

    async def requeue_expired(self, job_id: str) -> int:
        """Claims whose lease ran out (and whose line has no result) go back to the queue: how many."""
        ...

    async def drain(self, job_id: str, outcome: Outcome) -> int:
        """End every pending line with ``outcome`` without running it: how many."""
        ...

    async def progress(self, job_id: str) -> Progress: ...
    async def results(self, job_id: str) -> list[LineResult]:
        """Every result so far, by line index."""
        ...

    async def close(self) -> None: ...


class _Lines:
    """One job's lines in memory."""

    def __init__(self, lines: list[bytes], done: list[LineResult]) -> None:
        self.bodies = lines
        self.results: dict[int, bytes] = {r.index: encode(r) for r in done}
        self.pending: deque[int] = deque(i for i in range(len(lines)) if i not in self.results)
        self.claims: dict[int, tuple[str, float]] = {}  # index -> (holder, monotonic deadline)
        self.counts: dict[str, int] = {}
        for r in done:
            self.counts[r.outcome] = self.counts.get(r.outcome, 0) + 1


class MemoryBatchStore:
    """The embedded store's batches: one process, no Redis (the module docstring)."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[bytes, bytes]] = {}  # id -> (record JSON, content)
        self._jobs: dict[str, bytes] = {}
        self._lines: dict[str, _Lines] = {}

    async def put_file(self, record: FileRecord, content: bytes) -> None:
        self._files[record.id] = (encode(record), content)

    async def get_file(self, file_id: str) -> FileRecord | None:
        found = self._files.get(file_id)
        return file_json.decode(found[0]) if found else None

    async def file_content(self, file_id: str) -> bytes | None:
        found = self._files.get(file_id)
        return found[1] if found else None

    async def files(self) -> list[FileRecord]:
        return sorted((file_json.decode(r) for r, _ in self._files.values()), key=lambda f: (f.created_at, f.id))

    async def delete_file(self, file_id: str) -> bool:
        return self._files.pop(file_id, None) is not None

    async def create_job(self, job: Job, lines: list[bytes], done: list[LineResult]) -> None:
        self._jobs[job.id] = encode(job)
        self._lines[job.id] = _Lines(lines, done)

    async def get_job(self, job_id: str) -> Job | None:
        raw = self._jobs.get(job_id)
        return job_json.decode(raw) if raw else None

    async def jobs(self) -> list[Job]:
        return sorted((job_json.decode(r) for r in self._jobs.values()), key=lambda j: (j.created_at, j.id))

    async def active(self) -> list[str]:
        return [j.id for j in await self.jobs() if j.status in ACTIVE]

    async def update_job(self, job: Job) -> bool:
        current = await self.get_job(job.id)
        if current is None or current.epoch != job.epoch:
            return False
        self._jobs[job.id] = encode(msgspec.structs.replace(job, epoch=job.epoch + 1))
        return True

    async def delete_job(self, job_id: str) -> bool:
        self._lines.pop(job_id, None)
        return self._jobs.pop(job_id, None) is not None

    async def claim(self, job_id: str, holder: str, lease: float) -> tuple[int, bytes] | None:
        lines = self._lines.get(job_id)
        if lines is None or not lines.pending:
            return None
        index = lines.pending.popleft()
        lines.claims[index] = (holder, time.monotonic() + lease)
        return index, lines.bodies[index]

    async def renew(self, job_id: str, index: int, holder: str, lease: float) -> bool:
        lines = self._lines.get(job_id)
        if lines is None or lines.claims.get(index, ("", 0.0))[0] != holder:
            return False
        lines.claims[index] = (holder, time.monotonic() + lease)
        return True

    async def release(self, job_id: str, index: int, holder: str) -> bool:
        lines = self._lines.get(job_id)
        if lines is None or lines.claims.get(index, ("", 0.0))[0] != holder or index in lines.results:
            return False
        del lines.claims[index]
        lines.pending.appendleft(index)
        return True

    async def finish(self, job_id: str, result: LineResult, holder: str) -> bool:
        lines = self._lines.get(job_id)
        index = result.index
        if lines is None or index in lines.results or lines.claims.get(index, ("", 0.0))[0] != holder:
            return False
        del lines.claims[index]
        lines.results[index] = encode(result)
        lines.counts[result.outcome] = lines.counts.get(result.outcome, 0) + 1
        return True

    async def requeue_expired(self, job_id: str) -> int:
        lines = self._lines.get(job_id)
        if lines is None:
            return 0
        now = time.monotonic()
        lapsed = [i for i, (_, deadline) in lines.claims.items() if deadline <= now and i not in lines.results]
        for index in lapsed:
            del lines.claims[index]
            lines.pending.appendleft(index)
        return len(lapsed)

    async def drain(self, job_id: str, outcome: Outcome) -> int:
        lines = self._lines.get(job_id)
        if lines is None:
            return 0
        drained = 0
        while lines.pending:
            index = lines.pending.popleft()
            if index not in lines.results:
                custom_id = msgspec.json.decode(lines.bodies[index]).get("custom_id", "")
                lines.results[index] = encode(LineResult(index=index, custom_id=custom_id, outcome=outcome))
                lines.counts[outcome] = lines.counts.get(outcome, 0) + 1
                drained += 1
        return drained

    async def progress(self, job_id: str) -> Progress:
        lines = self._lines.get(job_id)
        if lines is None:
            return Progress()
        return Progress(pending=len(lines.pending), claimed=len(lines.claims), done=dict(lines.counts))

    async def results(self, job_id: str) -> list[LineResult]:
        lines = self._lines.get(job_id)
        if lines is None:
            return []
        return [result_json.decode(lines.results[i]) for i in sorted(lines.results)]

    async def close(self) -> None:
        return None
