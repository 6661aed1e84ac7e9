"""The placement planner: a pure function from a model spec, a topology snapshot and the backends on offer to
ranked candidate placements (``plan``), plus the default ranking policy (``default_rank``).

No I/O, no Redis, no asyncio: previews, ``meshgate place`` and instance creation call the same function over a
frozen ``Topology``. Imports only ``backends.placement``, ``costs`` (the speed model), the standard library and
msgspec.

Estimates (units: bytes, seconds, bytes/second); the speed model is ``costs``' (its docstring):

* Memory of a shard = its weights + KV cache for ``context`` tokens (times the sequences a runner batches,
  ``kv_sequences``, and its spares, ``kv_spares``) over its layers (``ModelSpec.kv_bytes``) +
  the backend's runtime overhead. It fits when that is at most the node's ``memory_available``.
* Speed: each node's measured speed for the backend (``Node.calibration``, else ``Node.flops``). A decoded token
  reads every weight its stage multiplies by (an untied embedding is a lookup and costs nothing) and the KV
  cache a typical request uses (not the context reserved) at the node's decode rate, plus the head's per-step
  cost; a prompt costs its matmul FLOPs at the node's prefill rate. ``tok_s`` = 1 / decode time,
  ``prompt_tok_s`` = prompt tokens / prefill time.
* single: one stage.  pipeline: stages run one after another, time = sum of stage times + link cost, where
  each of the k-1 hops carries one hidden state of ``hidden_size * 2`` bytes: latency + bytes / bandwidth, and
  the last stage returns the token's logits to the head over its link.
  tensor: ranks work at once, time = slowest rank's compute (1/k of the model) + link cost, where every layer
  runs two all-reduces of ``hidden_size * 2`` bytes, each a ring of 2(k-1) steps of latency + bytes/k/bandwidth
  on the group's worst link; latency dominates, so every pair of ranks must be under ``TENSOR_MAX_LATENCY``.
* Links: a hop uses the measured ``src -> dst`` link, else the reverse one (paths are taken as symmetric);
  neither measured means unknown, and a candidate that needs it is rejected. A node needs no link to itself.

Node choice, so 1,000 nodes plan in well under 100 ms: nodes are ordered greedily (most available memory, then
fastest, then id). Single tries the fastest nodes (measured decode rate) that fit (or, when none does, the
roomiest). Pipeline and tensor start from each of the first ``ALTERNATIVES`` nodes and grow one node at a time,
pipeline through the tail's best linked neighbour, tensor through the best node with fast links to every rank so
far; sizes below the smallest k whose k roomiest nodes could hold the model are skipped, and growth stops at the
first size that fits (so the smallest set wins) or once a link is missing or too slow. Hybrid (tensor inside
pipeline stages) is not planned: an offer of "hybrid" alone yields nothing.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate, combinations, pairwise

import msgspec

from meshgate.backends.placement import Candidate, Link, ModelSpec, Node, NodeId, Shard, Strategy, Topology
from meshgate.gateway.cluster import costs
from meshgate.gateway.cluster.costs import ACTIVATION_BYTES, PARAMS_PER_BYTE, Stage

__all__ = [
    "ACTIVATION_BYTES",
    "ALTERNATIVES",
    "PARAMS_PER_BYTE",
    "TENSOR_MAX_LATENCY",
    "BackendOffer",
    "Rank",
    "default_rank",
    "plan",
]

MiB = 1 << 20
GiB = 1 << 30
TENSOR_MAX_LATENCY = 0.002
"""Slowest link (seconds) tensor parallel ranks may be joined by."""
ALTERNATIVES = 3
"""How many seed nodes multi-node growth starts from, and how many single-node candidates that fit to offer."""

Rank = Callable[[list[Candidate], Topology], list[Candidate]]
_STRATEGIES: tuple[Strategy, ...] = ("single", "pipeline", "tensor", "hybrid")
_Next = Callable[[list[Node], set[NodeId], Iterator[Node]], tuple[Node, bool] | None]


class BackendOffer(msgspec.Struct, frozen=True, kw_only=True):
    """What one backend offers for a model.

    Attributes:
        backend: The backend's name, copied into each candidate.
        strategies: Any of "single", "pipeline", "tensor", "hybrid" (hybrid is not planned yet).
        overhead_bytes: Runtime memory per shard beyond weights and KV cache (buffers, the process itself).
        overhead_per_token: More runtime memory per shard for each token of context (compute buffers).
        head_overhead_bytes: More runtime memory on the head shard (stage 0, tensor rank 0) only.
        tied_output_copy: Split over several stages, the last stage holds its own copy of a tied embedding as
            the output layer (llama.cpp does); otherwise the tied embedding is held once, by stage 0.
        vocab_parallel: Tensor ranks split the embedding and output layer; otherwise each holds them whole.
        kv_sequences: Sequences the runner batches, each with a KV cache of the whole context; 0 lets the
            planner size them from the nodes' memory (``auto_sequences``).
        kv_spares: Sequences the head runner holds beyond ``kv_sequences`` for interactive requests while batch
            ones are paused (``ShardCosts.spares``), each with its KV cache too.
        required_runtime: When set, only nodes whose ``Node.runtimes`` has this key are eligible.
    """

    backend: str
    strategies: frozenset[str]
    overhead_bytes: int = 64 * MiB
    overhead_per_token: int = 0
    head_overhead_bytes: int = 0
    tied_output_copy: bool = False
    vocab_parallel: bool = True
    kv_sequences: int = 1
    kv_spares: int = 0
    required_runtime: str | None = None
    head_cache_share: float = 0.0
    head_cache_cap: int = 0

    def cache(self, node_memory: int) -> int:
        """The head runner's host-memory KV tier on a node of ``node_memory`` bytes (``ShardCosts.cache``)."""
        return min(self.head_cache_cap, int(node_memory * self.head_cache_share))

    def overhead(self, context: int, head: bool = False, node_memory: int = 0) -> int:
        """Runtime memory of one shard for ``context`` tokens (the head's when ``head``, on a node of
        ``node_memory`` bytes: its KV tier)."""
        extra = self.head_overhead_bytes + self.cache(node_memory) if head else 0
        return self.overhead_bytes + self.overhead_per_token * context + extra


