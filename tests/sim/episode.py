"""One seeded episode: a store, four node agents and two gateways on one virtual clock, driven by random
operations and faults for ``DURATION`` virtual seconds, then healed and left ``SETTLE`` seconds to converge.

Every machine's wall clock is off by up to ``SKEW`` seconds; the episode's seed picks them, every id, key,
latency and operation, so ``run(seed)`` gives the same episode every time.

The operations and faults are ``tests.sim.operations``'s; the checks run where things happen (the store's audit
of every write, each client's own) and at rest (``tests.sim.checks``). ``run(seed)`` returns what broke (an empty
list when nothing did) and the trace of operations that led there.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import logging
import random
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from meshgate.gateway.auth.guard import KeyRing
from meshgate.gateway.auth.keys import MemoryAccounts
from meshgate.gateway.cluster.autoscale import Autoscaler, Policy
from meshgate.gateway.cluster.instances import InstanceManager
from meshgate.gateway.cluster.loads import LoadBoard
from meshgate.gateway.cluster.store import deployment_json
from meshgate.gateway.serving.admission import Admission
from meshgate.gateway.serving.catalog import Catalog
from meshgate.gateway.serving.dispatch import Dispatcher
from meshgate.protocols.model import StoreUnavailable
from tests.sim import checks, operations
from tests.sim.clock import Stalled, VirtualClock, VirtualLoop, clocks, machine, now, on
from tests.sim.shape import DURATION, GATEWAYS, GRACE, HEARTBEAT, MODELS, NODE_TTL, NODES, RATE, SETTLE, SKEW
from tests.sim.store import SimAccounts
from tests.sim.world import SimAgent, SimBackend, World

log = logging.getLogger("meshgate.sim")


@dataclass
class Outcome:
    seed: int
    violations: list[str]
    trace: list[str]
    requests: int = 0
    finished: int = 0
    store_calls: int = 0
    virtual_seconds: float = 0.0


class _Source:
    def models(self) -> list[Any]:
        return list(MODELS.values())


@dataclass
class Gateway:
    name: str
    instances: InstanceManager
    dispatcher: Dispatcher
    admission: Admission
    loads: LoadBoard
    keyring: KeyRing
    keeping: asyncio.Task[None]

    async def close(self) -> None:
        self.keeping.cancel()
        await self.loads.close()
        await self.instances.close()


async def _gateway(world: World, name: str, shared: MemoryAccounts) -> Gateway:
    catalog = Catalog([_Source()])
    catalog.refresh()
    backend = SimBackend(world, name)
    admission = Admission(2, 8)
    holder: dict[str, InstanceManager] = {}
    loads = LoadBoard(world.store, admission, gateway_id=name, live=lambda: holder["i"].ids())  # type: ignore[arg-type]
    instances = InstanceManager(
        world.store,  # type: ignore[arg-type]
        [backend],
        resolve=catalog.resolve,
        choose=lambda card, backends: backends[0],
        load=loads.load,
        holder=name,
        on_route=loads.routed,
        min_replicas=1,
        max_replicas=3,
        drain_grace=GRACE,
        node_ttl=NODE_TTL,
    )
    holder["i"] = instances
    policy = Policy(up_wait=3.0, down_idle=20.0, cooldown=5.0)
    instances.scale = Autoscaler(instances, policy, loads.view, clock=lambda: time.time()).step
    await instances.start()
    await loads.start()
    dispatcher = Dispatcher(
        catalog, [backend], lambda card, backends: backends[0], instances, admission=admission, loads=loads,
        resume_wait=30.0,
    )  # fmt: skip
    keyring = KeyRing(SimAccounts(world, shared))  # type: ignore[arg-type]
    keeping = asyncio.create_task(keyring.keep_seal())
    return Gateway(name, instances, dispatcher, admission, loads, keyring, keeping)


@dataclass
class Episode:
    seed: int
    rng: random.Random
    world: World
    gateways: dict[str, Gateway] = field(default_factory=dict)
    agents: dict[str, SimAgent] = field(default_factory=dict)
    trace: list[str] = field(default_factory=list)
    clients: set[asyncio.Task] = field(default_factory=set)
    keys: dict[str, str] = field(default_factory=dict)  # key id -> key, live ones
    revoked: list[str] = field(default_factory=list)
    sealed: bool = False
    faults: list[tuple[float, bool]] = field(default_factory=list)  # (when a fault began or ended, the store's?)
    active: set[str] = field(default_factory=set)  # the faults in effect now
    starting: set[str] = field(default_factory=set)  # nodes whose agent is starting (waiting for the store)
    requests: int = 0
    finished: int = 0
    accounts: MemoryAccounts = field(default_factory=MemoryAccounts)  # the keys in the store
    wiped: dict[str, float] = field(default_factory=dict)  # model -> when a wipe found it deployed
    lowered: dict[str, float] = field(default_factory=dict)  # model -> when an operation last removed a replica

    def note(self, what: str) -> None:
        self.trace.append(f"{now():8.3f} {what}")
        log.info("%s", what)

    def fault(self, what: str) -> None:
        self.faults.append((now(), what.startswith("store")))
        self.note(what)

    # ----------------------------------------------------------------------------------------- machines

    async def start_node(self, name: str) -> None:
        self.world.dead_nodes.discard(name)
        self.world.starts.setdefault(name, []).append(now())
        with machine(name):
            while True:  # as its supervisor would: started again until the store lets it register
                agent = SimAgent(self.world, name, heartbeat=HEARTBEAT, ttl=NODE_TTL, probe_every=10.0)
                try:
                    await agent.start()
                    self.starting.discard(name)
                    break
                except StoreUnavailable:
                    await agent.close(deregister=False)
                    await asyncio.sleep(1.0)
        self.agents[name] = agent

    async def kill_node(self, name: str) -> None:
        agent = self.agents.pop(name)
        self.world.node_down(name)
        agent._closed = True
        for task in [*agent._tasks, *agent._starting.values()]:
            task.cancel()

    def store_up_since(self, began: float) -> bool:
        return not any(began - 1 <= at for at, store in self.faults if store)

    @staticmethod
    def _storenow() -> float:
        with machine("store"):
            return time.monotonic()

    def restart(self, name: str) -> None:
        self.active.discard(f"node {name}")
        if name not in self.agents and name not in self.starting:
            self.starting.add(name)
            self.world.draining.discard(name)
            self.world.drain_ends.pop(name, None)
            self.note(f"node {name} starts again")
            asyncio.ensure_future(self.start_node(name))

    def store_back(self, what: str) -> None:
        store = self.world.store
        if max(store.stalled_until, store.down_until) <= self._storenow():
            self.active.discard("store")
        self.fault(what)

    def store_wiped(self) -> None:
        """The store comes back empty: its keys are gone (revoked, as clients see it), what it held too."""
        store = self.world.store
        for raw in store.inner._deployments.values():
            self.wiped[deployment_json.decode(raw).model] = now()
        store.wipe()
        self.accounts._keys.clear()
        self.accounts._sealed = False  # the store's copy of the seal; each gateway keeps its own
        self.revoked += self.keys.values()
        self.keys.clear()
        self.store_back("store back, empty")

    def heal_cut(self, gateway: str, node: str) -> None:
        self.world.cut.discard((gateway, node))
        self.active.discard(f"cut {gateway} {node}")
        self.world.cut_healed[(gateway, node)] = now()
        self.fault(f"{gateway} reaches {node} again")


@contextlib.contextmanager
def _seeded_ids(rng: random.Random) -> Iterator[None]:
    """Instance ids, gateway ids, keys and the ``random`` module's draws from the episode's seed."""
    saved = uuid.uuid4, secrets.token_hex, secrets.token_urlsafe
    state = random.getstate()
    random.seed(rng.getrandbits(64))  # the module's own draws (power-of-two routing)
    uuid.uuid4 = lambda: uuid.UUID(int=rng.getrandbits(128), version=4)  # type: ignore[assignment]
    secrets.token_hex = lambda n=32: rng.randbytes(n).hex()  # type: ignore[assignment]
    secrets.token_urlsafe = lambda n=32: base64.urlsafe_b64encode(rng.randbytes(n)).rstrip(b"=").decode()  # type: ignore[assignment]
    try:
        yield
    finally:
        uuid.uuid4, secrets.token_hex, secrets.token_urlsafe = saved  # type: ignore[assignment]
        random.setstate(state)


async def _episode(episode: Episode) -> None:
    rng, world = episode.rng, episode.world
    clock = asyncio.get_running_loop()
    shared = episode.accounts
    for name in NODES:
        await episode.start_node(name)
    for name in GATEWAYS:
        with machine(name):
            episode.gateways[name] = await _gateway(world, name, shared)
    end = clock.time() + DURATION
    while clock.time() < end and not world.violations:
        await asyncio.sleep(rng.expovariate(RATE))
        await operations.step(episode)
    episode.note("heal: every fault ends, every node starts again")
    world.store.heal()
    for pair in world.cut:
        world.cut_healed[pair] = now()
    world.cut.clear()
    for name in NODES:
        if name not in world.draining:  # a draining node starts again once its drain ends
            episode.restart(name)
    await asyncio.sleep(SETTLE)
    checks.at_rest(episode)
    for task in episode.clients:
        task.cancel()
    for gateway in episode.gateways.values():
        with machine(gateway.name):
            await gateway.close()
    for agent in list(episode.agents.values()):
        await agent.close(deregister=False)


def run(seed: int, *, log_level: int = logging.CRITICAL) -> Outcome:
    """Episode ``seed``: what broke (``Outcome.violations``) and the operations that led there."""
    rng = random.Random(seed)
    clock = VirtualClock()
    for name in (*NODES, *GATEWAYS, "store"):
        clock.skew[name] = rng.uniform(-SKEW, SKEW)
        clock.boot[name] = rng.uniform(0, 1e5)
    world = World(rng)
    world.skew = clock.skew
    episode = Episode(seed, rng, world)
    loop = VirtualLoop(clock)
    logging.getLogger("meshgate").setLevel(log_level)
    stalled: str | None = None
    gc.collect()  # the collector runs only between episodes: when it ran inside one (after as many allocations
    gc.disable()  # as the episodes before had made) it finalized async generators at other steps
    try:
        with clocks(clock), _seeded_ids(rng):
            main = loop.create_task(_episode(episode), context=on("driver"))
            try:
                loop.run_until_complete(main)
            except Stalled as exc:
                stalled = str(exc)
            finally:
                for task in asyncio.all_tasks(loop):
                    task.cancel()
                with contextlib.suppress(BaseException):
                    loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()
        gc.enable()
    violations = [f"{v.at:8.3f} {v.what}" for v in world.violations]
    if stalled:
        violations.append(stalled)
    return Outcome(
        seed,
        violations,
        episode.trace,
        requests=episode.requests,
        finished=episode.finished,
        store_calls=world.store.calls,
        virtual_seconds=clock.now,
    )
