"""The dispatcher in-process: a fresh plugin manager with only the scripted backend, the memory store, and the
embedded node agent in this event loop. No subprocess, no socket to a runner: fast, and it runs everywhere."""

from __future__ import annotations

import pytest

from meshgate.gateway.http.runtime import control_plane
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from meshgate.protocols.model import (
    Finished,
    Message,
    Overloaded,
    Request,
    TextDelta,
    TextPart,
    UnknownModel,
    Usage,
    collect,
)
from tests import scripted_plugin


def _request(text: str, **extra) -> Request:
    return Request(model="scripted", messages=(Message(role="user", parts=(TextPart(text=text),)),), **extra)


@pytest.fixture
async def plane(tmp_path):
    settings = Settings(
        data_dir=str(tmp_path), disabled_plugins=("llama_cpp", "mlx", "vllm"), parallel=1, max_queue=1, agent_port=0
    )
    async with control_plane(
        settings, build_plugin_manager(settings, extra=[scripted_plugin]), gateway=True, agent=True
    ) as plane:
        yield plane


async def test_a_request_is_placed_and_answered(plane):
    events = [e async for e in await plane.dispatcher.open_stream(_request("hello"))]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hello, world"
    assert isinstance(events[-1], Finished)
    assert [i.model for i in await plane.store.instances()] == ["scripted"]


async def test_usage_reaches_the_meter_and_a_key_sees_only_its_models(plane):
    seen: list[Usage] = []
    response = await collect(await plane.dispatcher.open_stream(_request("hello"), on_usage=seen.append))
    assert response.usage.completion_tokens == seen[-1].completion_tokens > 0
    with pytest.raises(UnknownModel):
        await plane.dispatcher.open_stream(_request("hello"), may_use=lambda name: name == "other")


async def test_a_full_queue_is_refused_at_once(plane):
    running = await plane.dispatcher.open_stream(_request("sleep 5", stream=True), caller="a")
    first = await anext(running)
    waiting = await plane.dispatcher.open_stream(_request("hello", stream=True), caller="b")
    with pytest.raises(Overloaded):
        await plane.dispatcher.open_stream(_request("hello", stream=True), caller="c")
    await running.aclose()
    assert first is not None
    text = [e async for e in waiting if isinstance(e, TextDelta)]
    assert "".join(e.text for e in text) == "Hello, world"


async def _load(plane):
    (instance,) = await plane.store.instances()
    return plane.dispatcher.admission.load(instance.id)


async def test_a_stream_closed_before_it_is_read_frees_its_slot(plane):
    await collect(await plane.dispatcher.open_stream(_request("hello")))  # placed and ready
    unread = await plane.dispatcher.open_stream(_request("sleep 5", stream=True), caller="a")
    assert (await _load(plane)).active == 1
    await unread.aclose()  # no event read: an async generator here would never run its ``finally``
    assert (await _load(plane)).active == 0
    response = await collect(await plane.dispatcher.open_stream(_request("hello"), caller="b"))
    assert response.usage.completion_tokens > 0


async def test_a_waiting_stream_closed_before_its_turn_leaves_the_queue(plane):
    await collect(await plane.dispatcher.open_stream(_request("hello")))
    running = await plane.dispatcher.open_stream(_request("sleep 5", stream=True), caller="a")
    await anext(running)
    waiting = await plane.dispatcher.open_stream(_request("hello", stream=True), caller="b")
    assert (await _load(plane)).queued == 1
    await waiting.aclose()
    assert (await _load(plane)).queued == 0
    third = await plane.dispatcher.open_stream(_request("hello", stream=True), caller="c")  # the queue has room
    await running.aclose()
    text = [e async for e in third if isinstance(e, TextDelta)]
    assert "".join(e.text for e in text) == "Hello, world"