def plan(
    spec: ModelSpec,
    topology: Topology,
    backends: Sequence[BackendOffer],
    *,
    context: int | None = None,
    nodes: Sequence[str] | None = None,
    rank: Rank | None = None,
    max_nodes: int | None = None,
    min_nodes: int | None = None,
    strategy: str | None = None,
) -> list[Candidate]:
    """Every placement considered for ``spec`` on ``topology``: fitting ones best first, then rejected ones.

    Args:
        spec: The model.
        topology: A snapshot of nodes and measured links.
        backends: The backends that may run it, each with its strategies, overhead and required runtime.
        context: Tokens of KV cache to reserve; ``spec.context_length`` when None.
        nodes: Only place on these node ids (ids not in the topology are ignored).
        rank: Orders the fitting candidates, best first; ``default_rank`` when None.
        max_nodes: Use at most this many nodes per candidate.
        min_nodes: Use at least this many nodes per candidate (split a model that would fit on one).
        strategy: Only this strategy ("single", "pipeline", "tensor").

    Returns:
        Fitting candidates in ``rank`` order, then rejected ones (``fits=False``, ``reason`` in words) in the
        order considered. Candidates with the same id are listed once.
    """
    ctx = spec.context_length if context is None else context
    allowed = None if nodes is None else set(nodes)
    links = {(link.src, link.dst): link for link in topology.links}
    views: dict[str | None, _View] = {}
    considered: dict[str, Candidate] = {}
    for offer in backends:
        runtime = offer.required_runtime
        if runtime not in views:
            eligible = [
                n
                for n in topology.nodes
                if (allowed is None or n.id in allowed) and (runtime is None or runtime in n.runtimes)
            ]
            views[runtime] = _View(eligible, links)
        if strategy is not None:
            offer = msgspec.structs.replace(offer, strategies=offer.strategies & {strategy})
        for candidate in _Planner(spec, offer, ctx, views[runtime]).candidates(max_nodes, min_nodes or 1):
            considered.setdefault(candidate.id, candidate)
    fitting = [c for c in considered.values() if c.fits]
    rejected = [c for c in considered.values() if not c.fits]
    return (rank or default_rank)(fitting, topology) + rejected


