"""What the simulated cluster runs on: the episode's shape, scripted runners that generate on the virtual clock
and can be killed, and node agents whose only difference from the real ``NodeAgent`` is that they describe
themselves from the simulation and measure their links from it instead of from sockets. The store is
``tests.sim.store``'s.

``World`` holds what the faults did, so the store's audit can tell a replica failed for a fault of its own from
one failed for load, and a runner can tell a stream cut by a drain from one cut by a dead node.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from meshgate.backends.base import ModelCard, Peers
from meshgate.backends.placement import Candidate, Link, Node, NodeId, Shard
from meshgate.gateway.cluster.agent import NodeAgent
from meshgate.gateway.cluster.records import Instance
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
from tests.scripted_plugin import ScriptedBackend
from tests.sim.clock import now
from tests.sim.shape import MODELS, NODE_MEMORY
from tests.sim.store import SimStore


@dataclass
class Violation:
    at: float
    what: str


@dataclass
class World:
    rng: random.Random
    store: SimStore = field(init=False)  # made in __post_init__
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
    deleted_at: dict[str, float] = field(default_factory=dict)  # instance id -> when its record was deleted

    def __post_init__(self) -> None:
        self.store = SimStore(self)

    def violate(self, what: str) -> None:
        self.violations.append(Violation(now(), what))

    def fault(self, instance_id: str, why: str) -> None:
        self.faulted.setdefault(instance_id, why)

    def node_down(self, node: str) -> None:
        self.dead_nodes.add(node)
        self.died[node] = now()
        for url, runner in self.launched.items():
            if runner.node == node:
                self.killed.add(url)
                self.fault(runner.instance_id, f"node {node} died")


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
        node_done = self.world.drain_ends.get(self.node, math.inf) <= now()
        if node_done:  # its node drained while the gateways could not move it: it goes with its node
            self.world.fault(self.instance_id, f"node {self.node} stopped after its drain")
        if self.alive and self.world.streams_on.get(self.url or "", 0):
            until = self.world.drain_until.get(self.instance_id)
            if self.instance_id not in self.world.faulted and (until is None or now() < until - 0.5):
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

    async def _probe_loop(self) -> None:
        """Every ``probe_every`` seconds only: the real loop looks again at every node change (each heartbeat),
        which costs an episode a fifth of its time and measures nothing here."""
        while True:
            with contextlib.suppress(StoreUnavailable):
                await self.probe_links()
            await asyncio.sleep(self.probe_every)

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
