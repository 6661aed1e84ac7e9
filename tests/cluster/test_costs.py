"""The planner's cost model: tok/s and prompt tok/s from calibration numbers, as plain functions and through plan()."""

from __future__ import annotations

import msgspec
import pytest

from meshgate.backends.placement import Calibration, Link, ModelSpec, Node, NodeId, Topology
from meshgate.gateway.cluster import costs
from meshgate.gateway.cluster.planner import BackendOffer, plan

MiB = 1 << 20
GiB = 1 << 30

# Shaped like Gemma 3 270M: 18 small layers, a big tied embedding, one KV head, a 262k vocabulary.
SPEC = ModelSpec(
    name="g",
    n_layers=18,
    hidden_size=640,
    n_heads=4,
    n_kv_heads=1,
    head_dim=256,
    context_length=32768,
    layer_bytes=4 * MiB,
    embedding_bytes=170 * MiB,
    vocab_size=262144,
)
CAL = Calibration(decode_bytes_per_s=10e9, prefill_flops=50e9, step_seconds=0.002, params_per_byte=1.5)
LLAMA = BackendOffer(backend="llama_cpp", strategies=frozenset({"single", "pipeline"}))


def node(name: str, cal: Calibration | None = CAL, flops: float = 1e11) -> Node:
    return Node(
        id=NodeId(name),
        name=name,
        memory_total=8 * GiB,
        memory_available=8 * GiB,
        flops=flops,
        calibration={"llama_cpp": cal} if cal else {},
    )


def links(*pairs: tuple[str, str], latency: float = 1e-4, bandwidth: float = 1e9) -> tuple[Link, ...]:
    out = []
    for a, b in pairs:
        out += [Link(src=NodeId(a), dst=NodeId(b), latency=latency, bandwidth=bandwidth)]
        out += [Link(src=NodeId(b), dst=NodeId(a), latency=latency, bandwidth=bandwidth)]
    return tuple(out)


def best(spec: ModelSpec, top: Topology, **kw: object):
    return next(c for c in plan(spec, top, [LLAMA], **kw) if c.fits)  # type: ignore[arg-type]


def expected_decode(spec: ModelSpec, context: int, cal: Calibration = CAL) -> float:
    read = spec.weight_bytes + spec.kv_bytes(costs.kv_tokens(context))
    return cal.step_seconds + read / cal.decode_bytes_per_s


def test_single_node_decode_is_step_plus_bytes_over_measured_bandwidth() -> None:
    c = best(SPEC, Topology(nodes=(node("a"),)), context=4096)
    assert c.tok_s == pytest.approx(1 / expected_decode(SPEC, 4096))
    assert 30 < c.tok_s < 40  # 246 MiB at 10 GB/s (26 ms) + 2 ms


def test_decode_reads_the_kv_a_request_uses_not_the_context_reserved() -> None:
    top = Topology(nodes=(node("a"),))
    at_4k, at_32k = best(SPEC, top, context=4096), best(SPEC, top, context=32768)
    assert at_32k.shards[0].kv_bytes == 8 * at_4k.shards[0].kv_bytes  # memory counts the whole context...
    assert at_32k.tok_s == pytest.approx(at_4k.tok_s)  # ...decode speed does not
    short = best(SPEC, top, context=128)  # a context shorter than a typical request caps the KV read
    assert short.tok_s > at_4k.tok_s
    assert short.tok_s == pytest.approx(1 / expected_decode(SPEC, 128))


def test_decode_time_scales_with_weight_bytes_and_inversely_with_bandwidth() -> None:
    top = Topology(nodes=(node("a"),))
    base = 1 / best(SPEC, top).tok_s - CAL.step_seconds
    double = msgspec.structs.replace(SPEC, layer_bytes=2 * SPEC.layer_bytes, embedding_bytes=2 * SPEC.embedding_bytes)
    kv = SPEC.kv_bytes(costs.kv_tokens(SPEC.context_length)) / CAL.decode_bytes_per_s
    assert 1 / best(double, top).tok_s - CAL.step_seconds == pytest.approx(2 * (base - kv) + kv)
    fast = Topology(nodes=(node("a", msgspec.structs.replace(CAL, decode_bytes_per_s=20e9)),))
    assert 1 / best(SPEC, fast).tok_s - CAL.step_seconds == pytest.approx(base / 2)


