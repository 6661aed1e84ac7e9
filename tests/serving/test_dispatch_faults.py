"""The dispatcher's resumes under load, in-process (scripted backend, memory store, the embedded agent): a busy
replica is never failed as if dead, and a resume never queues behind the ticket of the stream it continues.

``breaks once`` (tests/scripted_plugin.py) sends one token, then its replica is lost (``BackendUnavailable``); the
resume (``Request.resume`` set) sends that token again and a second, and finishes.
"""

from __future__ import annotations

import asyncio
import time

from meshgate.gateway.http.runtime import control_plane
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from meshgate.protocols.model import Failed, Finished, Message, Request, TextDelta, TextPart
from tests import scripted_plugin


def _request(text: str) -> Request:
    return Request(model="scripted", messages=(Message(role="user", parts=(TextPart(text=text),)),), stream=True)


async def _plane(tmp_path, **overrides):
    settings = Settings(
        data_dir=str(tmp_path),
        disabled_plugins=("llama_cpp", "mlx", "vllm"),
        parallel=1,
        agent_port=0,
        **overrides,
    )
    return control_plane(settings, build_plugin_manager(settings, extra=[scripted_plugin]), gateway=True, agent=True)


async def _read(opening) -> tuple[str, list]:
    events = [e async for e in await opening]
    return "".join(e.text for e in events if isinstance(e, TextDelta)), events


async def test_a_resume_on_the_same_replica_does_not_wait_behind_its_own_ticket(tmp_path):
    """One replica, one slot: the lost stream's ticket is released before its resume takes one, so the resume
    runs on the re-placed replica at once instead of queueing behind itself until ``resume_wait``."""
    async with await _plane(tmp_path, max_queue=4, resume_wait=8.0) as plane:
        began = time.monotonic()
        text, events = await asyncio.wait_for(_read(plane.dispatcher.open_stream(_request("breaks once"))), 30)
        assert text == "first second" and isinstance(events[-1], Finished), events
        assert time.monotonic() - began < 6.0  # the phantom ticket made it wait all 8 s, then fail
        (instance,) = await plane.store.instances()
        assert instance.epoch == 1  # it was re-placed: the same id, the same gate
        assert plane.dispatcher.admission.load(instance.id).active == 0


async def test_a_resume_that_meets_a_full_queue_never_fails_the_busy_replica(tmp_path):
    """Two replicas, one slot each, no queue. The stream on one is lost; its resume finds the other busy with a
    long stream (``Overloaded``): it waits and tries again, and the busy replica stays ready, its stream whole."""
    async with await _plane(tmp_path, max_queue=0, resume_wait=20.0) as plane:
        placed = await plane.instances.deploy("scripted", replicas=2)
        for instance in placed:
            await asyncio.wait_for(plane.instances.wait_ready(instance.id, timeout=20), 25)
        long_read = asyncio.ensure_future(_read(plane.dispatcher.open_stream(_request("sleep 3"))))
        await asyncio.sleep(0.2)
        text, events = await asyncio.wait_for(_read(plane.dispatcher.open_stream(_request("breaks once"))), 30)
        assert text == "first second" and isinstance(events[-1], Finished), events
        long_text, long_events = await asyncio.wait_for(long_read, 30)
        assert long_text == "slept" and not any(isinstance(e, Failed) for e in long_events), long_events
        failed = [e for e in await plane.store.events() if e.kind == "instance.failed"]
        assert len(failed) == 1, [e.message for e in failed]  # the lost one only, never for load
        assert "runner lost" in failed[0].message
