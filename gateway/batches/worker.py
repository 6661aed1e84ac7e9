"""A gateway's batch worker: one task that pulls lines of every active job from the state store and runs at most
``concurrency`` at once, each at the batch class through the dispatcher (``lines.run``).

Every ``POLL`` seconds (or at once when this gateway made a job: ``wake``) it goes over the active jobs:

    validating          -> in_progress (``jobs.start``)
    in_progress         lines whose lease ran out go back to the queue; past the completion window the lines not
                        started expire; free capacity claims lines; nothing pending or running: finalize
    cancelling          lines not started are cancelled; once none runs: finalize
    finalizing          redone if its finalizer died (``jobs.STALE_FINALIZING``)

A running line's claim is renewed every third of ``lease``; its result is written only while the claim is still
this gateway's (``BatchStore.finish``), so a line that another gateway took over after a stall is answered once. A
full queue (``Overloaded``) is not the line's fault: it is tried again after a pause, its claim kept. When the
gateway stops, its running lines are cancelled and their claims given back, so another gateway takes them at once
rather than after their lease. With ``report`` set (the app sets its request telemetry's ``add``), every line
answered is logged and counted in ``/metrics`` as a request of its endpoint at the batch class.

Imports the batch store, ``jobs`` and ``lines``, and the dispatcher's type.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

from meshgate.gateway.batches import jobs
from meshgate.gateway.batches import lines as batch_lines
from meshgate.gateway.cluster.batch_store import BatchStore, Job
from meshgate.gateway.serving.dispatch import Dispatcher
from meshgate.gateway.telemetry.record import RequestRecord
from meshgate.protocols.model import Overloaded, StoreUnavailable

__all__ = ["POLL", "BatchWorker"]

log = logging.getLogger("meshgate.batches")

POLL = 0.5
"""Seconds between a worker's passes over the active jobs."""
BUSY_PAUSE = 1.0
"""Seconds a line refused by a full queue waits before it is tried again."""


class BatchWorker:
    """Runs batch lines for one gateway (module docstring); ``holder`` names its claims."""

    def __init__(self, store: BatchStore, dispatcher: Dispatcher, *, concurrency: int = 4, lease: float = 30.0) -> None:
        self.store = store
        self.dispatcher = dispatcher
        self.concurrency = max(1, concurrency)
        self.lease = lease
        self.holder = f"gw-{secrets.token_hex(6)}"
        self.running: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.report: Callable[[RequestRecord], None] | None = None  # the request telemetry's ``add``: lines logged

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch-worker")

    def wake(self) -> None:
        """Look at the jobs now (a job was made or cancelled here)."""
        self._wake.set()

    async def close(self) -> None:
        """Stop: running lines are cancelled and their claims given back."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        tasks = list(self.running.items())
        for _, task in tasks:
            task.cancel()
        for (job_id, index), task in tasks:
            with contextlib.suppress(BaseException):
                await task
            with contextlib.suppress(Exception):
                await self.store.release(job_id, index, self.holder)

    async def _loop(self) -> None:
        while True:
            try:
                await self.step()
            except StoreUnavailable:
                pass  # the store is away: the next pass tries again
            except Exception:
                log.exception("batch worker pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL)
            self._wake.clear()

    async def step(self) -> None:
        """One pass over the active jobs (module docstring)."""
        for job_id in await self.store.active():
            job = await self.store.get_job(job_id)
            if job is not None:
                await self._advance(job)

    async def _advance(self, job: Job) -> None:
        store = self.store
        if job.status == "validating":
            if not await jobs.start(store, job):
                return
            job = await store.get_job(job.id) or job
        if job.status == "finalizing":
            await jobs.finalize(store, job)
            return
        await store.requeue_expired(job.id)
        expired = job.status == "in_progress" and time.time() >= job.expires_at
        if job.status == "cancelling" or expired:
            await store.drain(job.id, "expired" if expired else "canceled")
        elif job.status == "in_progress":
            while len(self.running) < self.concurrency:
                claimed = await store.claim(job.id, self.holder, self.lease)
                if claimed is None:
                    break
                index, line = claimed
                task = asyncio.create_task(self._run(job, index, line), name=f"batch-line-{job.id}-{index}")
                self.running[(job.id, index)] = task
        progress = await store.progress(job.id)
        if not progress.pending and not progress.claimed:
            await jobs.finalize(store, job, expired=expired)

    async def _run(self, job: Job, index: int, line: bytes) -> None:
        renewing = asyncio.create_task(self._renew(job.id, index))
        try:
            while True:
                try:
                    result = await batch_lines.run(self.dispatcher, job, index, line, self.report)
                    break
                except Overloaded:
                    await asyncio.sleep(BUSY_PAUSE)
            if not await self.store.finish(job.id, result, self.holder):
                log.info("batch %s line %d: another gateway answered it first; this result is dropped", job.id, index)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s line %d failed to run; it is given back", job.id, index)
            with contextlib.suppress(Exception):
                await self.store.release(job.id, index, self.holder)
        finally:
            renewing.cancel()
            self.running.pop((job.id, index), None)
            self._wake.set()

    async def _renew(self, job_id: str, index: int) -> None:
        while True:
            await asyncio.sleep(self.lease / 3)
            with contextlib.suppress(StoreUnavailable):
                if not await self.store.renew(job_id, index, self.holder, self.lease):
                    return
