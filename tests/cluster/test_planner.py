"""The placement planner as plain functions over synthetic topologies."""

from __future__ import annotations

import msgspec

from meshgate.backends.placement import Candidate, Link, ModelSpec, Node, NodeId, Topology
from meshgate.gateway.cluster import costs
from meshgate.gateway.cluster.planner import BackendOffer, default_rank, plan

GiB = 1 << 30
MiB = 1 << 20
ALL = frozenset({"single", "pipeline", "tensor"})

# 32 layers of 256 MiB + a 512 MiB tied embedding = 8.5 GiB of weights; KV is 128 KiB per token (4 KiB per layer).
SPEC = ModelSpec(
    name="m",
    n_layers=32,
    hidden_size=4096,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    context_length=4096,
    layer_bytes=GiB // 4,
    embedding_bytes=GiB // 2,
)


def node(node_id: str, gib: float, flops: float = 1e10, runtimes: dict[str, str] | None = None) -> Node:
    return Node(
        id=NodeId(node_id),
        name=node_id,
        memory_total=int(gib * GiB),
        memory_available=int(gib * GiB),
        flops=flops,
        runtimes=runtimes or {},
    )


def link(a: str, b: str, latency: float = 1e-4, bandwidth: float = 1.25e9) -> tuple[Link, Link]:
    return (
        Link(src=NodeId(a), dst=NodeId(b), latency=latency, bandwidth=bandwidth),
        Link(src=NodeId(b), dst=NodeId(a), latency=latency, bandwidth=bandwidth),
    )


def topology(*nodes: Node, links: tuple[tuple[Link, Link], ...] = ()) -> Topology:
    return Topology(nodes=nodes, links=tuple(x for pair in links for x in pair))


def offer(strategies: frozenset[str] = ALL, **kw: object) -> BackendOffer:
    return BackendOffer(backend="test", strategies=strategies, **kw)  # type: ignore[arg-type]


def nodes_of(candidate: Candidate) -> list[str]:
    return [s.node_id for s in candidate.shards]


def check_pipeline(candidate: Candidate, spec: ModelSpec = SPEC) -> None:
    """Layer ranges are contiguous and cover the model; weights add up; the first shard holds the embedding."""
    shards = candidate.shards
    assert shards[0].layer_start == 0 and shards[0].holds_embedding
    assert all(not s.holds_embedding for s in shards[1:])
    assert all(a.layer_end == b.layer_start for a, b in zip(shards, shards[1:], strict=False))
    assert shards[-1].layer_end == spec.n_layers
    assert all(s.layer_end > s.layer_start for s in shards)
    assert sum(s.weight_bytes for s in shards) == spec.weight_bytes


def test_single_fits_with_kv_cache_and_overhead() -> None:
    best = plan(SPEC, topology(node("a", 16)), [offer()])[0]
    assert best.fits and best.strategy == "single" and nodes_of(best) == ["a"]
    shard = best.shards[0]
    assert (shard.layer_start, shard.layer_end) == (0, 32)
    assert shard.kv_bytes == SPEC.kv_bytes(4096) == 512 * MiB
    assert shard.overhead_bytes == 64 * MiB
    assert best.memory_per_node == {"a": SPEC.weight_bytes + 512 * MiB + 64 * MiB}
    assert best.link_cost == 0.0
    # Uncalibrated: flops / (2 FLOPs per parameter * 2 parameters per byte) bytes/s, reading every weight and the
    # KV cache a typical request uses (the tokens of costs.kv_tokens, not the 4,096 reserved).
    read = SPEC.weight_bytes + SPEC.kv_bytes(costs.kv_tokens(4096))
    assert abs(best.tok_s - 1e10 / (4 * read)) < 1e-9


