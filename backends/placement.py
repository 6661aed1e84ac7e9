"""The cluster's vocabulary: nodes, links, a topology snapshot, model specs, shards and placement candidates.

These are data, shared by the planner (gateway), the ranking policy (a plugin hook) and the backends that launch
shards. All frozen msgspec Structs, serializable as they are into the state store and the HTTP API.

Units: bytes for memory, seconds for time, bytes/second for bandwidth.

Imports only msgspec and the standard library.
"""

from __future__ import annotations

from typing import Literal, NewType

import msgspec

__all__ = [
    "Calibration",
    "Candidate",
    "InstanceId",
    "Link",
    "ModelSpec",
    "Node",
    "NodeId",
    "Shard",
    "ShardCosts",
    "Strategy",
    "Topology",
]

NodeId = NewType("NodeId", str)
InstanceId = NewType("InstanceId", str)
Strategy = Literal["single", "pipeline", "tensor", "hybrid"]


class _Data(msgspec.Struct, frozen=True, kw_only=True):
    pass


class Calibration(_Data, frozen=True):
    """One runtime's measured speed on one node, with that runtime's own kernels (``Backend.calibrate``).

    The planner's cost model reads it (``gateway.cluster.planner``): a decoded token costs ``step_seconds`` plus
    the weight and KV bytes it reads over ``decode_bytes_per_s``; a prompt token costs its matmul FLOPs (weight
    bytes times ``params_per_byte`` times 2) over ``prefill_flops``.

    Attributes:
        decode_bytes_per_s: Weight bytes a one-token decode streams per second (the memory-bound rate).
        prefill_flops: FLOP/s of prompt matmuls over a batch of tokens (the compute-bound rate).
        step_seconds: What a decode step costs beyond reading weights: graph, sampling, the runner's loop.
        params_per_byte: Parameters per weight byte of the model it was measured on (for FLOPs from bytes).
        threads: Threads the runtime ran with.
        key: What the measurement holds for (CPU model, runtime version, threads): another key, measure again.
        measured_at: Unix seconds.
        load: The machine's load average per core while it was measured (above 1, other work slowed it).
    """

    decode_bytes_per_s: float
    prefill_flops: float
    step_seconds: float = 0.0
    params_per_byte: float = 2.0
    threads: int = 0
    key: str = ""
    measured_at: float = 0.0
    load: float = 0.0


class Node(_Data, frozen=True):
    """One machine as its agent reports it.

    ``flops`` is a relative compute speed (the agent's own measurement, e.g. GFLOP/s of a small matmul), used to
    weigh pipeline splits and estimate tok/s where no runtime measured the node. ``calibration`` holds each
    runtime's own measurement, by backend name (``Backend.calibrate``); the planner prefers it. ``address`` is
    the cluster interface runtimes bind to; ``agent_url`` is where the agent answers link probes.
    ``draining_until`` (Unix seconds) is set while the node drains before it stops (``SIGTERM`` to its agent):
    nothing new is placed on it, and its replicas finish their streams by then.
    """

    id: NodeId
    name: str
    address: str = "127.0.0.1"
    agent_url: str = ""
    memory_total: int = 0
    memory_available: int = 0
    cpu_count: int = 1
    flops: float = 1.0e10
    accelerators: tuple[str, ...] = ()
    runtimes: dict[str, str] = msgspec.field(default_factory=dict)
    calibration: dict[str, Calibration] = msgspec.field(default_factory=dict)
    heartbeat_at: float = 0.0
    draining_until: float | None = None


class Link(_Data, frozen=True):
    """A measured one-way view of the path from ``src`` to ``dst``."""

    src: NodeId
    dst: NodeId
    latency: float
    bandwidth: float
    measured_at: float = 0.0


class Topology(_Data, frozen=True):
    """A frozen snapshot of the cluster, the planner's only input about machines."""

    nodes: tuple[Node, ...] = ()
    links: tuple[Link, ...] = ()

    def node(self, node_id: NodeId) -> Node | None:
        return next((n for n in self.nodes if n.id == node_id), None)

    def link(self, src: NodeId, dst: NodeId) -> Link | None:
        return next((link for link in self.links if link.src == src and link.dst == dst), None)


