"""The batch store's contract, on ``MemoryBatchStore`` and on ``RedisBatchStore`` (a real ``redis-server``): a line
is claimed once, a result is written only under its claim and only once, expired leases are requeued, cancel
drains; and a gateway's worker answers exactly once a line claimed by a gateway that died."""

from __future__ import annotations

import asyncio
import uuid

import msgspec
import pytest

from meshgate.gateway.batches import jobs
from meshgate.gateway.cluster.batch_store import BatchStore, Job, LineResult, MemoryBatchStore
from meshgate.gateway.cluster.redis_batches import RedisBatchStore
from meshgate.gateway.http.runtime import control_plane
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from tests import scripted_plugin


@pytest.fixture
async def batches(store_kind: str, prefix: str, request: pytest.FixtureRequest):
    if store_kind == "memory":
        s: BatchStore = MemoryBatchStore()
    else:
        s = RedisBatchStore(request.getfixturevalue("redis_server").url, prefix=prefix)
    yield s
    await s.close()


def _lines(n: int) -> list[bytes]:
    return [msgspec.json.encode({"custom_id": f"c{i}", "body": {"model": "scripted"}}) for i in range(n)]


def _job(total: int) -> Job:
    return Job(
        id=f"batch_{uuid.uuid4().hex[:8]}",
        api="openai",
        endpoint="/v1/chat/completions",
        status="in_progress",
        created_at=1.0,
        expires_at=2.0,
        total=total,
    )


def _result(index: int) -> LineResult:
    return LineResult(index=index, custom_id=f"c{index}", outcome="succeeded", status=200, body=msgspec.Raw(b"{}"))


async def test_lines_are_claimed_once_and_answered_once(batches):
    job = _job(3)
    bad = LineResult(index=2, custom_id="c2", outcome="errored", status=400, body=msgspec.Raw(b'{"e":1}'))
    await batches.create_job(job, _lines(3), [bad])
    assert await batches.active() == [job.id]
    first, second = await batches.claim(job.id, "a", 30), await batches.claim(job.id, "b", 30)
    assert (first[0], second[0]) == (0, 1) and await batches.claim(job.id, "c", 30) is None
    assert msgspec.json.decode(first[1])["custom_id"] == "c0"
    assert not await batches.finish(job.id, _result(0), "b"), "only the holder writes"
    assert await batches.finish(job.id, _result(0), "a")
    assert not await batches.finish(job.id, _result(0), "a"), "a finished line is never written again"
    assert not await batches.renew(job.id, 1, "a", 30) and await batches.renew(job.id, 1, "b", 30)
    progress = await batches.progress(job.id)
    assert (progress.pending, progress.claimed, progress.done) == (0, 1, {"succeeded": 1, "errored": 1})
    assert [r.index for r in await batches.results(job.id)] == [0, 2]
    assert bytes((await batches.results(job.id))[1].body) == b'{"e":1}'


async def test_an_expired_claim_is_run_again_and_the_late_result_refused(batches):
    job = _job(2)
    await batches.create_job(job, _lines(2), [])
    await batches.claim(job.id, "dead", 0.2)
    await asyncio.sleep(0.3)
    assert await batches.requeue_expired(job.id) == 1
    index, _ = await batches.claim(job.id, "alive", 30)
    assert index == 0
    assert not await batches.finish(job.id, _result(0), "dead"), "the stalled gateway's late answer is dropped"
    assert await batches.finish(job.id, _result(0), "alive")
    assert await batches.requeue_expired(job.id) == 0


async def test_drain_ends_the_pending_lines_and_a_job_changes_only_from_what_was_read(batches):
    job = _job(3)
    await batches.create_job(job, _lines(3), [])
    await batches.claim(job.id, "a", 30)
    assert await batches.drain(job.id, "canceled") == 2
    assert [(r.custom_id, r.outcome) for r in await batches.results(job.id)] == [("c1", "canceled"), ("c2", "canceled")]
    stored = await batches.get_job(job.id)
    assert await batches.update_job(msgspec.structs.replace(stored, status="cancelling"))
    assert not await batches.update_job(msgspec.structs.replace(stored, status="completed")), "a stale write fails"
    assert (await batches.get_job(job.id)).status == "cancelling"
    ended = await batches.get_job(job.id)
    assert await batches.update_job(msgspec.structs.replace(ended, status="cancelled"))
    assert await batches.active() == []
    assert await batches.delete_job(job.id) and await batches.get_job(job.id) is None


async def test_a_line_claimed_by_a_gateway_that_died_is_answered_exactly_once(redis_server, tmp_path):
    """A real Redis; a "dead" gateway claimed line 0 and never finished. This gateway's worker runs the others, then
    line 0 once its lease ran out; the dead gateway's late result is refused."""
    settings = Settings(
        data_dir=str(tmp_path),
        disabled_plugins=("llama_cpp", "mlx", "vllm"),
        agent_port=0,
        redis=redis_server.url,
        batch_lease=0.6,
    )
    dead = RedisBatchStore(redis_server.url)
    lines = [
        msgspec.json.encode(
            {"custom_id": f"c{i}", "body": {"model": "scripted", "messages": [{"role": "user", "content": "hello"}]}}
        )
        for i in range(3)
    ]
    job = await jobs.create_job(
        dead, api="openai", endpoint="/v1/chat/completions", lines=lines, owner="", models=(), tenant="", weight=1
    )
    assert (await dead.claim(job.id, "dead-gateway", 0.6))[0] == 0
    async with control_plane(
        settings, build_plugin_manager(settings, extra=[scripted_plugin]), gateway=True, agent=True
    ) as plane:
        assert plane.batches is not None and plane.batch_worker is not None
        for _ in range(400):
            found = await plane.batches.get_job(job.id)
            if found is not None and found.status == "completed":
                break
            await asyncio.sleep(0.05)
        assert found.status == "completed"
        results = await plane.batches.results(job.id)
    assert [(r.custom_id, r.outcome) for r in results] == [
        ("c0", "succeeded"),
        ("c1", "succeeded"),
        ("c2", "succeeded"),
    ]
    assert not await dead.finish(job.id, _result(0), "dead-gateway")
    assert len(await dead.results(job.id)) == 3
    await dead.close()
