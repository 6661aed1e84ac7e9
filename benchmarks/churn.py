"""A gateway's memory over instance churn: N instances created, served once and deleted, in process.

    .venv/bin/python benchmarks/churn.py [--instances 10000] [--every 1000]

One ``InstanceManager`` on the memory store with the scripted backend (tests/scripted_plugin.py), its
``LoadBoard`` and ``Admission`` and the gateway's metrics, as a gateway wires them. Each round creates an
instance, routes one request's worth of bookkeeping to it (a routed count, an admission ticket, a tally, a metrics
observation) and deletes it, as autoscaling, keep-alive and re-placement by new ids do over weeks. Prints, every
``--every`` instances, the Python heap traced by ``tracemalloc`` and the process's RSS, and the sizes of the
per-instance tables: after the first thousand, the heap should stay flat (issue 37, 12).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshgate.backends.placement import Node, NodeId  # noqa: E402
from meshgate.gateway.cluster.instances import InstanceManager  # noqa: E402
from meshgate.gateway.cluster.loads import LoadBoard  # noqa: E402
from meshgate.gateway.cluster.store import MemoryStore  # noqa: E402
from meshgate.gateway.serving.admission import Admission  # noqa: E402
from meshgate.gateway.serving.catalog import Catalog  # noqa: E402
from meshgate.gateway.telemetry.metrics import GatewayMetrics  # noqa: E402
from meshgate.gateway.telemetry.record import RequestRecord  # noqa: E402
from tests import scripted_plugin  # noqa: E402


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def main(instances: int, every: int) -> None:
    store = MemoryStore()
    await store.put_node(
        Node(
            id=NodeId("n"),
            name="n",
            memory_total=64 << 30,
            memory_available=64 << 30,
            flops=1e11,
            heartbeat_at=time.time(),
        ),
        ttl=3600,
    )
    catalog = Catalog([scripted_plugin.ScriptedSource()])
    catalog.refresh()
    backend = scripted_plugin.ScriptedBackend()
    manager = InstanceManager(store, [backend], resolve=catalog.resolve, choose=lambda card, backends: backend)
    admission = Admission(parallel=4, max_queue=8)
    board = LoadBoard(store, admission, live=manager.ids)
    metrics = GatewayMetrics()
    tracemalloc.start()
    print(f"{'instances':>10} {'heap MiB':>9} {'max RSS MiB':>12} {'tallies':>8} {'gates':>6} {'series':>7} {'s':>6}")
    began = time.perf_counter()
    for n in range(1, instances + 1):
        instance = await manager.create("scripted")
        board.routed(instance.id)
        ticket = admission.enter(instance.id, "key:a")
        board.settled(instance.id)
        board.tally(instance.id).tokens += 10
        record = RequestRecord(f"r{n}")
        record.instance, record.prompt_tokens, record.generated_tokens = instance.id, 20, 10
        metrics.observe(record, "openai", "chat", "scripted", "200", 1.0)
        ticket.release()
        await manager.delete(instance.id, grace=0)
        board.forget(manager.ids())  # the board's loop, each pass
        if n % 50 == 0:
            await board.sync()
        if n % every == 0:
            metrics.forget_instances(manager.ids())  # a scrape
            heap, _ = tracemalloc.get_traced_memory()
            series = len(metrics.instance_requests.values)
            print(
                f"{n:>10} {heap / 2**20:>9.2f} {_rss_mib():>12.1f} {len(board._tallies):>8} "
                f"{len(admission.loads()):>6} {series:>7} {time.perf_counter() - began:>6.1f}"
            )
    await store.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=1_000)
    args = parser.parse_args()
    asyncio.run(main(args.instances, args.every))
