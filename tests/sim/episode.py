"""One seeded episode: a store, four node agents and two gateways on one virtual clock, driven by random
operations and faults for ``DURATION`` virtual seconds, then healed and left ``SETTLE`` seconds to converge.

Operations: requests (streamed, some hung up early) with a valid key, no key or a revoked one; deployments
created, scaled and deleted; replicas deleted (drained), unloaded (``keep_alive: 0``) or given an expiry; keys
created and revoked; node drains. Faults: the store stalled or down for seconds, runners killed mid-stream,
nodes killed and restarted, a gateway cut from a node; every machine's wall clock skewed by up to ``SKEW``.

The checks (``Checks``) run after every operation and at the end; ``run(seed)`` returns what broke (an empty
list when nothing did) and the trace of operations that led there.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import logging
import math
import random
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from meshgate.gateway.auth.guard import KeyRing, authorize, mint
from meshgate.gateway.auth.keys import MemoryAccounts
from meshgate.gateway.cluster.autoscale import Autoscaler, Policy
from meshgate.gateway.cluster.instances import InstanceManager, given_up
from meshgate.gateway.cluster.loads import LoadBoard
from meshgate.gateway.cluster.records import Failed, Ready
from meshgate.gateway.serving.admission import Admission
from meshgate.gateway.serving.catalog import Catalog
from meshgate.gateway.serving.dispatch import Dispatcher
from meshgate.protocols.model import Failed as FailedEvent
from meshgate.protocols.model import Finished, GatewayError, Message, Request, StoreUnavailable, TextDelta, TextPart
from tests.sim.clock import Stalled, VirtualClock, VirtualLoop, clocks, machine, on
from tests.sim.world import MODELS, SimAccounts, SimAgent, SimBackend, World

log = logging.getLogger("meshgate.sim")

DURATION = 30.0
SETTLE = 45.0
SKEW = 5.0
GRACE = 8.0  # drain grace: every stream here is shorter (at most 40 tokens, 0.12 s each)
HEARTBEAT, NODE_TTL = 1.0, 3.0  # the settings' defaults
NODES = ("n1", "n2", "n3", "n4")
GATEWAYS = ("g1", "g2")
PROTOCOLS = ("openai", "anthropic", "ollama")


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

    async def close(self) -> None:
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
    return Gateway(name, instances, dispatcher, admission, loads, keyring)


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
    faults_at: list[float] = field(default_factory=list)  # virtual times a fault began or ended
    fault_kinds: list[str] = field(default_factory=list)  # "store" or "other", for each of ``faults_at``
    active: set[str] = field(default_factory=set)  # the faults in effect now
    starting: set[str] = field(default_factory=set)  # nodes whose agent is starting (waiting for the store)
    requests: int = 0
    finished: int = 0

    def note(self, what: str) -> None:
        self.trace.append(f"{_now():8.3f} {what}")
        log.info("%s", what)

    def fault(self, what: str) -> None:
        self.faults_at.append(_now())
        self.fault_kinds.append("store" if what.startswith("store") else "other")
        self.note(what)

    # ----------------------------------------------------------------------------------------- machines

    async def start_node(self, name: str) -> None:
        self.world.dead_nodes.discard(name)
        self.world.starts.setdefault(name, []).append(_now())
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

    # ----------------------------------------------------------------------------------------- operations

    async def client(self, gateway: Gateway, protocol: str, tokens: int, key: str | None, hang_up: int | None) -> None:
        """One request as a client sends it: the route's guard, then the stream read to its end (or hung up)."""
        self.requests += 1
        presented = {"authorization": f"Bearer {key}"} if key else {}
        connection = SimpleNamespace(
            headers=presented, client=SimpleNamespace(host="10.0.0.9"), state=SimpleNamespace(),
            app=SimpleNamespace(state=SimpleNamespace(keyring=gateway.keyring)),
        )  # fmt: skip
        handler = SimpleNamespace(opt={"scope": "inference", "limited": True})
        valid = key is not None and key in self.keys.values()
        began, faulted = _now(), bool(self.active)  # a fault in effect when it began may fail it too
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
        revoked_in_outage = key in self.revoked and ("store" in self.active or not self._store_up_since(began))
        if self.sealed and not valid and not revoked_in_outage:
            self.world.violate(f"{protocol} request with key {key!r} served by {gateway.name} after the seal")
        request = Request(
            model=self.rng.choice(list(MODELS)),
            messages=(Message(role="user", parts=(TextPart(text=f"tokens {tokens}"),)),),
            stream=True,
        )
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
            self.world.violate(f"a {protocol} stream ended {len(ends)} times: {ends}")
        elif isinstance(ends[0], Finished):
            self.finished += 1
            if text != expected:
                self.world.violate(f"a {protocol} stream finished with {text!r}, not {expected!r}")
        elif not faulted and not any(began <= at for at in self.faults_at):
            self.world.violate(f"a {protocol} stream failed with no fault since it began: {ends[0].error}")

    def _store_up_since(self, began: float) -> bool:
        return not any(
            began - 1 <= at for at, what in zip(self.faults_at, self.fault_kinds, strict=True) if what == "store"
        )

    async def step(self) -> None:
        rng, world = self.rng, self.world
        gateway = self.gateways[rng.choice(GATEWAYS)]
        roll = rng.random()
        if roll < 0.45:
            key = self._client_key()
            tokens = rng.randint(1, 40)
            hang_up = rng.randint(0, tokens) if rng.random() < 0.15 else None
            protocol = rng.choice(PROTOCOLS)
            self.note(f"request {protocol} {tokens} tokens on {gateway.name} key={key and key[:8]} hang_up={hang_up}")
            with machine(gateway.name):
                task = asyncio.create_task(self.client(gateway, protocol, tokens, key, hang_up))
            self.clients.add(task)
            task.add_done_callback(self.clients.discard)
            return
        if roll < 0.50:
            model = rng.choice(list(MODELS))
            lo = rng.randint(1, 2)
            self.note(f"deploy {model} min {lo} on {gateway.name}")
            await self._admin(gateway, gateway.instances.deploy(model, replicas=lo, min_replicas=lo, max_replicas=3))
        elif roll < 0.54:
            model = rng.choice(list(MODELS))
            lo = rng.randint(1, 2)
            self.note(f"set_bounds {model} {lo}..3 on {gateway.name}")
            await self._admin(gateway, gateway.instances.set_bounds(model, lo, 3))
        elif roll < 0.58:
            live = [i for i in gateway.instances._view.values() if not given_up(i)]
            if live:
                target = rng.choice(live)
                self.note(f"delete {target.id} on {gateway.name}")
                await self._admin(gateway, gateway.instances.delete(target.id))
        elif roll < 0.61:
            model = rng.choice(list(MODELS))
            self.note(f"unload {model} (keep_alive 0) on {gateway.name}")
            await self._admin(gateway, gateway.dispatcher.unload(model))
        elif roll < 0.64:
            await self._keys(gateway)
        elif roll < 0.68:
            url = rng.choice(sorted(u for u, r in world.launched.items() if r.alive) or [""])
            if url:
                runner = world.launched[url]
                world.killed.add(url)
                world.fault(runner.instance_id, "runner killed")
                self.fault(f"kill runner {url}")
        elif roll < 0.71 and len(self.agents) > 2:
            name = rng.choice(sorted(self.agents))
            self.fault(f"kill node {name}")
            self.active.add(f"node {name}")
            await self.kill_node(name)
            asyncio.get_running_loop().call_later(rng.uniform(3, 15), self._restart, name)
        elif roll < 0.73 and len(self.agents) > 2:
            name = rng.choice(sorted(self.agents))
            self.note(f"drain node {name}")
            agent = self.agents.pop(name)
            world.draining.add(name)
            world.drain_ends[name] = _now() + GRACE
            with machine(name):
                draining = asyncio.create_task(agent.drain(GRACE, margin=2.0))
            draining.add_done_callback(lambda _: asyncio.get_running_loop().call_later(2.0, self._restart, name))
        elif roll < 0.77:
            node = rng.choice(NODES)
            self.fault(f"cut {gateway.name} from {node}")
            world.cut.add((gateway.name, node))
            self.active.add(f"cut {gateway.name} {node}")
            world.cut_healed[(gateway.name, node)] = math.inf
            asyncio.get_running_loop().call_later(rng.uniform(1, 10), self._heal_cut, gateway.name, node)
        elif roll < 0.80:
            seconds = rng.uniform(0.5, 12)
            self.fault(f"store stalled {seconds:.1f}s")
            world.store.stall(seconds)
            self.active.add("store")
            asyncio.get_running_loop().call_later(seconds, self._store_back, "store answers again")
        elif roll < 0.82:
            seconds = rng.uniform(0.5, 8)
            self.fault(f"store down {seconds:.1f}s")
            world.store.down(seconds)
            self.active.add("store")
            asyncio.get_running_loop().call_later(seconds, self._store_back, "store back")
        else:
            return  # a quiet moment

    @staticmethod
    def _store_now() -> float:
        with machine("store"):
            return time.monotonic()

    def _restart(self, name: str) -> None:
        self.active.discard(f"node {name}")
        if name not in self.agents and name not in self.starting:
            self.starting.add(name)
            self.world.draining.discard(name)
            self.world.drain_ends.pop(name, None)
            self.note(f"node {name} starts again")
            asyncio.ensure_future(self.start_node(name))

    def _store_back(self, what: str) -> None:
        store = self.world.store
        if max(store.stalled_until, store.down_until) <= self._store_now():
            self.active.discard("store")
        self.fault(what)

    def _heal_cut(self, gateway: str, node: str) -> None:
        self.world.cut.discard((gateway, node))
        self.active.discard(f"cut {gateway} {node}")
        self.world.cut_healed[(gateway, node)] = _now()
        self.fault(f"{gateway} reaches {node} again")

    def _client_key(self) -> str | None:
        roll = self.rng.random()
        if roll < 0.8 and self.keys:
            return self.rng.choice(sorted(self.keys.values()))
        if roll < 0.9 and self.revoked:
            return self.rng.choice(self.revoked)
        if roll < 0.95:
            return "mg_nosuchkey_abcdefgh"
        return None

    async def _keys(self, gateway: Gateway) -> None:
        if self.keys and self.rng.random() < 0.3:
            key_id = self.rng.choice(sorted(self.keys))
            self.note(f"revoke key {key_id} on {gateway.name}")
            with contextlib.suppress(GatewayError):
                with machine(gateway.name):
                    if await gateway.keyring.accounts.delete_key(key_id):
                        self.revoked.append(self.keys.pop(key_id))
            return
        key, record = mint(f"k{len(self.keys)}", scope="inference")
        self.note(f"create key {record.id} on {gateway.name}")
        with contextlib.suppress(GatewayError):
            with machine(gateway.name):
                await gateway.keyring.accounts.put_key(record)
            self.keys[record.id] = key
            self.sealed = True

    async def _admin(self, gateway: Gateway, call: Any) -> None:
        try:
            with machine(gateway.name):
                await call
        except GatewayError as exc:
            self.note(f"  -> {type(exc).__name__}: {exc}")

    # ----------------------------------------------------------------------------------------- the end

    def check_end(self) -> None:
        world = self.world
        instances = [i for i in (world.store.inner._instances.values())]
        from meshgate.gateway.cluster.store import _instance  # the store's own decoder

        stored = [_instance.decode(raw) for raw in instances]
        deployments = {d.model: d for d in _decode_deployments(world)}
        for model, deployment in deployments.items():
            if not deployment.min_replicas <= deployment.replicas <= deployment.max_replicas:
                world.violate(f"{model}: {deployment.replicas} replicas outside {deployment.min_replicas}..")
            ready = [i for i in stored if i.model == model and isinstance(i.state, Ready)]
            if len(ready) < deployment.replicas:
                world.violate(
                    f"{model}: {len(ready)} ready of {deployment.replicas} after {SETTLE:.0f}s healed: "
                    + ", ".join(f"{i.id} {type(i.state).__name__} attempts {i.attempts}" for i in stored)
                )
        ids = {i.id for i in stored}
        for gateway in self.gateways.values():
            for instance_id, load in gateway.admission.loads().items():
                if load.active or load.queued:
                    world.violate(f"{gateway.name}: {load.active} slots, {load.queued} queued on {instance_id} at rest")
                if instance_id not in ids:
                    world.violate(f"{gateway.name}: admission still keeps {instance_id}, which is gone")
            for instance_id in gateway.loads._tallies:
                if instance_id not in ids:
                    world.violate(f"{gateway.name}: the load board still keeps {instance_id}, which is gone")
        failed = [i for i in stored if isinstance(i.state, Failed)]
        for instance in failed:
            world.violate(f"{instance.id} still failed after the cluster healed: {instance.state.reason}")


def _decode_deployments(world: World) -> list[Any]:
    from meshgate.gateway.cluster.store import _deployment

    return [_deployment.decode(raw) for raw in world.store.inner._deployments.values()]


def _now() -> float:
    """The true (virtual) time, which no machine's clock shows exactly."""
    return asyncio.get_running_loop().time()


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
    shared = MemoryAccounts()
    for name in NODES:
        await episode.start_node(name)
    for name in GATEWAYS:
        with machine(name):
            episode.gateways[name] = await _gateway(world, name, shared)
    end = clock.time() + DURATION
    while clock.time() < end and not world.violations:
        await asyncio.sleep(rng.expovariate(2.0))
        await episode.step()
    episode.note("heal: every fault ends, every node starts again")
    world.store.heal()
    for pair in world.cut:
        world.cut_healed[pair] = _now()
    world.cut.clear()
    for name in NODES:
        if name not in world.draining:  # a draining node starts again once its drain ends
            episode._restart(name)
    await asyncio.sleep(SETTLE)
    if episode.clients:
        world.violate(f"{len(episode.clients)} requests still open {SETTLE:.0f}s after the cluster healed")
    episode.check_end()
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