def test_too_big_for_one_node_splits_a_pipeline_by_memory() -> None:
    top = topology(node("a", 6), node("b", 4), links=(link("a", "b"),))
    candidates = plan(SPEC, top, [offer(frozenset({"single", "pipeline"}))])
    best = candidates[0]
    assert best.fits and best.strategy == "pipeline" and sorted(nodes_of(best)) == ["a", "b"]
    check_pipeline(best)
    layers = {s.node_id: s.layer_end - s.layer_start for s in best.shards}
    assert layers["a"] > layers["b"]  # equal speed: memory decides
    assert all(best.memory_per_node[n.id] <= n.memory_available for n in top.nodes)
    # One hidden state forward, and the logits back to the head (SPEC has no vocab_size: latency only).
    assert best.link_cost == 1e-4 + 4096 * 2 / 1.25e9 + 1e-4
    singles = [c for c in candidates if c.strategy == "single"]
    assert singles and not any(c.fits for c in singles)
    assert "needs 9.1 GiB on node a (6.0 GiB available)" in (singles[0].reason or "")


def test_heterogeneous_fast_node_takes_more_layers_but_never_more_than_fits() -> None:
    # Memory binds: the fast node would take ~4/5 of the layers by speed, but only ~20 fit.
    top = topology(node("fast", 6, flops=4e10), node("slow", 8, flops=1e10), links=(link("fast", "slow"),))
    best = plan(SPEC, top, [offer(frozenset({"pipeline"}))], nodes=[NodeId("fast"), NodeId("slow")])[0]
    assert best.fits
    check_pipeline(best)
    layers = {s.node_id: s.layer_end - s.layer_start for s in best.shards}
    assert layers["fast"] > layers["slow"]
    assert best.memory_per_node["fast"] <= 6 * GiB
    assert best.memory_per_node["fast"] + SPEC.layer_bytes + SPEC.kv_bytes(4096, 1) > 6 * GiB  # filled to the brim

    # Memory does not bind: layers follow speed (3:1; the tied embedding's output matmul counts as work where it
    # lives, so the fast node takes 23-24 layers as the first stage and 25-26 behind the slow one).
    roomy = topology(node("fast", 16, flops=3e10), node("slow", 16, flops=1e10), links=(link("fast", "slow"),))
    for candidate in plan(SPEC, roomy, [offer(frozenset({"pipeline"}))]):
        layers = {s.node_id: s.layer_end - s.layer_start for s in candidate.shards}
        assert 23 <= layers["fast"] <= 26 and layers["fast"] + layers["slow"] == 32


