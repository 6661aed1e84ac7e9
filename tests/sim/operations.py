"""What happens to the simulated cluster, one step at a time: a random operation or fault (``step``).

Operations, by weight (``OPERATIONS``): requests (45%: streamed, 1-40 tokens, 15% hung up early; a valid key, a
revoked one, a made-up one or none; each body as its protocol's SDK sends it, through that protocol's decoding
and ``to_internal``), deployments created or their bounds set, replicas deleted or
unloaded (``keep_alive: 0``), keys made or revoked, node drains. Faults: runners killed mid-stream, nodes killed
(back 3-15 s later), a gateway cut from a node (1-10 s), the store stalled (0.5-12 s), down (0.5-8 s) or
restarted empty (down 0.5-5 s, then back with nothing: no records, no keys).

A request checks what its client sees as it goes: served only with a valid key once any key has existed (a key
revoked during a store outage is served within ``KEY_GRACE``, as documented); one end, ``Finished`` with the
whole text (a resumed stream too), or ``Failed`` only when a fault was in effect during it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from meshgate.gateway.auth.guard import authorize, mint
from meshgate.gateway.cluster.instances import given_up
from meshgate.protocols import anthropic, ollama, openai
from meshgate.protocols.model import Failed as FailedEvent
from meshgate.protocols.model import Finished, GatewayError, Request, TextDelta, decode_body
from tests.sim.clock import machine, now
from tests.sim.shape import GATEWAYS, GRACE, MODELS, NODES, PROTOCOLS

if TYPE_CHECKING:
    from tests.sim.episode import Episode, Gateway


async def step(ep: Episode) -> None:
    """One operation or fault, drawn by weight; an operation that does not apply now (a node kill that would
    leave fewer than two nodes) gives its turn to the next one in the table."""
    gateway = ep.gateways[ep.rng.choice(GATEWAYS)]
    roll = ep.rng.random()
    for below, operation in OPERATIONS:
        if roll < below and await operation(ep, gateway) is not False:
            return


# ---------------------------------------------------------------------------------------------------- requests


async def request(ep: Episode, gateway: Gateway) -> None:
    rng = ep.rng
    key = _client_key(ep)
    tokens = rng.randint(1, 40)
    hang_up = rng.randint(0, tokens) if rng.random() < 0.15 else None
    protocol = rng.choice(PROTOCOLS)
    ep.note(f"request {protocol} {tokens} tokens on {gateway.name} key={key and key[:8]} hang_up={hang_up}")
    with machine(gateway.name):
        task = asyncio.create_task(client(ep, gateway, protocol, tokens, key, hang_up))
    ep.clients.add(task)
    task.add_done_callback(ep.clients.discard)


async def client(
    ep: Episode, gateway: Gateway, protocol: str, tokens: int, key: str | None, hang_up: int | None
) -> None:
    """One request as a client sends it: the route's guard, then the stream read to its end (or hung up)."""
    ep.requests += 1
    presented = {"authorization": f"Bearer {key}"} if key else {}
    connection = SimpleNamespace(
        headers=presented, client=SimpleNamespace(host="10.0.0.9"), state=SimpleNamespace(),
        app=SimpleNamespace(state=SimpleNamespace(keyring=gateway.keyring)),
    )  # fmt: skip
    handler = SimpleNamespace(opt={"scope": "inference", "limited": True})
    valid = key is not None and key in ep.keys.values()
    began, faulted = now(), bool(ep.active)  # a fault in effect when it began may fail it too
    try:
        await authorize(connection, handler)  # type: ignore[arg-type]
    except GatewayError:
        return
    except Exception as exc:  # litestar's NotAuthorized and the like: refused
        if type(exc).__name__ not in ("NotAuthorizedException", "PermissionDeniedException"):
            raise
        return
    # A key revoked while the store is away still works on a gateway that checked it within ``KEY_GRACE``
    # (docs/operations.md, "When Redis is away"); no key, or one that never existed, never does.
    revoked_in_outage = key in ep.revoked and ("store" in ep.active or not ep.store_up_since(began))
    if ep.sealed and not valid and not revoked_in_outage:
        ep.world.violate(f"{protocol} request with key {key!r} served by {gateway.name} after the seal")
    request = wire_request(protocol, ep.rng.choice(list(MODELS)), f"tokens {tokens}")
    try:
        stream = await gateway.dispatcher.open_stream(request, caller=connection.state.caller.bucket)
    except GatewayError:
        return
    text, ends = "", []
    async with contextlib.aclosing(stream) as events:
        async for event in events:
            if isinstance(event, TextDelta):
                text += event.text
                if hang_up is not None and text.count(" t") >= hang_up:
                    return
            elif isinstance(event, (Finished, FailedEvent)):
                ends.append(event)
    expected = "".join(f" t{i}" for i in range(tokens))
    if len(ends) != 1:
        ep.world.violate(f"a {protocol} stream ended {len(ends)} times: {ends}")
    elif isinstance(ends[0], Finished):
        ep.finished += 1
        if text != expected:
            ep.world.violate(f"a {protocol} stream finished with {text!r}, not {expected!r}")
    elif not faulted and not any(began <= at for at, _ in ep.faults):
        ep.world.violate(f"a {protocol} stream failed with no fault since it began: {ends[0].error}")


