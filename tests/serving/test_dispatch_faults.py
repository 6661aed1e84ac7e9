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


async def test_keep_alive_never_takes_an_admins_deployment_below_its_minimum(tmp_path):
    """Issue 37, 8: an inference key's ``keep_alive: 0`` (``unload``) or short ``keep_alive`` (an expiry) left a
    model placed with ``POST /instances`` (``min_replicas`` 1) with no deployment and no replica. Now they unload
    only replicas above the minimum of a deployment an admin pinned; a first request's own placement still unloads
    whole, as Ollama's does."""
    async with await _plane(tmp_path, max_queue=4) as plane:
        [pinned] = await plane.instances.deploy("scripted", replicas=1, min_replicas=1, max_replicas=2)
        await asyncio.wait_for(plane.instances.wait_ready(pinned.id, timeout=20), 25)
        await plane.dispatcher.unload("scripted")
        await plane.instances.set_expiry("scripted", time.time() - 1)
        await asyncio.sleep(1.5)  # reconcile passes (every 0.5 s) see the expiry
        [kept] = await plane.store.instances()
        assert kept.id == pinned.id and kept.expires_at is None
        [deployment] = await plane.store.deployments()
        assert deployment.min_replicas == 1 and deployment.replicas == 1 and deployment.pinned

        text, _ = await asyncio.wait_for(_read(plane.dispatcher.open_stream(_request("hello"))), 20)
        assert text == "Hello, world"
        await plane.dispatcher.unload("scripted")  # a request's keep_alive 0 on the admin's model: nothing goes
        assert [i.id for i in await plane.store.instances()] == [pinned.id]


async def test_keep_alive_zero_unloads_a_model_a_request_placed(tmp_path):
    async with await _plane(tmp_path, max_queue=4) as plane:
        text, _ = await asyncio.wait_for(_read(plane.dispatcher.open_stream(_request("hello"))), 20)
        assert text == "Hello, world"
        [deployment] = await plane.store.deployments()
        assert not deployment.pinned
        await plane.dispatcher.unload("scripted")  # idle, or draining a moment while the shared load settles
        for _ in range(100):
            if not await plane.store.instances():
                break
            await asyncio.sleep(0.1)

        assert await plane.store.instances() == [] and await plane.store.deployments() == []