class ModelSpec(_Data, frozen=True):
    """What the planner needs to know about a model (a "model card" in placement terms).

    ``layer_bytes`` is the weight size of one transformer block; ``embedding_bytes`` the token embedding (which
    may double as the output layer, ``tied_output``), placed whole on one shard; ``output_bytes`` a separate
    output layer if untied. ``vocab_size`` is the tokens the output layer scores (0 when unknown): a split model
    returns a row of logits per token to its head.
    """

    name: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    context_length: int
    layer_bytes: int
    embedding_bytes: int = 0
    output_bytes: int = 0
    tied_output: bool = True
    kv_bytes_per_element: int = 2
    vocab_size: int = 0

    @property
    def weight_bytes(self) -> int:
        return self.n_layers * self.layer_bytes + self.embedding_bytes + self.output_bytes

    def kv_bytes(self, context: int, layers: int | None = None) -> int:
        """KV cache for ``context`` tokens over ``layers`` blocks (all by default): K and V per KV head."""
        n = self.n_layers if layers is None else layers
        return 2 * self.n_kv_heads * self.head_dim * self.kv_bytes_per_element * context * n


class ShardCosts(_Data, frozen=True):
    """What a runtime costs per shard beyond weights and KV cache, for the planner's memory estimate.

    ``base_bytes`` is the process and fixed buffers of every shard; ``head_bytes`` what the head shard (the one
    that serves requests) costs on top; ``per_token_bytes`` grows the compute buffers with the context;
    ``tied_output_copy`` says a multi-stage split holds a second copy of a tied embedding as the output layer on
    its last stage. ``vocab_parallel``: tensor ranks split the embedding and output layer (vLLM does); when
    false each tensor rank holds them whole (MLX here). ``sequences``: requests a runner batches, each with its
    own KV cache of the full context (llama.cpp's slots), so the KV cache is reserved that many times.
    ``spares``: sequences the head runner holds beyond those, each with its KV cache too, where batch-class
    requests are paused (their KV kept) for interactive ones that arrive while every slot is taken (llama.cpp).
    ``cache_share``, ``cache_cap``: the head runner keeps prompts' KV in host memory (a KV tier) sized from its
    node's memory; the planner counts it as the head's and records it in the shard (``Shard.cache_bytes``).
    """

    base_bytes: int = 64 << 20
    head_bytes: int = 0
    per_token_bytes: int = 0
    tied_output_copy: bool = False
    vocab_parallel: bool = True
    sequences: int = 1
    spares: int = 0
    cache_share: float = 0.0
    cache_cap: int = 0

    def cache(self, node_memory: int) -> int:
        """The head runner's host-memory KV tier on a node of ``node_memory`` bytes: ``cache_share`` of it, at most
        ``cache_cap`` (a tier of a fixed size is in ``head_bytes`` instead)."""
        return min(self.cache_cap, int(node_memory * self.cache_share))


class Shard(_Data, frozen=True):
    """One node's part of a placement: a layer range (pipeline) and/or a tensor rank."""

    node_id: NodeId
    layer_start: int
    layer_end: int
    tensor_rank: int = 0
    tensor_size: int = 1
    holds_embedding: bool = False
    weight_bytes: int = 0
    kv_bytes: int = 0
    overhead_bytes: int = 0
    cache_bytes: int = 0  # of ``overhead_bytes``: the head runner's host-memory KV tier (``ShardCosts.cache_share``)

    @property
    def memory_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.overhead_bytes


class Candidate(_Data, frozen=True):
    """A placement record: where a model's shards go, what it costs, and whether it fits.

    ``link_cost`` is the estimated seconds per decoded token spent on links; ``tok_s`` the estimated decode
    speed and ``prompt_tok_s`` the estimated prompt (prefill) speed of one request of typical size
    (``planner.TYPICAL_PROMPT`` tokens). A rejected candidate has ``fits=False`` and the reason in words.
    ``sequences`` is how many requests the head runner batches (its slots), each with the whole ``context``;
    ``spares`` how many interactive requests it takes beyond them while batch-class ones hold slots (it pauses as
    many batch sequences; ``ShardCosts.spares``).
    """

    id: str
    model: str
    backend: str
    strategy: Strategy
    context: int
    shards: tuple[Shard, ...]
    memory_per_node: dict[NodeId, int]
    link_cost: float = 0.0
    tok_s: float = 0.0
    prompt_tok_s: float = 0.0
    fits: bool = True
    reason: str | None = None
    score: float = 0.0
    sequences: int = 1
    spares: int = 0
