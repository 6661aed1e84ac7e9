"""Placement planner benchmark: how long ``plan()`` takes on synthetic clusters of 10, 100 and 1,000 nodes.

    .venv/bin/python benchmarks/planner.py [--runs 7]

Nodes have 16-192 GiB available and differ 4x in speed (seeded, so every run plans the same clusters); every
node has llama.cpp, every other one vLLM. Links: clusters of up to 100 nodes are a full mesh; at 1,000 nodes a
full mesh would be a million links, so nodes sit in racks of 10 (a fast full mesh, 0.1 ms) and each links to
one node in each of the two neighbouring racks (1 ms): about 10 links per node. The model is a 405B-parameter
model at ~4 bits (about 230 GiB of weights), planned for 8,192 tokens of context with two backends (llama.cpp:
single/pipeline; vLLM: single/pipeline/tensor). Prints the median of ``--runs`` timed runs per size.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshgate.backends.placement import Link, ModelSpec, Node, NodeId, Topology  # noqa: E402
from meshgate.gateway.cluster.planner import BackendOffer, plan  # noqa: E402

GiB = 1 << 30
RACK = 10
SPEC = ModelSpec(
    name="llama3.1:405b-q4",
    n_layers=126,
    hidden_size=16384,
    n_heads=128,
    n_kv_heads=8,
    head_dim=128,
    context_length=8192,
    layer_bytes=int(1.75 * GiB),
    embedding_bytes=2 * GiB,
    output_bytes=2 * GiB,
    tied_output=False,
)
OFFERS = [
    BackendOffer(backend="llama_cpp", strategies=frozenset({"single", "pipeline"}), required_runtime="llama_cpp"),
    BackendOffer(backend="vllm", strategies=frozenset({"single", "pipeline", "tensor"}), required_runtime="vllm"),
]


def cluster(n: int) -> Topology:
    rng = random.Random(n)
    nodes = tuple(
        Node(
            id=NodeId(f"n{i:04d}"),
            name=f"n{i:04d}",
            memory_total=192 * GiB,
            memory_available=rng.choice([16, 24, 32, 48, 64, 96, 128, 192]) * GiB,
            flops=rng.uniform(0.5e13, 2e13),
            runtimes={"llama_cpp": "0.3.36", **({"vllm": "0.11"} if i % 2 else {})},
        )
        for i in range(n)
    )
    pairs: set[tuple[int, int, float]] = set()
    if n <= 100:
        pairs = {(a, b, 1e-4) for a in range(n) for b in range(a + 1, n)}
    else:
        for a in range(n):
            rack = a - a % RACK
            pairs |= {(a, b, 1e-4) for b in range(a + 1, min(rack + RACK, n))}
            pairs.add((a, (a + RACK) % n, 1e-3))
    links = tuple(
        Link(src=nodes[x].id, dst=nodes[y].id, latency=lat, bandwidth=rng.uniform(1e9, 1e10))
        for a, b, lat in sorted(pairs)
        for x, y in ((a, b), (b, a))
    )
    return Topology(nodes=nodes, links=links)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    print(f"plan() for {SPEC.name} ({SPEC.weight_bytes / GiB:.0f} GiB of weights), median of {args.runs} runs")
    for n in (10, 100, 1000):
        topology = cluster(n)
        candidates = plan(SPEC, topology, OFFERS)  # warm-up
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            plan(SPEC, topology, OFFERS)
            times.append(time.perf_counter() - start)
        fitting = [c for c in candidates if c.fits]
        best = (
            (
                f"best: {fitting[0].backend} {fitting[0].strategy} over {len(fitting[0].shards)} nodes, "
                f"{fitting[0].tok_s:.2f} tok/s"
            )
            if fitting
            else "nothing fits"
        )
        print(
            f"{n:>5,} nodes, {len(topology.links):>6,} links: {statistics.median(times) * 1e3:7.2f} ms, "
            f"{len(candidates)} candidates ({len(fitting)} fit), {best}"
        )
    print("target: 1,000 nodes < 100 ms")


if __name__ == "__main__":
    main()
