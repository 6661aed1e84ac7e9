"""The simulated store: ``MemoryStore`` as Redis is to its clients (a few milliseconds a call, stalls and
outages, each machine's own view of when it was last away), auditing every write of an instance record; and the
accounts kept in it, with each gateway's own copy of the seal, as ``RedisAccounts`` keeps them."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from meshgate.gateway.auth.keys import ApiKey, Emptied, MemoryAccounts
from meshgate.gateway.cluster.records import Draining, Failed, Instance
from meshgate.gateway.cluster.store import KINDS, MemoryStore
from meshgate.protocols.model import StoreUnavailable
from tests.sim.clock import EPOCH, current_machine, machine, now
from tests.sim.shape import NODE_MEMORY, STORE_TIMEOUT

if TYPE_CHECKING:
    from tests.sim.world import World

log = logging.getLogger("meshgate.sim.store")


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
        began = now()
        rng = self.world.rng
        await asyncio.sleep(rng.random() * 0.004)
        at = self._now()
        if at < self.down_until:
            self.away[current_machine()] = time.monotonic()
            raise StoreUnavailable("the state store is unreachable; retry shortly")
        if at < self.stalled_until:  # the reply comes when the store answers again, or the client gives up
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
            absent = kwargs.get("if_absent", False)
            if inst.id in self.inner._instances and not absent:
                world.violate(f"put_instance overwrote {inst.id} without a condition")
            self._check_memory(inst, replacing=inst.id if absent else None)
            world.placed_at[inst.id] = now()
        elif name == "set_state":
            instance_id, state = args
            if kwargs.get("expected") is None or kwargs.get("epoch") is None:
                world.violate(f"set_state of {instance_id} to {type(state).__name__} without state and epoch")
            return instance_id, state
        elif name == "delete_instance":
            self.world.deleted_at[args[0]] = now()
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
                world.placed_at[inst.id] = now()
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

    def wipe(self) -> None:
        """Lose every record (Redis restarted without its data): a new incarnation, nothing stored. Its subscribers
        stay: they were woken for every kind when they subscribed again, as ``RedisStore``'s are."""
        fresh = MemoryStore()
        fresh._watchers = self.inner._watchers
        self.inner = fresh
        fresh._changed(*KINDS)

    def _answer(self) -> None:
        if self._now() >= self.stalled_until:
            self._answering.set()

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
        self.emptied = Emptied()  # as ``RedisAccounts`` keeps it

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
        self.emptied.check(self.world.store.inner._incarnation, sealed)
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
