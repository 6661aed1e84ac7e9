"""Priority classes in admission (``gateway.serving.admission``): strict order between classes, aging, weights
within a class; and the class settled from ``service_tier``, the key and the setting, through the dispatcher and
the app with the scripted backend, in process."""

from __future__ import annotations

import asyncio
import logging

import pytest
from litestar.testing import AsyncTestClient

from meshgate.gateway.http.app import create_app
from meshgate.gateway.http.runtime import control_plane
from meshgate.gateway.serving.admission import Admission
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from meshgate.protocols.model import Message, Request, TextPart, collect
from tests import scripted_plugin


async def _grants(admission: Admission, tickets, releases: int, holder) -> list[str]:
    """Release the holder, then each granted ticket in turn: the names of the tickets in the order granted."""
    order: list[str] = []
    holder.release()
    for _ in range(releases):
        granted = [name for name, t in tickets if t.granted and not t.released and name not in order]
        order.extend(granted)
        for name, t in tickets:
            if name in granted:
                t.release()
    return order


async def test_interactive_requests_go_before_batch_ones_that_waited_longer():
    admission = Admission(parallel=1, max_queue=10, aging=60)
    holder = admission.enter("i", "h")
    tickets = [
        ("b1", admission.enter("i", "bulk", priority="batch")),
        ("b2", admission.enter("i", "bulk", priority="batch")),
        ("i1", admission.enter("i", "alice")),
        ("i2", admission.enter("i", "bob")),
    ]
    assert admission.load("i").batch_queued == 2 and admission.load("i").queued == 4
    assert await _grants(admission, tickets, 4, holder) == ["i1", "i2", "b1", "b2"]


async def test_a_batch_request_past_the_aging_bound_takes_one_slot_then_waits_its_turn_again():
    admission = Admission(parallel=1, max_queue=10, aging=0.2)
    holder = admission.enter("i", "h")
    b1 = admission.enter("i", "bulk", priority="batch")
    b2 = admission.enter("i", "bulk", priority="batch")
    people = [admission.enter("i", f"p{n}") for n in range(3)]
    await asyncio.sleep(0.25)
    holder.release()
    assert b1.granted and not any(p.granted for p in people), "aged: the batch request takes the slot"
    b1.release()
    assert people[0].granted and not b2.granted, "the aging clock restarted: people first again"
    people[0].release()
    assert people[1].granted and not b2.granted
    await asyncio.sleep(0.25)
    people[1].release()
    assert b2.granted and not people[2].granted, "one more aged batch slot per aging period"


async def test_interactive_requests_take_the_runner_s_spares_while_batch_ones_hold_its_slots():
    """2 slots and 1 spare: a third request is granted only if it is interactive and batch ones hold slots; batch
    requests never take the spare, and at most ``parallel`` interactive ones run."""
    admission = Admission(max_queue=10, aging=60)
    b1, b2 = (admission.enter("i", "bulk", 2, priority="batch", spares=1) for _ in range(2))
    b3 = admission.enter("i", "bulk", 2, priority="batch", spares=1)
    assert b1.granted and b2.granted and not b3.granted
    i1 = admission.enter("i", "alice", 2, spares=1)
    assert i1.granted, "interactive: the spare (the runner pauses a batch sequence for it)"
    i2 = admission.enter("i", "bob", 2, spares=1)
    assert not i2.granted, "spares used up"
    b1.release()
    assert i2.granted and not b3.granted, "the freed slot: interactive first"
    i3 = admission.enter("i", "carol", 2, spares=1)
    assert not i3.granted, "parallel interactive requests already run"
    i1.release()
    assert i3.granted and not b3.granted
    for t in (b2, i2, i3):
        t.release()
    assert b3.granted and admission.load("i").active == 1


async def test_weights_share_a_class_s_slots_in_proportion():
    """Weights 3 and 1 over 4 slots: 3 and 1 (equal turns would give 2 and 2)."""
    admission = Admission(parallel=4, max_queue=20, aging=60)
    holders = [admission.enter("i", "h") for _ in range(4)]
    heavy = [admission.enter("i", "heavy", weight=3) for _ in range(6)]
    light = [admission.enter("i", "light", weight=1) for _ in range(6)]
    for h in holders:
        h.release()

    def held() -> tuple[int, int]:
        return tuple(sum(t.granted and not t.released for t in side) for side in (heavy, light))  # type: ignore[return-value]

    assert held() == (3, 1)
    next(t for t in light if t.granted).release()
    assert held() == (3, 1), "a freed slot goes to the caller under its share"


async def test_each_class_has_its_own_queue_bound():
    admission = Admission(parallel=1, max_queue=1)
    admission.enter("i", "h")
    admission.enter("i", "bulk", priority="batch")
    waiting = admission.enter("i", "alice")  # the batch line being full does not refuse people
    assert not waiting.granted and admission.load("i").queued == 2