def wire_request(protocol: str, model: str, text: str) -> Request:
    """The body an SDK of ``protocol`` sends for one streamed user turn, decoded and translated as its route does
    (the protocol's own ``to_internal``)."""
    turn = [{"role": "user", "content": text}]
    if protocol == "openai":
        body = {"model": model, "messages": turn, "stream": True}
        return openai.chat_to_internal(decode_body(json.dumps(body).encode(), openai.ChatRequest))
    if protocol == "anthropic":
        body = {"model": model, "messages": turn, "max_tokens": 64, "stream": True}
        return anthropic.messages_to_internal(decode_body(json.dumps(body).encode(), anthropic.MessagesRequest))
    body = {"model": model, "messages": turn, "stream": True}
    return ollama.chat_to_internal(decode_body(json.dumps(body).encode(), ollama.ChatRequest))


def _client_key(ep: Episode) -> str | None:
    roll = ep.rng.random()
    if roll < 0.8 and ep.keys:
        return ep.rng.choice(sorted(ep.keys.values()))
    if roll < 0.9 and ep.revoked:
        return ep.rng.choice(ep.revoked)
    if roll < 0.95:
        return "mg_nosuchkey_abcdefgh"
    return None


# ---------------------------------------------------------------------------------------------------- an admin's


async def deploy(ep: Episode, gateway: Gateway) -> None:
    model = ep.rng.choice(list(MODELS))
    lo = ep.rng.randint(1, 2)
    ep.note(f"deploy {model} min {lo} on {gateway.name}")
    await _admin(ep, gateway, gateway.instances.deploy(model, replicas=lo, min_replicas=lo, max_replicas=3))


async def bounds(ep: Episode, gateway: Gateway) -> None:
    model = ep.rng.choice(list(MODELS))
    lo = ep.rng.randint(1, 2)
    ep.note(f"set_bounds {model} {lo}..3 on {gateway.name}")
    await _admin(ep, gateway, gateway.instances.set_bounds(model, lo, 3))


async def delete(ep: Episode, gateway: Gateway) -> None:
    live = [i for i in gateway.instances.snapshot() if not given_up(i)]
    if live:
        target = ep.rng.choice(live)
        ep.note(f"delete {target.id} on {gateway.name}")
        ep.lowered[target.model] = now()
        await _admin(ep, gateway, gateway.instances.delete(target.id))


async def unload(ep: Episode, gateway: Gateway) -> None:
    model = ep.rng.choice(list(MODELS))
    ep.note(f"unload {model} (keep_alive 0) on {gateway.name}")
    ep.lowered[model] = now()
    await _admin(ep, gateway, gateway.dispatcher.unload(model))


async def keys(ep: Episode, gateway: Gateway) -> None:
    if ep.keys and ep.rng.random() < 0.3:
        key_id = ep.rng.choice(sorted(ep.keys))
        ep.note(f"revoke key {key_id} on {gateway.name}")
        with contextlib.suppress(GatewayError):
            with machine(gateway.name):
                if await gateway.keyring.accounts.delete_key(key_id):
                    ep.revoked.append(ep.keys.pop(key_id))
        return
    key, record = mint(f"k{len(ep.keys)}", scope="inference")
    ep.note(f"create key {record.id} on {gateway.name}")
    with contextlib.suppress(GatewayError):
        with machine(gateway.name):
            await gateway.keyring.accounts.put_key(record)
        ep.keys[record.id] = key
        ep.sealed = True


