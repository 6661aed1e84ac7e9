"""Each ready replica's KV tier, as its head runner last reported it (``KvTiers``): for ``/metrics``,
``/instances`` and ``meshgate ps``.

One background task per gateway (``start``) reads every ``EVERY`` seconds the ``/health`` of each ready instance's
head runner, through ``health_of`` (``gateway.serving.runner_health``: the connection the dispatcher uses), all
at once, each for at most ``TIMEOUT`` seconds. A pass with no ready instance sends nothing. The figures live in
memory, by instance id, never in the state store (each gateway polls for itself: a few small GETs every few
seconds per gateway). Each runner also lists the prefix keys (``protocols.prefix``) of the entries its tier holds,
most recently used first: ``holding(key)`` tells routing which replicas hold a request's start (``routing.route``'s
``tier`` rule). What a pass does with what it read is a pure function (``merge``):

* a runner that answered with a ``kv_tier``: its new figures;
* one that answered without (no tier) or cannot report at all (``health_of`` gives ``None``): no figures;
* one that failed or timed out: its last figures stay;
* an instance that is neither ready nor draining (gone, failed, being re-placed): its figures are dropped.

After a pass, each instance with a tier is told its peers (``peers``: the other instances of its model with a tier, by
their head runners' URLs, with the measured link from its head node to theirs), when they changed since it was last told
or ``RETELL`` seconds ago (a runner that restarted has forgotten them), with their nodes and its own: runners fetch
prompt states from their peers' tiers when that beats prefilling them, and copy each entry they make to one peer on
another node, so a node's death loses no prompt (``backends.runner.kvpeers``). A replica told its peers for the first
time warms itself: it fetches the ``WARM`` entries a peer used last, before they are asked for (a new replica, added by
the autoscaler or re-placed, starts with the deployment's hot prefixes); until its runner says it is done (watched every
``WATCH`` seconds, for ``WARM_LIMIT`` seconds at most) it is ``cold``: routing sends it nothing while another replica of
its model is ready. A pass runs as soon as a new instance is ready, not only every ``EVERY`` seconds, so a new replica
is told at once. A replica seen draining hands its sessions over: every ready replica of its model with a tier fetches
the ``WARM`` entries it used last, while it finishes its streams, so their next turns find them.

Imports the records and ``telemetry.kv_tier``; the health source is given, so this room never imports serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence

from meshgate.backends.placement import Link
from meshgate.gateway.cluster.records import Draining, Instance, Ready
from meshgate.gateway.telemetry.kv_tier import KvTier, kv_tier_of

__all__ = ["EVERY", "TIMEOUT", "WARM_LIMIT", "HealthOf", "KvTiers", "Read", "TellPeers", "merge", "peer_lists"]

log = logging.getLogger("meshgate.kv_tiers")

EVERY = 5.0
"""Seconds between two passes."""
TIMEOUT = 2.0
"""Seconds one runner's ``/health`` may take before its last figures are kept instead."""

SAME_NODE = 2e9
"""Bytes/second taken for two runners of one node (loopback)."""
RETELL = 60.0
"""Seconds after which a runner is told its peers again though they did not change."""

HealthOf = Callable[[Instance], Awaitable[Mapping[str, object] | None]]
TellPeers = Callable[[Instance, str, dict[str, object]], Awaitable[None]]
"""Tell an instance's head runner's KV tier something (``peers``, ``warm``: ``backends.runner.kv_routes``); may
raise."""
WARM = 16
"""Entries a new replica fetches from a peer, and each staying replica from a draining one: the most recently used."""
WARM_LIMIT = 60.0
"""Seconds a new replica's warm-up may keep routing away from it."""
WATCH = 0.5
"""Seconds between two looks at a warming replica's runner, and at the view for new ready instances."""
"""An instance's head runner's ``/health`` answer; ``None`` when its runner cannot report one. May raise."""

Read = tuple[str, KvTier | None, bool]
"""What a pass read of one instance: its id, its figures (``None``: it has no tier) and whether the read
succeeded (``False``: it failed or timed out; the figures are then ignored)."""


def merge(last: Mapping[str, KvTier], kept: Collection[str], reads: Iterable[Read]) -> dict[str, KvTier]:
    """The figures after a pass: ``last`` with what ``reads`` found (the module docstring's rules), for the
    instances in ``kept`` (ready or draining) only."""
    figures = {instance_id: tier for instance_id, tier in last.items() if instance_id in kept}
    for instance_id, tier, ok in reads:
        if not ok:
            continue
        if tier is None or instance_id not in kept:
            figures.pop(instance_id, None)
        else:
            figures[instance_id] = tier
    return figures