def default_rank(candidates: list[Candidate], topology: Topology) -> list[Candidate]:
    """The default ranking policy: fewest nodes, then highest tok/s, lowest link cost, most memory headroom.

    Args:
        candidates: Fitting candidates, in any order.
        topology: The snapshot they were planned on (for each node's available memory).

    Returns:
        The candidates best first. Headroom is that of the tightest node; ties end on the id, so the order is
        total and the same input always ranks the same way.
    """
    available = {n.id: n.memory_available for n in topology.nodes}

    def headroom(c: Candidate) -> int:
        return min((available.get(NodeId(nid), 0) - used for nid, used in c.memory_per_node.items()), default=0)

    return sorted(candidates, key=lambda c: (len(c.memory_per_node), -c.tok_s, c.link_cost, -headroom(c), c.id))


class _View:
    """Indexes over the eligible nodes for one plan() call: by id, in greedy order, neighbours in greedy order."""

    def __init__(self, nodes: list[Node], links: dict[tuple[NodeId, NodeId], Link]) -> None:
        self.nodes = {n.id: n for n in nodes}
        self.order = sorted(nodes, key=_greedy)
        self.links = links
        self.roomiest = list(accumulate(n.memory_available for n in self.order))
        adjacent: dict[NodeId, set[NodeId]] = {n.id: set() for n in nodes}
        for src, dst in links:
            if src != dst and src in adjacent and dst in adjacent:
                adjacent[src].add(dst)
                adjacent[dst].add(src)
        self.neighbours = {nid: sorted((self.nodes[m] for m in ms), key=_greedy) for nid, ms in adjacent.items()}

    def link(self, a: NodeId, b: NodeId) -> Link | None:
        return self.links.get((a, b)) or self.links.get((b, a))


