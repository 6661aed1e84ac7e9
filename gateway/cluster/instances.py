"""Instances: creating placements, watching them come up, failing and re-placing them when nodes leave.

``InstanceManager`` is the gateway's side of the control plane. It plans with the pure planner over a topology
snapshot, stores the chosen candidate as an ``Instance`` (state ``Starting``), and lets node agents start the
shards. Its reconcile loop (in every gateway; compare-and-set on state keeps two gateways from acting twice)
moves an instance to ``Ready`` when every shard's runner reports ready, to ``Failed(reason)`` when a node
leaves or a runner fails, and re-places a failed instance on the nodes that remain when it fits.

The hot path (``ready``) reads a cached view that is refreshed only when the store says something changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence

import msgspec

from meshgate.backends.base import Backend, ModelCard
from meshgate.backends.placement import Candidate, InstanceId, NodeId, Topology
from meshgate.gateway.cluster.planner import BackendOffer, plan
from meshgate.gateway.cluster.records import Failed, Instance, Ready, Starting
from meshgate.gateway.cluster.store import StateStore
from meshgate.protocols.model import BackendUnavailable, NoCapacity, NotFound

__all__ = ["InstanceManager"]

log = logging.getLogger("meshgate.instances")
MAX_ATTEMPTS = 3


class InstanceManager:
    """Plans, creates, watches and re-places instances; keeps a cached view for the request path."""

    def __init__(
        self,
        store: StateStore,
        backends: Sequence[Backend],
        *,
        resolve: Callable[[str], ModelCard],
        choose: Callable[..., Backend | None],
        rank: Callable | None = None,
        auto_place: bool = True,
        context: Callable[[Backend, ModelCard], int | None] | None = None,
        reconcile_every: float = 0.5,
    ) -> None:
        self.store = store
        self.backends = list(backends)
        self.resolve = resolve
        self.choose = choose
        self.rank = rank
        self.auto_place = auto_place
        self.context = context
        self.reconcile_every = reconcile_every
        self._view: dict[str, Instance] = {}
        self._generation = -1
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._create_lock = asyncio.Lock()
        self.replacements: dict[str, int] = {}  # model -> instances this gateway re-placed (``/metrics``)

    # ------------------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        await self._refresh(force=True)
        self._tasks = [
            asyncio.create_task(self._watch(), name="instances-watch"),
            asyncio.create_task(self._reconcile_loop(), name="instances-reconcile"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _watch(self) -> None:
        async for _kind in self.store.watch():
            self._changed.set()

    async def _refresh(self, force: bool = False) -> None:
        generation = await self.store.generation()
        if force or generation != self._generation:
            self._generation = generation
            self._view = {i.id: i for i in await self.store.instances()}

    async def _reconcile_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.reconcile_every)
            self._changed.clear()
            try:
                await self._refresh()
                await self.reconcile()
            except Exception:
                log.exception("reconcile failed; retrying")

    # ------------------------------------------------------------------------------------------- planning

    async def topology(self) -> Topology:
        nodes, links = await asyncio.gather(self.store.nodes(), self.store.links())
        return Topology(nodes=tuple(nodes), links=tuple(links))

    def _offers(self, card: ModelCard) -> list[tuple[Backend, BackendOffer]]:
        chosen = self.choose(card=card, backends=self.backends)
        if chosen is None:
            raise NoCapacity(f"no backend can serve model '{card.name}' (format {card.format})")
        costs = chosen.costs(card)
        return [
            (
                chosen,
                BackendOffer(
                    backend=chosen.name,
                    strategies=frozenset(chosen.strategies(card)),
                    overhead_bytes=costs.base_bytes,
                    overhead_per_token=costs.per_token_bytes,
                    head_overhead_bytes=costs.head_bytes,
                    tied_output_copy=costs.tied_output_copy,
                    vocab_parallel=costs.vocab_parallel,
                    kv_sequences=costs.sequences,
                    required_runtime=None,
                ),
            )
        ]

    async def preview(
        self,
        model: str,
        *,
        nodes: Sequence[str] | None = None,
        strategy: str | None = None,
        min_nodes: int | None = None,
        context: int | None = None,
    ) -> list[Candidate]:
        """Every candidate placement for ``model``, fitting ones first, best first (``context``: tokens of KV
        cache to hold; the backend's default for the model when None)."""
        card = self.resolve(model)
        offers = self._offers(card)
        backend = offers[0][0]
        if context is None and self.context:
            context = self.context(backend, card)
        return plan(
            backend.spec(card),
            await self.topology(),
            [o for _, o in offers],
            context=context,
            nodes=nodes,
            rank=self.rank,
            strategy=strategy,
            min_nodes=min_nodes,
        )

    async def create(
        self,
        model: str,
        *,
        candidate_id: str | None = None,
        nodes: Sequence[str] | None = None,
        strategy: str | None = None,
        min_nodes: int | None = None,
        context: int | None = None,
        reason: str = "requested",
    ) -> Instance:
        """Place ``model`` (a previewed candidate by id, or the best under the constraints); store the instance."""
        card = self.resolve(model)
        candidates = await self.preview(card.name, nodes=nodes, strategy=strategy, min_nodes=min_nodes, context=context)
        fitting = [c for c in candidates if c.fits]
        if candidate_id is not None:
            fitting = [c for c in candidates if c.id == candidate_id]
            if not fitting:
                raise NotFound(f"no candidate '{candidate_id}' for model '{card.name}' in the current topology")
            if not fitting[0].fits:
                raise NoCapacity(f"candidate {candidate_id} does not fit: {fitting[0].reason}")
        if not fitting:
            raise NoCapacity(_no_fit_message(card.name, candidates))
        now = time.time()
        instance = Instance(
            id=InstanceId(uuid.uuid4().hex[:12]),
            model=card.name,
            placement=fitting[0],
            state=Starting(),
            created_at=now,
            updated_at=now,
            runners={},
            strategy=strategy,
            min_nodes=min_nodes,
        )
        await self.store.put_instance(instance)
        await self.store.append_event(
            "instance.placed",
            f"placed {card.name} ({reason}) on {', '.join(s.node_id for s in fitting[0].shards)}",
            instance_id=instance.id,
            data={"placement": msgspec.json.encode(fitting[0]).decode(), "reason": reason},
        )
        self._view[instance.id] = instance
        return instance

    async def delete(self, instance_id: InstanceId) -> None:
        if await self.store.get_instance(instance_id) is None:
            raise NotFound(f"instance '{instance_id}' not found")
        await self.store.delete_instance(instance_id)
        await self.store.append_event("instance.deleted", f"deleted instance {instance_id}", instance_id=instance_id)
        self._view.pop(instance_id, None)

    async def set_expiry(self, model: str, expires_at: float | None) -> None:
        """Set when ``model``'s ready instances are unloaded (``None``: never; Ollama's ``keep_alive``)."""
        await self._refresh()
        for instance in self.cached(model):
            if isinstance(instance.state, Ready) and instance.expires_at != expires_at:
                current = await self.store.get_instance(instance.id)
                if current is not None:
                    await self.store.put_instance(msgspec.structs.replace(current, expires_at=expires_at))
        await self._refresh(force=True)

    # ------------------------------------------------------------------------------------------- hot path

    def cached(self, model: str) -> list[Instance]:
        return [i for i in self._view.values() if i.model == model]

    async def acquire(self, card: ModelCard, *, context: int | None = None) -> Instance:
        """A ready instance of ``card`` if one exists; else one that is starting (placing it if allowed).

        With ``context`` (Ollama's ``num_ctx``), only an instance holding that many tokens will do: others of
        the model are replaced by one that does, as Ollama reloads a model for a new context size.
        """
        if context is not None and card.context_length:
            context = min(context, card.context_length)

        def matching() -> list[Instance]:
            return [i for i in self.cached(card.name) if context is None or i.placement.context == context]

        found = _usable(matching())
        if found is not None:
            return found
        async with self._create_lock:
            await self._refresh()
            found = _usable(matching())
            if found is not None:
                return found
            if not self.auto_place:
                raise NoCapacity(
                    f"model '{card.name}' has no instance and automatic placement is off; "
                    f"create one with POST /instances"
                )
            for other in self.cached(card.name):  # a different context size: reload, as Ollama does
                await self.delete(other.id)
            why = "automatic: first request" if context is None else f"automatic: a request for {context} tokens"
            return await self.create(card.name, context=context, reason=why)

    async def wait_ready(self, instance_id: InstanceId, timeout: float = 300.0) -> Instance:
        """Wait until the instance is ready; raise if it fails (and is not re-placed) or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            instance = self._view.get(instance_id) or await self.store.get_instance(instance_id)
            if instance is None:
                raise BackendUnavailable(f"instance {instance_id} was deleted while starting")
            if isinstance(instance.state, Ready):
                return instance
            if isinstance(instance.state, Failed) and instance.attempts >= MAX_ATTEMPTS:
                raise BackendUnavailable(f"instance {instance_id} failed: {instance.state.reason}")
            await asyncio.sleep(0.05)
            await self._refresh()
        raise BackendUnavailable(f"instance {instance_id} was not ready within {timeout:.0f}s")

    async def report_unreachable(self, instance: Instance, error: str) -> None:
        """The gateway could not reach the instance's runner: fail it so it is re-placed."""
        if await self.store.set_state(instance.id, Failed(reason=f"runner unreachable: {error}"), expected=Ready):
            await self.store.append_event("instance.failed", f"runner unreachable: {error}", instance_id=instance.id)
        await self._refresh(force=True)
        self._changed.set()

    # ------------------------------------------------------------------------------------------- reconcile

    async def reconcile(self) -> None:
        """One pass: promote ready instances, fail those that lost a node or a runner, re-place failed ones,
        delete ready ones whose ``expires_at`` has passed."""
        node_ids = {n.id for n in await self.store.nodes()}
        now = time.time()
        for instance in list(self._view.values()):
            state = instance.state
            if isinstance(state, Ready) and instance.expires_at is not None and instance.expires_at <= now:
                if await self.store.delete_instance(instance.id):
                    await self.store.append_event(
                        "instance.expired", f"{instance.model} expired (keep_alive)", instance_id=instance.id
                    )
                self._view.pop(instance.id, None)
                continue
            if isinstance(state, Starting | Ready):
                problem = _problem(instance, node_ids)
                if problem:
                    if await self.store.set_state(instance.id, Failed(reason=problem), expected=type(state)):
                        log.warning("instance %s failed: %s", instance.id, problem)
                        await self.store.append_event("instance.failed", problem, instance_id=instance.id)
                elif isinstance(state, Starting) and _all_ready(instance):
                    if await self.store.set_state(instance.id, Ready(), expected=Starting):
                        await self.store.append_event(
                            "instance.ready", f"{instance.model} is ready", instance_id=instance.id
                        )
            elif isinstance(state, Failed) and instance.attempts < MAX_ATTEMPTS:
                await self._replace(instance, state.reason)
        await self._refresh()

    async def _replace(self, instance: Instance, why: str) -> None:
        """Plan again on the nodes that remain: with the instance's own constraints if it still fits so, else
        with none."""
        candidates: list[Candidate] = []
        try:
            if instance.strategy or instance.min_nodes:
                candidates = await self.preview(
                    instance.model, strategy=instance.strategy, min_nodes=instance.min_nodes
                )
            if not any(c.fits for c in candidates):
                candidates = await self.preview(instance.model)
        except Exception as exc:  # the model vanished from the catalog, no backend, ...
            candidates, why = [], f"{why}; cannot plan: {exc}"
        fitting = [c for c in candidates if c.fits]
        attempts = instance.attempts + 1
        if not fitting:
            await self.store.put_instance(msgspec.structs.replace(instance, attempts=MAX_ATTEMPTS))
            await self.store.append_event(
                "instance.unplaceable", _no_fit_message(instance.model, candidates), instance_id=instance.id
            )
            return
        if not await self.store.set_state(instance.id, Starting(), expected=Failed):
            return  # another gateway is re-placing it
        replaced = msgspec.structs.replace(
            instance,
            placement=fitting[0],
            state=Starting(),
            runners={},
            epoch=instance.epoch + 1,
            attempts=attempts,
            updated_at=time.time(),
        )
        await self.store.put_instance(replaced)
        self.replacements[instance.model] = self.replacements.get(instance.model, 0) + 1
        await self.store.append_event(
            "instance.replaced",
            f"re-placed {instance.model} after: {why}; now on {', '.join(s.node_id for s in fitting[0].shards)}",
            instance_id=instance.id,
            data={"placement": msgspec.json.encode(fitting[0]).decode(), "reason": why},
        )


def _usable(instances: Sequence[Instance]) -> Instance | None:
    """Ready first, then starting, then failed but still being re-placed."""
    for usable in (
        lambda i: isinstance(i.state, Ready),
        lambda i: isinstance(i.state, Starting),
        lambda i: isinstance(i.state, Failed) and i.attempts < MAX_ATTEMPTS,
    ):
        found = next((i for i in instances if usable(i)), None)
        if found is not None:
            return found
    return None


def _problem(instance: Instance, node_ids: set[NodeId]) -> str | None:
    for shard in instance.placement.shards:
        if shard.node_id not in node_ids:
            return f"node {shard.node_id} left the cluster"
        status = instance.runners.get(shard.node_id)
        if status is not None and status.epoch == instance.epoch and status.state == "failed":
            return f"runner on {shard.node_id} failed: {status.error or 'unknown error'}"
    return None


def _all_ready(instance: Instance) -> bool:
    return all(
        (s := instance.runners.get(shard.node_id)) is not None and s.state == "ready" and s.epoch == instance.epoch
        for shard in instance.placement.shards
    )


def _no_fit_message(model: str, candidates: Sequence[Candidate]) -> str:
    if not candidates:
        return f"model '{model}' fits nowhere: no nodes are registered"
    reasons = "; ".join(dict.fromkeys(c.reason or "" for c in candidates if c.reason))
    return f"model '{model}' fits nowhere: {reasons}"
