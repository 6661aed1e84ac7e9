"""The cluster's state store: nodes, links, instances, the audit event stream and change notifications.

One interface (``StateStore``), two implementations: ``MemoryStore`` here, the embedded default for a gateway on
one machine, and ``redis_store.RedisStore``, shared by several gateway replicas and node agents (its Redis keys
and scripts are there). Values are ``msgspec.json`` (never pickle); the codecs (``encode``, ``*_json``), the load
ages and the watchers' fan-out are shared by both.

Decisions:
    * State lives in keys, never in pub/sub: notifications only say "look again", so a lost message costs a
      stale cache, not lost state. With AOF on, instances, links, events, the generation and the incarnation
      survive a restart; without it, ``recovery`` says what each process puts back.
    * A new watcher first yields every kind once (read everything now), and does so again whenever its Redis
      subscription is re-established, since messages sent while disconnected are lost. Wake-ups of one kind
      coalesce while unread. Consumers re-read on a wake-up; they never count them.
    * A node whose TTL passes disappears from ``nodes()`` at once, but nothing is published then: the next
      ``nodes()``/``links()`` call prunes the index, drops that node's links and publishes "nodes" and "links".
      A cache keyed on ``generation()`` must therefore be re-read at least once per heartbeat TTL.
    * ``links()`` returns only links whose two ends are live nodes; the others stay stored until their node is
      pruned or removed, so a link put just before its node registers is not lost.
    * Compare-and-set (``set_state``, ``update_instance``) and runner reports (``update_runner``) are Lua
      scripts, atomic on the server; ``update_runner`` never re-creates a deleted instance. Every change of an
      existing instance record is conditional on the state and epoch its writer read (``update_instance``), so a
      write made from a stale read (an expiry set while another gateway fails or re-places the instance) is
      refused, never reverts the newer state; ``put_instance`` is for a new record.
    * ``MemoryStore`` keeps encoded bytes too, so both implementations hand out fresh objects and behave alike.
    * Audit events are not state: appending one bumps no generation and wakes no watcher.

Imports msgspec, ``backends.placement``, the records and the protocols' errors; nothing imports this but the gateway.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Protocol, TypeVar, runtime_checkable

import msgspec

from meshgate.backends.placement import InstanceId, Link, Node, NodeId
from meshgate.gateway.cluster.records import (
    Deployment,
    Instance,
    InstanceState,
    LoadReport,
    RunnerStatus,
    StoreEvent,
    state_tag,
)

__all__ = ["KINDS", "LOAD_FORGET", "LOAD_STALE", "MAX_EVENTS", "LoadAges", "MemoryStore", "StateStore", "Watchers"]

log = logging.getLogger(__name__)
T = TypeVar("T")

KINDS = ("nodes", "links", "instances")
MAX_EVENTS = 10_000
LOAD_STALE = 2.0
"""Seconds after which a gateway's load report no longer counts (it stopped, or lost Redis)."""
LOAD_FORGET = 30.0
"""Seconds after which a reader deletes a stale load report."""

encode = msgspec.json.Encoder().encode
node_json = msgspec.json.Decoder(Node)
link_json = msgspec.json.Decoder(Link)
instance_json = msgspec.json.Decoder(Instance)
state_json = msgspec.json.Decoder(InstanceState)
runner_json = msgspec.json.Decoder(RunnerStatus)
event_json = msgspec.json.Decoder(StoreEvent)
ends_json = msgspec.json.Decoder(tuple[str, str])
deployment_json = msgspec.json.Decoder(Deployment)
load_json = msgspec.json.Decoder(LoadReport)


class LoadAges:
    """How old each load report is, by this reader's own clock: gateways on other machines stamp their reports
    with their wall clocks, which may be off from this one's by any amount. A report is as old as the time since
    this reader last saw its stamp change; one seen for the first time is dated by its stamp against this
    machine's wall clock (a guess, corrected by the next change, at most ``LOAD_STALE`` seconds later)."""

    def __init__(self) -> None:
        self._changed: dict[str, tuple[float, float]] = {}  # field -> (its stamp, monotonic time it was seen new)

    def fresh(self, fields: Iterable[tuple[str, bytes]]) -> tuple[dict[str, list[LoadReport]], list[str]]:
        """Load reports by instance id (fresh ones only), and the fields old enough to delete."""
        wall, mono = time.time(), time.monotonic()
        found: dict[str, list[LoadReport]] = {}
        forget = []
        seen: dict[str, tuple[float, float]] = {}
        for field, value in fields:
            report = load_json.decode(value)
            known = self._changed.get(field)
            if known is not None and known[0] == report.at:
                seen[field] = known
            elif known is not None:
                seen[field] = (report.at, mono)
            else:
                seen[field] = (report.at, mono - min(max(0.0, wall - report.at), LOAD_FORGET + 1))
            age = mono - seen[field][1]
            if age <= LOAD_STALE:
                found.setdefault(field.split(" ", 1)[0], []).append(report)
            elif age > LOAD_FORGET:
                forget.append(field)
        self._changed = seen
        return found, forget