def _request(text: str, **extra) -> Request:
    return Request(model="scripted", messages=(Message(role="user", parts=(TextPart(text=text),)),), **extra)


@pytest.fixture
async def plane(tmp_path):
    settings = Settings(data_dir=str(tmp_path), disabled_plugins=("llama_cpp", "mlx", "vllm"), parallel=1, agent_port=0)
    async with control_plane(
        settings, build_plugin_manager(settings, extra=[scripted_plugin]), gateway=True, agent=True
    ) as plane:
        yield plane


async def test_the_dispatcher_serves_an_interactive_request_before_a_batch_one_that_came_first(plane):
    await collect(await plane.dispatcher.open_stream(_request("hello")))  # placed and ready
    running = await plane.dispatcher.open_stream(_request("sleep 0.3", stream=True), caller="a")
    await anext(running)
    done: list[str] = []

    async def ask(text: str, caller: str, **extra) -> None:
        answer = await collect(await plane.dispatcher.open_stream(_request(text, **extra), caller=caller))
        done.append(answer.text.strip())

    bulk = asyncio.ensure_future(ask("bulk work", "b", priority="batch"))
    await asyncio.sleep(0.05)
    person = asyncio.ensure_future(ask("person here", "c"))
    await asyncio.sleep(0.05)
    async for _ in running:
        pass
    await running.aclose()
    await asyncio.wait_for(asyncio.gather(bulk, person), 10)
    assert done == ["person here", "bulk work"]


@pytest.fixture
async def client(tmp_path):
    settings = Settings(data_dir=str(tmp_path), disabled_plugins=("llama_cpp", "mlx", "vllm"), agent_port=0)
    app = create_app(settings, build_plugin_manager(settings, extra=[scripted_plugin]))
    async with AsyncTestClient(app) as http:
        yield http
    # the request log asked ``isEnabledFor(INFO)`` at WARNING: later tests that set the root level directly (not
    # with ``setLevel``) would read that cached answer
    logging.getLogger().manager._clear_cache()


async def test_service_tier_is_echoed_as_the_tier_that_served(client):
    chat = {"model": "scripted", "messages": [{"role": "user", "content": "hello"}]}
    plain = (await client.post("/v1/chat/completions", json=chat)).json()
    flex = (await client.post("/v1/chat/completions", json={**chat, "service_tier": "flex"})).json()
    priority = (await client.post("/v1/chat/completions", json={**chat, "service_tier": "priority"})).json()
    assert (plain["service_tier"], flex["service_tier"], priority["service_tier"]) == ("default", "flex", "default")
    bad = await client.post("/v1/chat/completions", json={**chat, "service_tier": "gold"})
    assert bad.status_code == 400 and "service_tier" in bad.json()["error"]["message"]
    message = {"model": "scripted", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
    answer = (await client.post("/v1/messages", json={**message, "service_tier": "standard_only"})).json()
    assert answer["usage"]["service_tier"] == "standard"
    response = await client.post("/v1/responses", json={"model": "scripted", "input": "hi", "service_tier": "flex"})
    assert response.json()["service_tier"] == "flex"


async def test_a_key_s_class_and_the_setting_decide_without_a_service_tier(client):
    made = (await client.post("/keys", json={"name": "nightly", "priority": "batch", "weight": 2})).json()
    assert (made["priority"], made["weight"]) == ("batch", 2)
    headers = {"authorization": f"Bearer {made['key']}"}
    chat = {"model": "scripted", "messages": [{"role": "user", "content": "hello"}]}
    keyed = (await client.post("/v1/chat/completions", json=chat, headers=headers)).json()
    assert keyed["service_tier"] == "flex"
    asked = (await client.post("/v1/chat/completions", json={**chat, "service_tier": "auto"}, headers=headers)).json()
    assert asked["service_tier"] == "default", "the request's own service_tier wins over its key's class"
    listed = await client.get("/keys", headers=headers)
    assert listed.status_code == 403  # an inference key lists no keys; the record carries the class (above)


async def test_the_class_is_counted_in_metrics(client):
    chat = {"model": "scripted", "messages": [{"role": "user", "content": "hello"}]}
    await client.post("/v1/chat/completions", json={**chat, "service_tier": "flex"})
    await client.post("/v1/chat/completions", json=chat)
    text = (await client.get("/metrics")).text
    assert 'meshgate_class_requests_total{class="batch",model="scripted"} 1.0' in text
    assert 'meshgate_class_requests_total{class="interactive",model="scripted"} 1.0' in text
    assert 'meshgate_class_queue_depth{class="batch"' in text