class KvTiers:
    """The KV tier figures of every ready instance this gateway can reach, polled (``start``) or read once
    (``poll``); ``instances`` gives this gateway's view of the instances (``InstanceCache.snapshot``)."""

    def __init__(
        self,
        instances: Callable[[], Sequence[Instance]],
        health_of: HealthOf,
        *,
        every: float = EVERY,
        timeout: float = TIMEOUT,
        tell: TellPeers | None = None,
        links: Callable[[], Awaitable[Sequence[Link]]] | None = None,
    ) -> None:
        self.instances = instances
        self.health_of = health_of
        self.tell, self.links = tell, links
        self._told: dict[str, tuple[list[dict[str, object]], float]] = {}
        self._heard: dict[str, frozenset[bytes]] = {}  # what this pass read, before ``merge`` says who is kept
        self._handed: set[str] = set()  # draining instances whose entries the staying replicas were told to fetch
        self.every = every
        self.timeout = timeout
        self._figures: dict[str, KvTier] = {}
        self._prefixes: dict[str, frozenset[bytes]] = {}  # instance id -> prefix keys its tier's entries hold
        self._task: asyncio.Task[None] | None = None
        self._warming: dict[str, asyncio.Task[None]] = {}  # new replicas warming up, by instance id
        self._ready: frozenset[str] = frozenset()  # the ready instances of the last pass

    def cold(self, instance_ids: Collection[str]) -> set[str]:
        """Those of ``instance_ids`` still warming up as new replicas (routing sends them nothing while another
        replica is ready)."""
        return {i for i in instance_ids if i in self._warming}

    def get(self, instance_id: str) -> KvTier | None:
        """``instance_id``'s figures as last read; ``None`` when there are none."""
        return self._figures.get(instance_id)

    def holding(self, key: bytes) -> frozenset[str]:
        """The instances whose runner's tier last said it holds entries of prefix ``key`` (routing's ``tier``)."""
        return frozenset(i for i, keys in self._prefixes.items() if key in keys)

    def figures(self) -> dict[str, KvTier]:
        """Every instance's figures as last read, by instance id (a copy)."""
        return dict(self._figures)

    async def poll(self) -> None:
        """One pass: read every ready instance's runner at once, then ``merge``."""
        ready = [i for i in self.instances() if isinstance(i.state, Ready)]
        self._ready = frozenset(i.id for i in ready)
        reads = await asyncio.gather(*(self._read(i) for i in ready)) if ready else []
        kept = {i.id for i in self.instances() if isinstance(i.state, Ready | Draining)}  # as of now, after reads
        self._figures = merge(self._figures, kept, reads)
        self._prefixes = {i: keys for i, keys in self._prefixes.items() if i in self._figures}
        for instance_id, _, ok in reads:
            if ok and instance_id in self._figures:
                self._prefixes[instance_id] = self._heard.pop(instance_id, frozenset())
        self._heard.clear()
        if self.tell is not None:
            await self._tell_peers(ready)

    async def _tell_peers(self, ready: Sequence[Instance]) -> None:
        try:
            links = list(await self.links()) if self.links is not None else []
        except Exception:  # the store is away: the links are unknown, not the peers
            links = []
        lists = peer_lists([i for i in ready if i.id in self._figures], links)
        now = asyncio.get_running_loop().time()
        self._told = {i: told for i, told in self._told.items() if i in lists}
        due = [i for i in ready if i.id in lists and _due(self._told.get(i.id), lists[i.id], now)]
        told = await asyncio.gather(
            *(self._tell(i, "peers", {"peers": lists[i.id], "node": _head_node(i)}) for i in due)
        )
        warm = []
        new = []
        for instance, ok in zip(due, told, strict=True):
            if ok and instance.id not in self._told and lists[instance.id]:  # new: warm it from a peer
                warm.append((instance, {"url": lists[instance.id][0]["url"], "count": WARM}))
                new.append(instance.id)
            if ok:
                self._told[instance.id] = (lists[instance.id], now)
        for draining in self.instances():
            if (
                isinstance(draining.state, Draining)
                and draining.id in self._figures
                and draining.id not in self._handed
            ):
                self._handed.add(draining.id)
                head = _head(draining)
                stay = [i for i in ready if i.model == draining.model and i.id in lists]
                warm += [(i, {"url": head[1], "count": WARM}) for i in stay if head is not None]
        self._handed &= {i.id for i in self.instances()}
        warmed = await asyncio.gather(*(self._tell(instance, "warm", body) for instance, body in warm))
        for (instance, _), ok in zip(warm, warmed, strict=True):
            if ok and instance.id in new and instance.id not in self._warming:
                self._warming[instance.id] = asyncio.create_task(self._watch(instance), name="kv-warm-watch")

    async def _watch(self, instance: Instance) -> None:
        """Until ``instance``'s runner says its warm-up is over (or ``WARM_LIMIT``), it stays ``cold``."""
        try:
            async with asyncio.timeout(WARM_LIMIT):
                while True:
                    await asyncio.sleep(WATCH)
                    try:
                        async with asyncio.timeout(self.timeout):
                            health = await self.health_of(instance)
                    except Exception:  # not read this time: look again
                        continue
                    tier = health.get("kv_tier") if health is not None else None
                    if not isinstance(tier, Mapping) or not tier.get("warming"):
                        return
        except TimeoutError:
            log.info("instance %s still warming after %.0f s: routing to it anyway", instance.id, WARM_LIMIT)
        finally:
            self._warming.pop(instance.id, None)

    async def _tell(self, instance: Instance, action: str, body: dict[str, object]) -> bool:
        assert self.tell is not None
        try:
            async with asyncio.timeout(self.timeout):
                await self.tell(instance, action, body)
        except Exception as exc:
            log.debug("instance %s not told %s: %r", instance.id, action, exc)
            return False
        return True

    async def _read(self, instance: Instance) -> Read:
        try:
            async with asyncio.timeout(self.timeout):
                health = await self.health_of(instance)
        except Exception as exc:  # unreachable, slow, refused, garbage: the last figures stay
            log.debug("KV tier of instance %s not read: %r", instance.id, exc)
            return instance.id, None, False
        tier = health.get("kv_tier") if health is not None else None
        if isinstance(tier, Mapping) and isinstance(tier.get("prefixes"), list):
            self._heard[instance.id] = frozenset(_key(k) for k in tier["prefixes"] if isinstance(k, str))
        return instance.id, kv_tier_of(health) if health is not None else None, True

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="kv-tiers")

    async def close(self) -> None:
        for task in [self._task, *self._warming.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = None

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(min(WATCH, self.every))
            ready = {i.id for i in self.instances() if isinstance(i.state, Ready)}
            if loop.time() - last < self.every and ready <= self._ready:
                continue  # not due, and no instance became ready since the last pass
            last = loop.time()
            try:
                await self.poll()
            except Exception:  # the view could not be read: the next pass tries again
                log.debug("KV tier poll failed", exc_info=True)


def peer_lists(tiered: Sequence[Instance], links: Sequence[Link]) -> dict[str, list[dict[str, object]]]:
    """For each instance of ``tiered`` (ready, with a KV tier), the other ones of its model as its runner's peers:
    their head runner's URL, and the bandwidth and latency measured from its head node to theirs (two runners of
    one node: ``SAME_NODE``, no latency; a link not measured: 0, the runner's own assumption)."""
    measured: dict[tuple[str, str], Link] = {(link.src, link.dst): link for link in links}
    heads = {i.id: head for i in tiered if (head := _head(i)) is not None}
    lists: dict[str, list[dict[str, object]]] = {}
    for instance in tiered:
        if instance.id not in heads:
            continue
        node, _ = heads[instance.id]
        peers: list[dict[str, object]] = []
        for other in tiered:
            if other.id == instance.id or other.model != instance.model or other.id not in heads:
                continue
            peer_node, url = heads[other.id]
            link = measured.get((node, peer_node))
            bandwidth = SAME_NODE if peer_node == node else (link.bandwidth if link else 0.0)
            peers.append(
                {"url": url, "bandwidth": bandwidth, "latency": link.latency if link else 0.0, "node": peer_node}
            )
        lists[instance.id] = peers
    return lists


def _head(instance: Instance) -> tuple[str, str] | None:
    """The node and URL of ``instance``'s head runner (its first layers' first rank), if it reported one."""
    for shard in instance.placement.shards:
        if shard.layer_start == 0 and shard.tensor_rank == 0:
            status = instance.runners.get(shard.node_id)
            return (shard.node_id, status.url) if status is not None and status.url else None
    return None


def _head_node(instance: Instance) -> str:
    head = _head(instance)
    return head[0] if head is not None else ""


def _due(told: tuple[list[dict[str, object]], float] | None, peers: list[dict[str, object]], now: float) -> bool:
    return told is None or told[0] != peers or now - told[1] >= RETELL


def _key(text: str) -> bytes:
    try:
        return bytes.fromhex(text)
    except ValueError:
        return b""