def test_tensor_parallel_avoids_a_slow_link_and_takes_the_fast_one() -> None:
    top = topology(
        node("a", 6),
        node("b", 6),
        node("c", 6),
        links=(link("a", "b", latency=0.012), link("b", "c", latency=0.012), link("a", "c", latency=2e-4)),
    )
    candidates = plan(SPEC, top, [offer(frozenset({"tensor"}))])
    fitting = [c for c in candidates if c.fits]
    assert fitting and all(sorted(nodes_of(c)) == ["a", "c"] for c in fitting)
    best = fitting[0]
    assert [(s.tensor_rank, s.tensor_size) for s in best.shards] == [(0, 2), (1, 2)]
    assert all(s.weight_bytes == SPEC.weight_bytes // 2 and s.kv_bytes == SPEC.kv_bytes(4096) // 2 for s in best.shards)
    # Two all-reduces per layer, 2(k-1) ring steps each: latency-dominated.
    assert abs(best.link_cost - 2 * 32 * 2 * (2e-4 + 4096 * 2 / 2 / 1.25e9)) < 1e-12
    slow = [c for c in candidates if not c.fits]
    assert slow and all("b" in nodes_of(c) for c in slow)
    assert "tensor parallel over a 12 ms link" in (slow[0].reason or "")


def test_tensor_parallel_needs_heads_divisible_by_ranks() -> None:
    spec = msgspec.structs.replace(SPEC, n_heads=15, n_kv_heads=3)
    top = topology(node("a", 6), node("b", 6), links=(link("a", "b"),))
    candidates = plan(spec, top, [offer(frozenset({"tensor"}))])
    assert candidates and not any(c.fits for c in candidates)
    assert "n_heads (15) divisible by 2 and n_kv_heads (3) divisible by 2 or dividing it" in (
        candidates[0].reason or ""
    )


def test_tensor_parallel_replicates_kv_heads_fewer_than_the_ranks() -> None:
    spec = msgspec.structs.replace(SPEC, n_heads=4, n_kv_heads=1)  # grouped-query, like Gemma 3 270M
    top = topology(node("a", 6), node("b", 6), links=(link("a", "b"),))
    best = next(c for c in plan(spec, top, [offer(frozenset({"tensor"}))], min_nodes=2) if c.fits)
    assert [s.tensor_rank for s in best.shards] == [0, 1]
    assert all(s.kv_bytes == spec.kv_bytes(4096) for s in best.shards)  # each rank keeps the whole KV head


def test_tensor_ranks_hold_the_embedding_whole_where_the_backend_does_not_split_it() -> None:
    top = topology(node("a", 8), node("b", 8), links=(link("a", "b"),))
    split, whole = (
        next(c for c in plan(SPEC, top, [offer(frozenset({"tensor"}), vocab_parallel=v)], min_nodes=2) if c.fits)
        for v in (True, False)
    )
    layers = SPEC.n_layers * SPEC.layer_bytes
    assert split.shards[0].weight_bytes == SPEC.weight_bytes // 2
    assert whole.shards[0].weight_bytes == layers // 2 + SPEC.embedding_bytes


def test_kv_cache_for_a_long_context_makes_a_placement_not_fit() -> None:
    top = topology(node("a", 10))
    assert plan(SPEC, top, [offer()], context=4096)[0].fits
    long = plan(SPEC, top, [offer()], context=32768)
    assert not any(c.fits for c in long)
    assert long[0].shards[0].kv_bytes == SPEC.kv_bytes(32768) == 4 * GiB
    assert long[0].reason == (
        "needs 12.6 GiB on node a (10.0 GiB available), including 4.0 GiB of KV cache for 32,768 tokens"
    )
    assert plan(SPEC, top, [offer()])[0].context == SPEC.context_length


def test_missing_link_rejects_multi_node_candidates() -> None:
    candidates = plan(SPEC, topology(node("a", 6), node("b", 6)), [offer()])
    assert not any(c.fits for c in candidates)
    multi = [c for c in candidates if c.strategy != "single"]
    assert multi and all("no link measured between" in (c.reason or "") for c in multi)


def test_nodes_restriction() -> None:
    top = topology(node("a", 16), node("b", 6), node("c", 6), links=(link("a", "b"), link("b", "c"), link("a", "c")))
    candidates = plan(SPEC, top, [offer()], nodes=[NodeId("b"), NodeId("c")])
    assert candidates and all("a" not in nodes_of(c) for c in candidates)
    assert candidates[0].fits and sorted(nodes_of(candidates[0])) == ["b", "c"]


def test_max_nodes() -> None:
    top = topology(node("a", 6), node("b", 6), links=(link("a", "b"),))
    candidates = plan(SPEC, top, [offer()], max_nodes=1)
    assert candidates and all(len(c.shards) == 1 and not c.fits for c in candidates)


def test_nothing_fits_all_rejected_with_reasons() -> None:
    top = topology(node("a", 3), node("b", 3), node("c", 2), links=(link("a", "b"), link("b", "c"), link("a", "c")))
    candidates = plan(SPEC, top, [offer()])
    assert {c.strategy for c in candidates} == {"single", "pipeline", "tensor"}
    assert all(not c.fits and c.reason and "needs" in c.reason for c in candidates)


def test_ids_are_deterministic_and_depend_on_content() -> None:
    nodes = [node("a", 6), node("b", 4), node("c", 5)]
    links = (link("a", "b"), link("b", "c"), link("a", "c"))
    first = plan(SPEC, topology(*nodes, links=links), [offer()])
    again = plan(SPEC, topology(*reversed(nodes), links=links[::-1]), [offer()])
    assert [c.id for c in first] == [c.id for c in again]
    assert len({c.id for c in first}) == len(first)
    other = plan(SPEC, topology(*nodes, links=links), [offer()], context=2048)
    assert not {c.id for c in first} & {c.id for c in other}


def test_candidates_round_trip_through_json() -> None:
    top = topology(node("a", 6), node("b", 4), links=(link("a", "b"),))
    candidates = plan(SPEC, top, [offer()])
    data = msgspec.json.encode(candidates)
    assert msgspec.json.decode(data, type=list[Candidate]) == candidates


def test_runtime_filter() -> None:
    top = topology(
        node("a", 16, runtimes={"mlx": "0.29"}),
        node("b", 16, runtimes={"llama_cpp": "0.3.36"}),
        links=(link("a", "b"),),
    )
    llama = plan(SPEC, top, [offer(required_runtime="llama_cpp")])
    assert llama and all(nodes_of(c) == ["b"] for c in llama)
    nobody = plan(SPEC, top, [offer(required_runtime="vllm")])
    assert len(nobody) == 1 and not nobody[0].fits and nobody[0].shards == ()
    assert nobody[0].reason == "no eligible node has the vllm runtime"
    both = plan(
        SPEC,
        top,
        [offer(required_runtime="llama_cpp"), BackendOffer(backend="mlx", strategies=ALL, required_runtime="mlx")],
    )
    assert {(c.backend, nodes_of(c)[0]) for c in both if c.fits} == {("test", "b"), ("mlx", "a")}


def test_untied_output_goes_on_the_last_shard() -> None:
    spec = msgspec.structs.replace(SPEC, tied_output=False, output_bytes=GiB // 2)
    top = topology(node("a", 6), node("b", 6), links=(link("a", "b"),))
    best = next(c for c in plan(spec, top, [offer(frozenset({"pipeline"}))]) if c.fits)
    check_pipeline(best, spec)
    first, last = best.shards
    assert first.weight_bytes == GiB // 2 + (first.layer_end - first.layer_start) * spec.layer_bytes
    assert last.weight_bytes == GiB // 2 + (last.layer_end - last.layer_start) * spec.layer_bytes


def test_default_rank_prefers_fewest_nodes_then_speed() -> None:
    top = topology(node("a", 16, flops=1e10), node("b", 16, flops=2e10), links=(link("a", "b"),))
    ranked = plan(SPEC, top, [offer()])
    assert [len(c.shards) for c in ranked if c.fits][:2] == [1, 1]
    assert nodes_of(ranked[0]) == ["b"]  # the faster single node
    assert default_rank(list(reversed(ranked)), top) == ranked


def test_a_custom_rank_orders_only_the_fitting_ones() -> None:
    top = topology(node("a", 16), node("b", 6), links=(link("a", "b"),))
    candidates = plan(SPEC, top, [offer()], rank=lambda cs, _: sorted(cs, key=lambda c: -len(c.shards)))
    fits = [c.fits for c in candidates]
    assert fits == sorted(fits, reverse=True)
    assert len(candidates[0].shards) == 2


def test_the_heads_kv_tier_is_a_share_of_its_nodes_memory_counted_and_recorded() -> None:
    tiered = offer(head_cache_share=1 / 16, head_cache_cap=1 << 30)
    single = plan(SPEC, topology(node("a", 16)), [tiered])[0]
    (shard,) = single.shards
    assert shard.cache_bytes == 1 << 30, "a 16th of 16 GiB, at most its cap"
    assert shard.overhead_bytes == 64 * MiB + (1 << 30)
    assert single.memory_per_node["a"] == plan(SPEC, topology(node("a", 16)), [offer()])[0].memory_per_node["a"] + (
        1 << 30
    )
    small = plan(SPEC, topology(node("a", 4), node("b", 4)), [tiered], context=4096)[0]
    head, *rest = small.shards
    assert head.cache_bytes == 256 << 20 and all(s.cache_bytes == 0 for s in rest), "the head's only, its node's 16th"