@runtime_checkable
class StateStore(Protocol):
    """Cluster state shared by gateways and node agents. Every method is safe to call concurrently.

    ``unavailable_at`` is the monotonic time a call last failed with ``StoreUnavailable``, or took more than half
    the timeout (``-inf``: never): while the store was away or stalled it let the nodes whose heartbeats could not
    reach it lapse (``InstanceManager``)."""

    unavailable_at: float

    async def put_node(self, node: Node, ttl: float) -> None:
        """Register or refresh ``node``; it vanishes from ``nodes()`` ``ttl`` seconds after the last refresh."""

    async def nodes(self) -> list[Node]:
        """Live nodes, by id."""

    async def remove_node(self, node_id: NodeId) -> bool:
        """Forget a node (a clean shutdown) and its links. True if it was registered."""

    async def put_link(self, link: Link) -> None:
        """Store the latest measurement of ``link.src`` -> ``link.dst``."""

    async def links(self) -> list[Link]:
        """Links whose two ends are live nodes, by (src, dst)."""

    async def put_instance(self, inst: Instance, *, if_absent: bool = False) -> bool:
        """Create or replace an instance whole, runner reports included; ``if_absent``: only where no record of its
        id is stored (what a gateway republishes into a store that restarted empty). True if written."""

    async def get_instance(self, instance_id: InstanceId) -> Instance | None:
        """The instance with its latest state and runner reports, or None."""

    async def instances(self) -> list[Instance]:
        """Every instance, oldest first."""

    async def delete_instance(self, instance_id: InstanceId) -> bool:
        """Delete an instance. True if it existed."""

    async def update_runner(self, instance_id: InstanceId, status: RunnerStatus) -> bool:
        """Record one node's runner status; False (and nothing stored) if the instance does not exist."""

    async def set_state(
        self, instance_id: InstanceId, state: InstanceState, *, expected: type | None = None, epoch: int | None = None
    ) -> bool:
        """Set the state if the instance exists and (when given) its state is of class ``expected`` and its record
        is of ``epoch``."""

    async def update_instance(self, inst: Instance, *, expected: type, epoch: int, runners: bool = False) -> bool:
        """Write ``inst``'s record and state if the stored instance's state is of class ``expected`` and its record
        is of ``epoch`` (what the writer read); ``runners``: its runner reports become ``inst.runners`` (a
        re-placement clears them), else they stay as stored. False, and nothing written, otherwise."""

    async def append_event(
        self,
        kind: str,
        message: str,
        *,
        instance_id: str | None = None,
        node_id: str | None = None,
        data: dict[str, str] | None = None,
    ) -> StoreEvent:
        """Append to the audit stream (the newest ``MAX_EVENTS`` or so are kept)."""

    async def events(self, since: str | None = None, count: int = 100) -> list[StoreEvent]:
        """Up to ``count`` events after the event id ``since`` (from the oldest kept when None), oldest first."""

    async def generation(self) -> int:
        """A counter bumped by every change of nodes, links or instances."""

    async def incarnation(self) -> str:
        """Which store this is: a random token, made (and stored) by the first call that finds none. A store that
        restarted empty, was flushed or failed over to an empty replica has a new one; one restarted from its
        append-only file keeps it. A process that saw another one before knows the store lost what it held."""

    async def put_deployment(self, deployment: Deployment, *, if_absent: bool = False) -> bool:
        """Create or replace ``deployment.model``'s deployment (``if_absent``: only create). True if written."""

    async def deployments(self) -> list[Deployment]:
        """Every deployment, by model."""

    async def delete_deployment(self, model: str) -> bool:
        """Forget ``model``'s deployment. True if it existed."""

    async def put_loads(self, gateway_id: str, reports: dict[str, LoadReport], gone: Iterable[str] = ()) -> None:
        """Publish this gateway's load on each instance (by id); drop its reports on the instances in ``gone``."""

    async def loads(self) -> dict[str, list[LoadReport]]:
        """Every gateway's fresh load report, by instance id (reports older than ``LOAD_STALE`` are left out)."""

    async def claim(self, name: str, holder: str, ttl: float) -> bool:
        """Take the lease ``name`` for ``ttl`` seconds unless another holder has it (its holder renews it): True if
        ``holder`` has it now."""

    async def release(self, name: str, holder: str) -> bool:
        """Give the lease ``name`` up if ``holder`` has it: True if it did."""

    async def cluster_secret(self, proposed: str, *, held: bool = False) -> str:
        """The cluster's secret: the one stored, else ``proposed``, stored now (the first caller's wins).

        A secret stored by a caller that does not hold it yet (``held`` False: a gateway, an agent that just
        started) is *provisional*. A caller whose running runners already demand ``proposed`` (``held``: a node
        agent, at every heartbeat) confirms it when stored, stores it when the store lost it, and replaces a
        provisional other one: after a store restarted empty, the secret the running processes hold wins over one
        a gateway started meanwhile made up. A confirmed other secret is returned as it is."""

    def watch(self) -> AsyncIterator[str]:
        """Wake-ups: the kinds ("nodes", "links", "instances") that changed. Ends when the store closes."""

    async def close(self) -> None:
        """Release connections and end every watcher."""


