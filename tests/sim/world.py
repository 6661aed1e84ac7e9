"""What the simulated cluster runs on: one store every machine shares (with latency, stalls and outages), the
accounts in it, scripted runners that generate on the virtual clock and can be killed, and node agents whose
only difference from the real ``NodeAgent`` is that they describe themselves from the simulation and measure
their links from it instead of from sockets.

``World`` holds what the faults did, so the checks (``tests.sim.checks``) can tell a replica failed for a fault
of its own from one failed for load, and a stream cut by a drain from one cut by a dead node.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from meshgate.backends.base import ModelCard, Peers
from meshgate.backends.placement import Candidate, Link, Node, NodeId, Shard
from meshgate.gateway.auth.keys import ApiKey, MemoryAccounts
from meshgate.gateway.cluster.agent import NodeAgent
from meshgate.gateway.cluster.records import Draining, Failed, Instance
from meshgate.gateway.cluster.store import MemoryStore
from meshgate.protocols.model import (
    ErrorInfo,
    Event,
    Finished,
    Request,
    StoreUnavailable,
    TextDelta,
    Usage,
)
from meshgate.protocols.model import Failed as FailedEvent
from tests.scripted_plugin import CARD, ScriptedBackend
from tests.sim.clock import EPOCH, current_machine, machine

log = logging.getLogger("meshgate.sim.store")

MODELS = {
    "small": msgspec.structs.replace(CARD, name="small", size=512 << 20),
    "large": msgspec.structs.replace(CARD, name="large", size=1536 << 20),
}
"""Two models of different sizes; four nodes of ``NODE_MEMORY`` hold some of each."""

NODE_MEMORY = 4 << 30
STORE_TIMEOUT = 2.0


@dataclass
class Violation:
    at: float
    what: str


@dataclass
class World:
    rng: random.Random
    store: SimStore = field(init=False)
    launched: dict[str, SimLaunched] = field(default_factory=dict)  # url -> runner
    dead_nodes: set[str] = field(default_factory=set)
    cut: set[tuple[str, str]] = field(default_factory=set)  # (gateway, node) pairs that cannot reach each other
    cut_healed: dict[tuple[str, str], float] = field(default_factory=dict)  # when each pair was joined (inf: cut)
    faulted: dict[str, str] = field(default_factory=dict)  # instance id -> the first fault that hit it
    drain_until: dict[str, float] = field(default_factory=dict)  # instance id -> its drain's end (true time)
    skew: dict[str, float] = field(default_factory=dict)  # machine -> how far its wall clock is ahead
    violations: list[Violation] = field(default_factory=list)
    streams_on: dict[str, int] = field(default_factory=dict)  # url -> streams generating there now
    killed: set[str] = field(default_factory=set)  # urls of runners killed by a fault
    died: dict[str, float] = field(default_factory=dict)  # node -> when it was last killed
    draining: set[str] = field(default_factory=set)  # nodes draining (a starting replica there is failed, moved)
    drain_ends: dict[str, float] = field(default_factory=dict)  # node -> when its drain's grace ends
    placed_at: dict[str, float] = field(default_factory=dict)  # instance id -> when its current placement was made
    starts: dict[str, list[float]] = field(default_factory=dict)  # node -> when each of its runs began

    def __post_init__(self) -> None:
        self.store = SimStore(self)

    def violate(self, what: str) -> None:
        self.violations.append(Violation(asyncio.get_running_loop().time(), what))

    def fault(self, instance_id: str, why: str) -> None:
        self.faulted.setdefault(instance_id, why)

    def node_down(self, node: str) -> None:
        self.dead_nodes.add(node)
        self.died[node] = asyncio.get_running_loop().time()
        for url, runner in self.launched.items():
            if runner.node == node:
                self.killed.add(url)
                self.fault(runner.instance_id, f"node {node} died")


# ---------------------------------------------------------------------------------------------------- the store


class SimStore:
    """``MemoryStore`` as Redis would be to its clients: each call takes a random few milliseconds (so calls of
    different machines interleave by the seed), runs on the store's own clock, and fails as ``StoreUnavailable``
    while the store is stalled (after ``STORE_TIMEOUT``, the client's bound) or down (at once). Every write of an
    instance record is audited: it must be conditional on the state and epoch its writer read."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.inner = MemoryStore()
        self.stalled_until = 0.0
        self.down_until = 0.0
        self.away: dict[str, float] = {}  # machine -> its clock when a call of its last failed
        self._answering = asyncio.Event()
        self._answering.set()
        self.calls = 0

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        began = asyncio.get_running_loop().time()
        rng = self.world.rng
        await asyncio.sleep(rng.random() * 0.004)
        now = self._now()
        if now < self.down_until:
            self.away[current_machine()] = time.monotonic()
            raise StoreUnavailable("the state store is unreachable; retry shortly")
        if now < self.stalled_until:  # the reply comes when the store answers again, or the client gives up
            try:
                async with asyncio.timeout(STORE_TIMEOUT):
                    await self._answering.wait()
                self.away[current_machine()] = time.monotonic()  # it answered late: away meanwhile
            except TimeoutError:
                self.away[current_machine()] = time.monotonic()
                raise StoreUnavailable("the state store did not answer in time; retry shortly") from None
        observe = self._audit(name, args, kwargs)
        if name == "append_event":
            log.info("event %s: %s", args[0], args[1])
        with machine("store"):
            result = await getattr(self.inner, name)(*args, **kwargs)
        if observe is not None and result:
            self._observe(*observe, asked_at=began)
        return result

    @staticmethod
    def _now() -> float:
        with machine("store"):
            return time.monotonic()

    def _audit(self, name: str, args: tuple, kwargs: dict) -> tuple[str, object] | None:
        """Check a write before it is made; what to observe once it is (its instance and new state)."""
        world = self.world
        if name == "put_instance":
            (inst,) = args
            if inst.id in self.inner._instances:
                world.violate(f"put_instance overwrote {inst.id} without a condition")
            self._check_memory(inst)
            world.placed_at[inst.id] = asyncio.get_running_loop().time()
        elif name == "set_state":
            instance_id, state = args
            if kwargs.get("expected") is None or kwargs.get("epoch") is None:
                world.violate(f"set_state of {instance_id} to {type(state).__name__} without state and epoch")
            return instance_id, state
        elif name == "update_instance":
            (inst,) = args
            old = self.inner._instances.get(inst.id)
            current = None if old is None else msgspec.json.decode(old, type=Instance)
            if current is not None and inst.epoch > current.epoch:
                if inst.placement.context != current.placement.context:
                    world.violate(
                        f"{inst.id} re-placed with context {inst.placement.context}, was {current.placement.context}"
                    )
                self._check_memory(inst, replacing=inst.id)
                world.placed_at[inst.id] = asyncio.get_running_loop().time()
            return inst.id, inst.state
        return None

    def _observe(self, instance_id: str, state: object, asked_at: float) -> None:
        """``state`` written (``asked_at``: when its writer made the call; the store may have taken long)."""
        if isinstance(state, Draining):  # its end in true time: its writer's clock may be off
            writer = current_machine()
            self.world.drain_until[instance_id] = state.until - EPOCH - self.world.skew.get(writer, 0.0)
        elif isinstance(state, Failed):
            if self._own_fault(instance_id, asked_at):
                self.world.fault(instance_id, state.reason)  # its runners stop: streams there resume elsewhere
            else:
                self.world.violate(f"{instance_id} failed with no fault of its own: {state.reason}")

    def _own_fault(self, instance_id: str, asked_at: float) -> bool:
        """Hit by a fault: its runner killed or cut off from the gateway that says so, or a node of its placement
        died in the run it was placed on, is down, or drains (what was starting there starts elsewhere)."""
        if instance_id in self.world.faulted:
            return True
        raw = self.inner._instances.get(instance_id)
        if raw is None:
            return False
        nodes = msgspec.json.decode(raw, type=Instance).placement.memory_per_node
        writer = current_machine()  # a gateway cut from a node fails what it cannot reach there
        return any(
            n in self.world.dead_nodes
            or n in self.world.draining
            or self.world.died.get(n, -math.inf) >= self._incarnation(n, self.world.placed_at.get(instance_id, 0.0))
            or asked_at - self.world.cut_healed.get((writer, n), -math.inf) < 2.0
            for n in nodes
        )

    def _incarnation(self, node: str, at: float) -> float:
        """When the run of ``node`` that was up (or last up) at ``at`` began."""
        return max((t for t in self.world.starts.get(node, ()) if t <= at), default=-math.inf)

    def _check_memory(self, inst: Instance, replacing: str | None = None) -> None:
        placed: dict[str, int] = {}
        for raw in self.inner._instances.values():
            other = msgspec.json.decode(raw, type=Instance)
            if other.id != replacing and not isinstance(other.state, Failed):
                for node_id, size in other.placement.memory_per_node.items():
                    placed[node_id] = placed.get(node_id, 0) + size
        for node_id, size in inst.placement.memory_per_node.items():
            if placed.get(node_id, 0) + size > NODE_MEMORY:
                self.world.violate(
                    f"{inst.id} placed on {node_id}: {placed.get(node_id, 0) + size} bytes of {NODE_MEMORY}"
                )

    @property
    def unavailable_at(self) -> float:
        """As each machine's own client of the store knows it."""
        return self.away.get(current_machine(), -math.inf)

    def stall(self, seconds: float) -> None:
        """Stop answering for ``seconds`` (a paused or black-holed Redis): calls wait for it, at most the
        client's timeout."""
        self.stalled_until = max(self.stalled_until, self._now() + seconds)
        self._answering.clear()
        asyncio.get_running_loop().call_later(seconds, self._answer)

    def down(self, seconds: float) -> None:
        """Refuse every call for ``seconds`` (Redis stopped: connections refused)."""
        self.down_until = max(self.down_until, self._now() + seconds)

    def heal(self) -> None:
        self.stalled_until = self.down_until = 0.0
        self._answering.set()

    def _answer(self) -> None:
        if self._now() >= self.stalled_until:
            self._answering.set()

    def wipe(self) -> None:
        """An empty restart: everything gone, the watchers (connections) kept."""
        watchers = self.inner._watchers
        self.inner.__init__()  # type: ignore[misc]
        self.inner._watchers = watchers
        self.inner._changed("nodes", "links", "instances")

    def watch(self) -> AsyncIterator[str]:
        return self.inner.watch()

    async def close(self) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._call(name, *args, **kwargs)

        return call


class SimAccounts:
    """Keys in the shared store (lost by a wipe), and this gateway's own copy of the seal (a file: kept), as
    ``RedisAccounts`` keeps them."""

    def __init__(self, world: World, shared: MemoryAccounts) -> None:
        self.world = world
        self.shared = shared
        self.remembered = False

    async def _up(self) -> None:
        await self.world.store._call("generation")  # the same latency and faults as every store call

    async def put_key(self, key: ApiKey) -> None:
        self.remembered = True
        await self._up()
        await self.shared.put_key(key)

    async def sealed(self) -> bool:
        await self._up()
        if self.remembered and not await self.shared.sealed():
            self.shared._sealed = True
        sealed = self.remembered or await self.shared.sealed()
        self.remembered = sealed
        return sealed

    async def get_key(self, key_id: str) -> ApiKey | None:
        await self._up()
        return await self.shared.get_key(key_id)

    async def keys(self) -> list[ApiKey]:
        await self._up()
        return await self.shared.keys()

    async def delete_key(self, key_id: str) -> bool:
        await self._up()
        return await self.shared.delete_key(key_id)

    async def window(self, name: str, amount: int, limit: int, window: float = 60.0) -> tuple[bool, float]:
        await self._up()
        return await self.shared.window(name, amount, limit, window)

    async def close(self) -> None:
        return None


# ---------------------------------------------------------------------------------------------------- runners


class SimLaunched:
    """A runner process on a node: alive until killed, its node dies, or its agent stops it."""

    pid = None

    def __init__(self, world: World, node: str, instance_id: str) -> None:
        self.world, self.node, self.instance_id = world, node, instance_id
        self.url: str | None = f"sim://{node}/{instance_id}/{len(world.launched)}"
        self.stopped = False
        world.launched[self.url] = self

    @property
    def alive(self) -> bool:
        return not self.stopped and self.url not in self.world.killed and self.node not in self.world.dead_nodes

    async def stop(self) -> None:
        node_done = self.world.drain_ends.get(self.node, math.inf) <= asyncio.get_running_loop().time()
        if node_done:  # its node drained while the gateways could not move it: it goes with its node
            self.world.fault(self.instance_id, f"node {self.node} stopped after its drain")
        if self.alive and self.world.streams_on.get(self.url or "", 0):
            until = self.world.drain_until.get(self.instance_id)
            now = asyncio.get_running_loop().time()
            if self.instance_id not in self.world.faulted and (until is None or now < until - 0.5):
                self.world.violate(
                    f"{self.instance_id} stopped on {self.node} with {self.world.streams_on[self.url or '']} streams "
                    f"running, before its drain's grace ended (until {until})"
                )
        self.stopped = True


class SimRunner:
    """The gateway's client of a head runner: ``tokens N`` generates N tokens (`` t0 t1 ...``), one every few
        hundredths of a virtual second; a resumed one (``Request.resume``) sends the events of the tokens it was given
    again first, as llama.cpp's runner does; a runner that is gone, or a node this
        gateway cannot reach, answers ``BackendUnavailable`` (at the start, or mid-stream)."""

    def __init__(self, world: World, gateway: str, urls: Mapping[str, str]) -> None:
        self.world, self.gateway = world, gateway
        self.head = next(iter(urls.values()), "")

    def _lost(self) -> bool:
        runner = self.world.launched.get(self.head)
        return runner is None or not runner.alive or (self.gateway, runner.node) in self.world.cut

    async def generate(self, request: Request) -> AsyncIterator[Event]:
        if self._lost():
            yield FailedEvent(error=ErrorInfo(kind="BackendUnavailable", message="runner unreachable"))
            return
        count = int(request.messages[-1].text.split()[1])
        self.world.streams_on[self.head] = self.world.streams_on.get(self.head, 0) + 1
        try:
            yield Usage(prompt_tokens=2)
            replayed = len(request.resume or ())  # a resumed stream's tokens are sent again, then the rest
            for index in range(count):
                await asyncio.sleep(0.001 if index < replayed else 0.02 + self.world.rng.random() * 0.1)
                if self._lost():
                    yield FailedEvent(error=ErrorInfo(kind="BackendUnavailable", message="runner lost"))
                    return
                yield TextDelta(text=f" t{index}", tokens=(index,))
            yield Usage(prompt_tokens=2, completion_tokens=count)
            yield Finished(reason="stop")
        finally:
            self.world.streams_on[self.head] -= 1

    async def count_tokens(self, request: Request) -> int:
        return 2

    async def embed(self, request: Any) -> Any:
        raise NotImplementedError


class SimBackend(ScriptedBackend):
    """The scripted backend's placement (one small shard per replica) with simulated runners."""

    name = "scripted"
    token_bytes = None  # the dispatcher reads it in a thread otherwise: no threads in an episode

    def __init__(self, world: World, gateway: str) -> None:
        self.world, self.gateway = world, gateway

    def supports(self, card: ModelCard) -> bool:
        return card.name in MODELS

    def spec(self, card: ModelCard) -> Any:
        spec = super().spec(msgspec.structs.replace(card, size=1))
        return msgspec.structs.replace(spec, layer_bytes=card.size)

    async def launch(self, card: ModelCard, placement: Candidate, shard: Shard, *, host: str, peers: Peers) -> Any:
        await asyncio.sleep(0.5 + self.world.rng.random())  # loading the weights
        node = str(shard.node_id)
        if node in self.world.dead_nodes:
            raise RuntimeError("the node is down")
        return SimLaunched(self.world, node, _launching.get())

    def connect(self, card: ModelCard, placement: Candidate, urls: Mapping[str, str]) -> SimRunner:
        return SimRunner(self.world, self.gateway, urls)


# ---------------------------------------------------------------------------------------------------- agents


_launching: contextvars.ContextVar[str] = contextvars.ContextVar("sim_launching", default="?")


class SimAgent(NodeAgent):
    """The real agent, described and linked from the simulation (no sockets, no /proc, no threads)."""

    def __init__(self, world: World, name: str, **kwargs: Any) -> None:
        self.world = world
        super().__init__(
            world.store,
            [SimBackend(world, "-")],
            MODELS.__getitem__,
            choose=lambda card, backends: backends[0],
            name=name,
            flops=1e10,
            secret="sim-cluster-secret",  # else made (from the seeded draws) by the first episode only
            **kwargs,
        )

    def _describe(self) -> Node:
        return Node(
            id=NodeId(self.name),
            name=self.name,
            agent_url=f"sim://{self.name}",
            memory_total=NODE_MEMORY,
            memory_available=NODE_MEMORY,
            cpu_count=2,
            flops=1e10,
            runtimes={"scripted": "1"},
            heartbeat_at=time.time(),
            draining_until=self.draining_until,
        )

    async def _launch(self, instance: Instance) -> None:
        _launching.set(instance.id)  # this task's: the backend's ``launch`` learns whose runner it starts
        await super()._launch(instance)

    async def _serve_probes(self) -> None:
        return None

    async def _calibrate(self) -> None:
        return None

    async def probe_links(self) -> list[Link]:
        links = [
            Link(src=self.node_id, dst=node.id, bandwidth=1e9, latency=0.0002, measured_at=time.time())
            for node in await self.store.nodes()
            if node.id != self.node_id
        ]
        for link in links:
            await self.store.put_link(link)
        self._measured = links
        return links