async def drain_node(ep: Episode, gateway: Gateway) -> bool:
    if len(ep.agents) <= 2:
        return False
    name = ep.rng.choice(sorted(ep.agents))
    ep.note(f"drain node {name}")
    agent = ep.agents.pop(name)
    ep.world.draining.add(name)
    ep.world.drain_ends[name] = now() + GRACE
    with machine(name):
        draining = asyncio.create_task(agent.drain(GRACE, margin=2.0))
    draining.add_done_callback(lambda _: asyncio.get_running_loop().call_later(2.0, ep.restart, name))
    return True


async def _admin(ep: Episode, gateway: Gateway, call: Awaitable[Any]) -> None:
    try:
        with machine(gateway.name):
            await call
    except GatewayError as exc:
        ep.note(f"  -> {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------------------------------------------- faults


async def kill_runner(ep: Episode, gateway: Gateway) -> None:
    world = ep.world
    url = ep.rng.choice(sorted(u for u, r in world.launched.items() if r.alive) or [""])
    if url:
        world.killed.add(url)
        world.fault(world.launched[url].instance_id, "runner killed")
        ep.fault(f"kill runner {url}")


async def kill_node(ep: Episode, gateway: Gateway) -> bool:
    if len(ep.agents) <= 2:
        return False
    name = ep.rng.choice(sorted(ep.agents))
    ep.fault(f"kill node {name}")
    ep.active.add(f"node {name}")
    await ep.kill_node(name)
    asyncio.get_running_loop().call_later(ep.rng.uniform(3, 15), ep.restart, name)
    return True


async def cut(ep: Episode, gateway: Gateway) -> None:
    node = ep.rng.choice(NODES)
    ep.fault(f"cut {gateway.name} from {node}")
    ep.world.cut.add((gateway.name, node))
    ep.active.add(f"cut {gateway.name} {node}")
    ep.world.cut_healed[(gateway.name, node)] = math.inf
    asyncio.get_running_loop().call_later(ep.rng.uniform(1, 10), ep.heal_cut, gateway.name, node)


async def stall(ep: Episode, gateway: Gateway) -> None:
    await _store_fault(ep, "stalled", ep.rng.uniform(0.5, 12), ep.world.store.stall, "store answers again")


async def down(ep: Episode, gateway: Gateway) -> None:
    await _store_fault(ep, "down", ep.rng.uniform(0.5, 8), ep.world.store.down, "store back")


async def restart_empty(ep: Episode, gateway: Gateway) -> None:
    """Redis killed and started again without its data (0.5-5 s)."""
    seconds = ep.rng.uniform(0.5, 5)
    ep.fault(f"store restarts empty in {seconds:.1f}s")
    ep.world.store.down(seconds)
    ep.active.add("store")
    asyncio.get_running_loop().call_later(seconds, ep.store_wiped)


async def _store_fault(ep: Episode, how: str, seconds: float, start: Callable[[float], None], end: str) -> None:
    ep.fault(f"store {how} {seconds:.1f}s")
    start(seconds)
    ep.active.add("store")
    asyncio.get_running_loop().call_later(seconds, ep.store_back, end)


async def _quiet(ep: Episode, gateway: Gateway) -> None:
    return None


OPERATIONS: list[tuple[float, Callable[[Episode, Gateway], Awaitable[bool | None]]]] = [
    (0.45, request),
    (0.50, deploy),
    (0.54, bounds),
    (0.58, delete),
    (0.61, unload),
    (0.64, keys),
    (0.68, kill_runner),
    (0.71, kill_node),
    (0.73, drain_node),
    (0.77, cut),
    (0.80, stall),
    (0.82, down),
    (0.83, restart_empty),
    (1.00, _quiet),
]
"""Each operation with the top of its share of ``[0, 1)``: a draw below it and above the one before picks it."""