class _Planner:
    """The candidates one backend offer yields on one view."""

    def __init__(self, spec: ModelSpec, offer: BackendOffer, context: int, view: _View) -> None:
        self.spec, self.offer, self.ctx, self.view = spec, offer, context, view
        self.sequences = offer.kv_sequences or auto_sequences(spec, context, view.order)
        self.kv_tokens = context * (self.sequences + offer.kv_spares)  # KV cells: the context for each sequence
        self._speeds: dict[NodeId, costs.Speed] = {}

    def _speed(self, node: Node) -> costs.Speed:
        found = self._speeds.get(node.id)
        if found is None:
            found = self._speeds[node.id] = costs.speed(node, self.offer.backend)
        return found

    def _rate(self, node: Node) -> float:
        return self._speed(node).decode_bytes_per_s

    def candidates(self, max_nodes: int | None, min_nodes: int = 1) -> Iterator[Candidate]:
        offered = [s for s in _STRATEGIES if s in self.offer.strategies]
        if not offered:
            return
        if not self.view.order:
            yield self._finish(offered[0], (), 0.0, 0.0, 0.0, [self._nobody()])
            return
        limit = len(self.view.order) if max_nodes is None else min(max_nodes, len(self.view.order))
        if "single" in offered and limit >= 1 and min_nodes <= 1:
            yield from self._singles()
        if "pipeline" in offered:
            yield from self._grow(min(limit, self.spec.n_layers), self._next_stage, self.pipeline, least=min_nodes)
        if "tensor" in offered:
            largest = max(k for k in range(1, self.spec.n_heads + 1) if self._divides(k))  # the heads' limit
            yield from self._grow(min(limit, largest), self._next_rank, self.tensor, tensor=True, least=min_nodes)

    def _nobody(self) -> str:
        runtime = self.offer.required_runtime
        return f"no eligible node has the {runtime} runtime" if runtime else "no nodes to place on"

    # ------------------------------------------------------------------------------------------ node choice

    def _singles(self) -> Iterator[Candidate]:
        need = self.spec.weight_bytes + self.spec.kv_bytes(self.kv_tokens)
        fit = sorted(
            (n for n in self.view.order if n.memory_available >= need + self._head_overhead(n)),
            key=lambda n: (-self._rate(n), n.id),
        )
        for node in fit[:ALTERNATIVES] or self.view.order[:1]:
            yield self.pipeline([node], "single")

    def _head_overhead(self, node: Node) -> int:
        return self.offer.overhead(self.ctx, head=True, node_memory=node.memory_total)

    def _smallest_size(self, limit: int) -> int:
        """The smallest k >= 2 whose k roomiest nodes could hold the model at all; ``limit`` when none can."""
        total = self.spec.weight_bytes + self.spec.kv_bytes(self.kv_tokens)
        for k in range(2, limit + 1):
            overheads = k * self.offer.overhead(self.ctx) + self.offer.head_overhead_bytes
            if self.view.roomiest[k - 1] >= total + overheads:
                return k
        return limit

    def _grow(
        self,
        limit: int,
        next_node: _Next,
        build: Callable[[list[Node]], Candidate],
        *,
        tensor: bool = False,
        least: int = 1,
    ) -> Iterator[Candidate]:
        """From each seed, add nodes one at a time; emit a candidate per size from the smallest plausible one
        until one fits or a link is missing or too slow (every larger group from this seed would share it)."""
        if limit < max(2, least):
            return
        start = max(self._smallest_size(limit), least)
        for seed in self.view.order[:ALTERNATIVES]:
            group, used, broken = [seed], {seed.id}, False
            rest = (n for n in self.view.order if n.id not in used)
            while len(group) < limit:
                found = next_node(group, used, rest)
                if found is None:
                    break
                node, linked = found
                group.append(node)
                used.add(node.id)
                broken = broken or not linked
                if len(group) < start or (tensor and len(group) > start and not self._divides(len(group))):
                    continue  # tensor sizes that do not divide the heads are shown once, at the smallest size
                candidate = build(group)
                yield candidate
                if candidate.fits or broken:
                    break

    def _divides(self, k: int) -> bool:
        """Query heads split evenly over ``k`` ranks; KV heads split too, or (fewer KV heads than ranks, as in
        grouped-query models like Gemma 3 270M with one) each replicated on the ranks whose queries read it."""
        kv = self.spec.n_kv_heads
        return self.spec.n_heads % k == 0 and (kv % k == 0 or k % kv == 0)

    def _next_stage(self, chain: list[Node], used: set[NodeId], rest: Iterator[Node]) -> tuple[Node, bool] | None:
        """The tail's best unused linked neighbour, else (unlinked) the best unused node."""
        for node in self.view.neighbours[chain[-1].id]:
            if node.id not in used:
                return node, True
        unlinked = next(rest, None)
        return None if unlinked is None else (unlinked, False)

    def _next_rank(self, group: list[Node], used: set[NodeId], rest: Iterator[Node]) -> tuple[Node, bool] | None:
        """The best unused node with fast measured links to every rank; else a slow or unlinked one, flagged."""
        fallback = None
        for node in self.view.neighbours[group[0].id]:
            if node.id in used:
                continue
            links = [self.view.link(node.id, m.id) for m in group]
            if all(link is not None and link.latency <= TENSOR_MAX_LATENCY for link in links):
                return node, True
            fallback = fallback or node
        other = fallback or next(rest, None)
        return None if other is None else (other, False)

    # ---------------------------------------------------------------------------------------- one candidate

    def pipeline(self, chain: list[Node], strategy: Strategy = "pipeline") -> Candidate:
        """Layers over ``chain`` in order, balanced by compute within each node's memory; stage 0 holds the
        embedding, the last stage the untied output layer. Every stage gets at least one layer."""
        spec, k = self.spec, len(chain)
        overheads = [
            self.offer.overhead(self.ctx, head=i == 0, node_memory=n.memory_total) for i, n in enumerate(chain)
        ]
        output_copy = spec.embedding_bytes if k > 1 and spec.tied_output and self.offer.tied_output_copy else 0
        fixed = [
            (spec.embedding_bytes if i == 0 else 0) + (spec.output_bytes + output_copy if i == k - 1 else 0)
            for i in range(k)
        ]
        work = [
            (spec.embedding_bytes if i == 0 and spec.tied_output and not output_copy else 0)
            + (spec.output_bytes + output_copy if i == k - 1 else 0)
            for i in range(k)
        ]
        per_layer = max(1, spec.layer_bytes + spec.kv_bytes(self.kv_tokens, 1))
        caps = [(n.memory_available - o - f) // per_layer for n, o, f in zip(chain, overheads, fixed, strict=True)]
        layers = [1] * k
        remaining = spec.n_layers - k

        def stage_time_with_one_more(i: int) -> float:
            return (work[i] + (layers[i] + 1) * spec.layer_bytes) / self._rate(chain[i])

        for within_caps in (True, False):  # first within memory; what is left over shows where memory runs out
            heap = [(stage_time_with_one_more(i), i) for i in range(k) if not within_caps or layers[i] < caps[i]]
            heapq.heapify(heap)
            while remaining > 0 and heap:
                _, i = heapq.heappop(heap)
                layers[i] += 1
                remaining -= 1
                if not within_caps or layers[i] < caps[i]:
                    heapq.heappush(heap, (stage_time_with_one_more(i), i))
        shards, first = [], 0
        for i, node in enumerate(chain):
            shards.append(
                Shard(
                    node_id=node.id,
                    layer_start=first,
                    layer_end=first + layers[i],
                    holds_embedding=i == 0,
                    weight_bytes=fixed[i] + layers[i] * spec.layer_bytes,
                    kv_bytes=spec.kv_bytes(self.kv_tokens, layers[i]),
                    overhead_bytes=overheads[i],
                    cache_bytes=self.offer.cache(node.memory_total) if i == 0 else 0,
                )
            )
            first += layers[i]
        stages = [
            Stage(self._speed(node), work[i] + layers[i] * spec.layer_bytes, layers[i]) for i, node in enumerate(chain)
        ]
        hops, missing = [], []
        for a, b in pairwise(chain):
            link = self.view.link(a.id, b.id)
            if link is None:
                missing.append((a, b))
            else:
                hops.append(link)
        back = (self.view.link(chain[-1].id, chain[0].id) or hops[-1]) if hops else None  # unmeasured: as the last hop
        link_cost = costs.pipeline_links(spec, hops, back)
        prompt_links = costs.pipeline_links(spec, hops, back, tokens=costs.prompt_tokens(self.ctx))
        decode = costs.decode_seconds(spec, stages, self.ctx, link_cost)
        prefill = costs.prefill_seconds(spec, stages, self.ctx, prompt_links)
        return self._finish(strategy, tuple(shards), decode, prefill, link_cost, _unmeasured(missing))

    def tensor(self, group: list[Node]) -> Candidate:
        """Every layer split across ``group`` (ranks in greedy order), each rank holding 1/k of all weights
        (embedding and output vocab-parallel, or whole on every rank where the backend does not split them, so
        every rank has ``holds_embedding``) and 1/k of the KV heads (replicated when fewer)."""
        spec, k = self.spec, len(group)
        ranks = sorted(group, key=_greedy)
        problems = []
        if not self._divides(k):
            problems.append(
                f"tensor parallel over {k} nodes needs n_heads ({spec.n_heads}) divisible by {k} and "
                f"n_kv_heads ({spec.n_kv_heads}) divisible by {k} or dividing it"
            )
        latency, bandwidth, missing, worst = 0.0, math.inf, [], ""
        for a, b in combinations(ranks, 2):
            link = self.view.link(a.id, b.id)
            if link is None:
                missing.append((a, b))
                continue
            if link.latency > max(latency, TENSOR_MAX_LATENCY):
                worst = f"{a.id}-{b.id}"
            latency, bandwidth = max(latency, link.latency), min(bandwidth, link.bandwidth)
        problems += _unmeasured(missing)
        if worst:
            problems.append(
                f"tensor parallel over a {_ms(latency)} link ({worst}; the limit is {_ms(TENSOR_MAX_LATENCY)})"
            )
        step = latency + spec.hidden_size * ACTIVATION_BYTES / k / bandwidth
        link_cost = 2 * spec.n_layers * 2 * (k - 1) * step
        kv_heads = max(spec.n_kv_heads // k, 1)  # replicated when fewer than the ranks
        whole = 0 if self.offer.vocab_parallel else spec.embedding_bytes + spec.output_bytes  # on every rank
        weight = -(-(spec.weight_bytes - whole) // k) + whole
        kv = spec.kv_bytes(self.kv_tokens) * kv_heads // max(spec.n_kv_heads, 1)
        shards = tuple(
            Shard(
                node_id=n.id,
                layer_start=0,
                layer_end=spec.n_layers,
                tensor_rank=r,
                tensor_size=k,
                holds_embedding=True,
                weight_bytes=weight,
                kv_bytes=kv,
                overhead_bytes=self.offer.overhead(self.ctx, head=r == 0, node_memory=n.memory_total),
                cache_bytes=self.offer.cache(n.memory_total) if r == 0 else 0,
            )
            for r, n in enumerate(ranks)
        )
        work = spec.weight_bytes - (0 if spec.tied_output else spec.embedding_bytes)
        slowest = min(ranks, key=lambda n: (self._rate(n), self._speed(n).prefill_flops))
        stage = Stage(self._speed(slowest), work / k, spec.n_layers, 1 / k)
        reduce_prompt = 2 * spec.n_layers * 2 * (k - 1) * (step - latency) * costs.prompt_tokens(self.ctx)
        decode = costs.decode_seconds(spec, [stage], self.ctx, link_cost)
        prefill = costs.prefill_seconds(spec, [stage], self.ctx, link_cost + reduce_prompt)
        return self._finish("tensor", shards, decode, prefill, link_cost, problems)

    def _finish(
        self,
        strategy: Strategy,
        shards: tuple[Shard, ...],
        decode: float,
        prefill: float,
        link_cost: float,
        problems: list[str],
    ) -> Candidate:
        """The record: memory per node, tok/s (``decode`` and ``prefill``: seconds per token and per typical
        prompt), the first node short of memory (if any), a content id."""
        memory = {s.node_id: s.memory_bytes for s in shards}
        short = next((s for s in shards if s.memory_bytes > self.view.nodes[s.node_id].memory_available), None)
        if short is not None:
            reason = (
                f"needs {_size(short.memory_bytes)} on node {short.node_id} "
                f"({_size(self.view.nodes[short.node_id].memory_available)} available)"
            )
            if short.kv_bytes:
                reason += f", including {_size(short.kv_bytes)} of KV cache for {self.kv_tokens:,} tokens"
            problems = [*problems, reason]
        content = msgspec.json.encode([self.spec.name, self.offer.backend, strategy, self.ctx, shards])
        return Candidate(
            id=hashlib.blake2b(content, digest_size=6).hexdigest(),
            model=self.spec.name,
            backend=self.offer.backend,
            strategy=strategy,
            context=self.ctx,
            shards=shards,
            memory_per_node=memory,
            link_cost=link_cost,
            tok_s=1.0 / decode if decode > 0 else 0.0,
            prompt_tok_s=costs.prompt_tokens(self.ctx) / prefill if prefill > 0 else 0.0,
            fits=not problems,
            reason="; ".join(problems) or None,
            sequences=self.sequences,
            spares=self.offer.kv_spares,
        )


SLOT_MEMORY_SHARE = 0.25
"""Of a node's available memory, the share a runner's slots may fill with KV cache when they are sized
automatically (the rest stays for weights, other replicas and the machine)."""
MAX_SEQUENCES = 16
"""Slots sized automatically are at most this many: beyond it a CPU decode step of every running sequence
gets slower than clients wait for their next token, and more requests queue at the gateway instead."""


def auto_sequences(spec: ModelSpec, context: int, nodes: Sequence[Node]) -> int:
    """How many sequences a runner batches when the operator does not say (as vLLM sizes its batch from free
    memory): as many whole-context KV caches of ``spec`` as ``SLOT_MEMORY_SHARE`` of the smallest available
    memory among ``nodes`` holds, between 1 and ``MAX_SEQUENCES``. The smallest node, so any of them can hold the
    head; 1 with no nodes."""
    per_sequence = spec.kv_bytes(max(1, context))
    if not nodes or per_sequence <= 0:
        return 1
    room = SLOT_MEMORY_SHARE * min(n.memory_available for n in nodes)
    return max(1, min(MAX_SEQUENCES, int(room // per_sequence)))


def _unmeasured(pairs: list[tuple[Node, Node]]) -> list[str]:
    if not pairs:
        return []
    more = f" (and {len(pairs) - 1} more pairs)" if len(pairs) > 1 else ""
    return [f"no link measured between {pairs[0][0].id} and {pairs[0][1].id}{more}"]


def _greedy(node: Node) -> tuple[int, float, str]:
    return -node.memory_available, -node.flops, node.id


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if abs(n) >= GiB else f"{n / MiB:.0f} MiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"