class Watchers:
    """Fan-out of wake-ups: per watcher, an event and its pending kinds (coalesced, in arrival order)."""

    def __init__(self) -> None:
        self.boxes: dict[asyncio.Event, dict[str, None]] = {}
        self.closed = False

    def notify(self, *kinds: str) -> None:
        for wake, pending in self.boxes.items():
            pending.update(dict.fromkeys(kinds))
            wake.set()

    def close(self) -> None:
        self.closed = True
        self.notify()  # wakes every watcher, which then ends

    async def stream(self, ready: Callable[[], Awaitable[object]]) -> AsyncIterator[str]:
        wake, pending = asyncio.Event(), dict.fromkeys(KINDS)
        self.boxes[wake] = pending
        try:
            await ready()
            while not self.closed:
                if pending:
                    kind = next(iter(pending))
                    del pending[kind]
                    yield kind
                else:
                    wake.clear()
                    await wake.wait()
        finally:
            del self.boxes[wake]


class MemoryStore:
    """The embedded store: one process, no Redis. Expiry uses the monotonic clock."""

    unavailable_at = -math.inf  # in this process: never away

    def __init__(self) -> None:
        self._nodes: dict[str, tuple[bytes, float]] = {}
        self._links: dict[tuple[str, str], bytes] = {}
        self._instances: dict[str, bytes] = {}
        self._events: deque[tuple[tuple[int, int], bytes]] = deque(maxlen=MAX_EVENTS)
        self._last_id = (0, 0)
        self._generation = 0
        self._incarnation = uuid.uuid4().hex
        self._secret: str | None = None
        self._provisional = False
        self._deployments: dict[str, bytes] = {}
        self._loads: dict[str, bytes] = {}
        self._claims: dict[str, tuple[str, float]] = {}
        self._ages = LoadAges()
        self._watchers = Watchers()

    def _changed(self, *kinds: str) -> None:
        self._generation += 1
        self._watchers.notify(*kinds)

    def _live(self) -> dict[str, bytes]:
        now = time.monotonic()
        self._drop([node_id for node_id, (_, deadline) in self._nodes.items() if deadline <= now])
        return {node_id: value for node_id, (value, _) in self._nodes.items()}

    def _drop(self, node_ids: Iterable[str]) -> bool:
        gone = {node_id for node_id in node_ids if self._nodes.pop(node_id, None) is not None}
        if gone:
            self._links = {ends: value for ends, value in self._links.items() if gone.isdisjoint(ends)}
            self._changed("nodes", "links")
        return bool(gone)

    async def put_node(self, node: Node, ttl: float) -> None:
        self._nodes[node.id] = (encode(node), time.monotonic() + ttl)
        self._changed("nodes")

    async def nodes(self) -> list[Node]:
        return [node_json.decode(value) for _, value in sorted(self._live().items())]

    async def remove_node(self, node_id: NodeId) -> bool:
        return self._drop([node_id])

    async def put_link(self, link: Link) -> None:
        self._links[(link.src, link.dst)] = encode(link)
        self._changed("links")

    async def links(self) -> list[Link]:
        live = self._live()
        return [
            link_json.decode(value) for (src, dst), value in sorted(self._links.items()) if src in live and dst in live
        ]

    async def put_instance(self, inst: Instance, *, if_absent: bool = False) -> bool:
        if if_absent and inst.id in self._instances:
            return False
        self._instances[inst.id] = encode(inst)
        self._changed("instances")
        return True

    async def get_instance(self, instance_id: InstanceId) -> Instance | None:
        value = self._instances.get(instance_id)
        return None if value is None else instance_json.decode(value)

    async def instances(self) -> list[Instance]:
        return sorted((instance_json.decode(v) for v in self._instances.values()), key=lambda i: (i.created_at, i.id))

    async def delete_instance(self, instance_id: InstanceId) -> bool:
        if existed := (self._instances.pop(instance_id, None) is not None):
            self._changed("instances")
        return existed

    async def update_runner(self, instance_id: InstanceId, status: RunnerStatus) -> bool:
        inst = await self.get_instance(instance_id)
        return inst is not None and self._replace(inst, runners={**inst.runners, status.node_id: status})

    async def set_state(
        self, instance_id: InstanceId, state: InstanceState, *, expected: type | None = None, epoch: int | None = None
    ) -> bool:
        tag = None if expected is None else state_tag(expected)
        inst = await self.get_instance(instance_id)
        if inst is None or (tag is not None and state_tag(inst.state) != tag):
            return False
        if epoch is not None and inst.epoch != epoch:
            return False
        return self._replace(inst, state=state, updated_at=time.time())

    async def update_instance(self, inst: Instance, *, expected: type, epoch: int, runners: bool = False) -> bool:
        current = await self.get_instance(inst.id)
        if current is None or state_tag(current.state) != state_tag(expected) or current.epoch != epoch:
            return False
        return self._replace(inst, runners=inst.runners if runners else current.runners)

    def _replace(self, inst: Instance, **changes: object) -> bool:
        self._instances[inst.id] = encode(msgspec.structs.replace(inst, **changes))
        self._changed("instances")
        return True

    async def append_event(
        self,
        kind: str,
        message: str,
        *,
        instance_id: str | None = None,
        node_id: str | None = None,
        data: dict[str, str] | None = None,
    ) -> StoreEvent:
        at = time.time()
        ms, seq = self._last_id
        self._last_id = (ms, seq + 1) if int(at * 1000) <= ms else (int(at * 1000), 0)
        event = StoreEvent(f"{self._last_id[0]}-{self._last_id[1]}", at, kind, instance_id, node_id, message, data)
        self._events.append((self._last_id, encode(event)))
        return event

    async def events(self, since: str | None = None, count: int = 100) -> list[StoreEvent]:
        after = (-1, -1) if since is None else tuple(int(part) for part in f"{since}-0".split("-")[:2])
        found = (value for key, value in self._events if key > after)
        return [event_json.decode(value) for value in itertools.islice(found, count)]

    async def generation(self) -> int:
        return self._generation

    async def incarnation(self) -> str:
        return self._incarnation

    async def cluster_secret(self, proposed: str, *, held: bool = False) -> str:
        if self._secret is None or (held and self._provisional):
            self._secret, self._provisional = proposed, not held
        elif held and self._secret == proposed:
            self._provisional = False
        return self._secret

    async def put_deployment(self, deployment: Deployment, *, if_absent: bool = False) -> bool:
        if if_absent and deployment.model in self._deployments:
            return False
        self._deployments[deployment.model] = encode(deployment)
        self._changed("instances")
        return True

    async def deployments(self) -> list[Deployment]:
        return [deployment_json.decode(v) for _, v in sorted(self._deployments.items())]

    async def delete_deployment(self, model: str) -> bool:
        if existed := (self._deployments.pop(model, None) is not None):
            self._changed("instances")
        return existed

    async def put_loads(self, gateway_id: str, reports: dict[str, LoadReport], gone: Iterable[str] = ()) -> None:
        for instance_id in gone:
            self._loads.pop(f"{instance_id} {gateway_id}", None)
        self._loads.update({f"{i} {gateway_id}": encode(report) for i, report in reports.items()})

    async def loads(self) -> dict[str, list[LoadReport]]:
        found, forget = self._ages.fresh(self._loads.items())
        for field in forget:
            del self._loads[field]
        return found

    async def claim(self, name: str, holder: str, ttl: float) -> bool:
        now = time.monotonic()
        current = self._claims.get(name)
        if current is None or current[1] <= now or current[0] == holder:
            self._claims[name] = (holder, now + ttl)
            return True
        return False

    async def release(self, name: str, holder: str) -> bool:
        current = self._claims.get(name)
        if current is None or current[0] != holder:
            return False
        del self._claims[name]
        return True

    def watch(self) -> AsyncIterator[str]:
        return self._watchers.stream(lambda: asyncio.sleep(0))

    async def close(self) -> None:
        self._watchers.close()