def test_pipeline_adds_link_latency_per_hop_and_the_logits_back() -> None:
    two = Topology(nodes=(node("a"), node("b")), links=links(("a", "b")))
    c = best(SPEC, two, min_nodes=2)
    assert c.strategy == "pipeline" and len(c.shards) == 2
    link = 1e-4 + 640 * costs.ACTIVATION_BYTES / 1e9 + 1e-4 + 262144 * costs.LOGIT_BYTES / 1e9
    assert c.link_cost == pytest.approx(link)
    # A split holds a second copy of the tied embedding only where the backend says so (not here): same bytes.
    assert 1 / c.tok_s == pytest.approx(expected_decode(SPEC, SPEC.context_length) + link)
    slow = Topology(nodes=two.nodes, links=links(("a", "b"), latency=5e-3))
    assert 1 / best(SPEC, slow, min_nodes=2).tok_s - 1 / c.tok_s == pytest.approx(2 * (5e-3 - 1e-4))
    three = Topology(nodes=(*two.nodes, node("c")), links=links(("a", "b"), ("b", "c"), ("a", "c")))
    c3 = best(SPEC, three, min_nodes=3)
    assert len(c3.shards) == 3
    assert c3.link_cost - c.link_cost == pytest.approx(1e-4 + 640 * costs.ACTIVATION_BYTES / 1e9)  # one more hop


def test_pipeline_balances_layers_by_measured_speed() -> None:
    fast = node("fast", msgspec.structs.replace(CAL, decode_bytes_per_s=30e9))
    top = Topology(nodes=(fast, node("slow")), links=links(("fast", "slow")))
    small = msgspec.structs.replace(SPEC, embedding_bytes=MiB)
    c = next(c for c in plan(small, top, [LLAMA], min_nodes=2) if c.fits)
    layers = {s.node_id: s.layer_end - s.layer_start for s in c.shards}
    assert layers == {"fast": 14, "slow": 4}  # 3x the bandwidth: about 3x the layers
    # The 170 MiB tied embedding is read by the stage that holds it (here the head): that stage takes fewer layers.
    c = next(c for c in plan(SPEC, top, [LLAMA], min_nodes=2) if c.fits)
    assert {s.node_id: s.layer_end - s.layer_start for s in c.shards} == {"fast": 3, "slow": 15}


def test_prompt_speed_from_prefill_flops() -> None:
    top = Topology(nodes=(node("a"),))
    c = best(SPEC, top, context=4096)
    n = costs.TYPICAL_PROMPT
    per_token = (2 * 1.5 * 18 * SPEC.layer_bytes + 18 * 4 * 4 * 256 * n / 2) / CAL.prefill_flops
    seconds = CAL.step_seconds + n * per_token + SPEC.embedding_bytes / CAL.decode_bytes_per_s
    assert c.prompt_tok_s == pytest.approx(n / seconds)
    assert c.prompt_tok_s > 5 * c.tok_s  # prompts run as batches: far faster than decoding
    faster = Topology(nodes=(node("a", msgspec.structs.replace(CAL, prefill_flops=100e9)),))
    assert best(SPEC, faster, context=4096).prompt_tok_s > 1.5 * c.prompt_tok_s
    tiny = best(SPEC, top, context=64)  # a prompt never longer than the context
    assert costs.prompt_tokens(64) == 63 and tiny.prompt_tok_s > 0


def test_uncalibrated_nodes_fall_back_on_flops_and_calibrated_ones_win() -> None:
    bare = node("bare", cal=None, flops=4e10)
    c = best(SPEC, Topology(nodes=(bare,)))
    assert 1 / c.tok_s == pytest.approx(4 * (SPEC.weight_bytes + SPEC.kv_bytes(costs.kv_tokens(32768))) / 4e10)
    other = msgspec.structs.replace(node("x"), calibration={"mlx": CAL})  # another backend's measurement
    assert best(SPEC, Topology(nodes=(other,))).tok_s == pytest.approx(
        1 / (4 * (SPEC.weight_bytes + SPEC.kv_bytes(costs.kv_tokens(32768))) / 1e11)
    )
    quick = node("quick", msgspec.structs.replace(CAL, decode_bytes_per_s=40e9), flops=1e9)
    slowcal = node("slowcal", flops=1e12)
    ranked = [c for c in plan(SPEC, Topology(nodes=(slowcal, quick)), [LLAMA]) if c.fits]
    assert ranked[0].shards[0].node_id == "quick"  # measured speed, not the numpy matmul, orders singles


def test_calibration_round_trips_with_the_node_record() -> None:
    n = node("a")
    assert msgspec.json.decode(msgspec.json.encode(n), type=Node) == n
    old = msgspec.json.encode({"id": "a", "name": "a"})  # a record from an agent that does not calibrate
    assert msgspec.json.decode(old, type=Node).calibration == {}
