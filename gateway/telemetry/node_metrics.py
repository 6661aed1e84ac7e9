"""A node agent's ``/metrics``: its machine, its runners and the links it measured.

Served on the agent's probe port (cluster address, cluster secret required, as ``/ping``), from a registry of
its own:

    meshgate_node_memory_bytes{node,kind}       kind: offered (the node's memory for models), available (free now)
    meshgate_node_cores{node}
    meshgate_node_runners{node}                 runner processes this agent runs now
    meshgate_runner_restarts_total{node,model}  runners started again for an instance this agent ran before
                                                (re-placed with a new epoch, or after its runner died)
    meshgate_link_bandwidth_bytes_per_second{src,dst}, meshgate_link_latency_seconds{src,dst}   its last probes
    process_*                                   the agent process

The agent is read through callables given at construction; this module imports no cluster code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from meshgate.backends.placement import Link, Node
from meshgate.gateway.telemetry.instruments import Counter, Instruments

__all__ = ["NodeMetrics"]


class NodeMetrics(Instruments):
    """One agent's metrics; ``restarts`` is counted by the agent, the rest read when scraped."""

    def __init__(
        self,
        name: str,
        node: Callable[[], Node],
        links: Callable[[], Sequence[Link]],
        runners: Callable[[], int],
    ) -> None:
        self.name = name
        self.restarts = Counter(
            "meshgate_runner_restarts_total",
            "Runners started again for an instance this agent ran before",
            ("node", "model"),
        )
        super().__init__([self.restarts])
        self._node, self._links, self._runners = node, links, runners
        self.registry = CollectorRegistry()
        self.registry.register(self)
        ProcessCollector(registry=self.registry)

    def restarted(self, model: str) -> None:
        self.restarts.inc((self.name, model))

    def extra(self) -> Iterator[Metric]:
        node = self._node()
        memory = GaugeMetricFamily(
            "meshgate_node_memory_bytes", "This node's memory for models", labels=("node", "kind")
        )
        memory.add_metric((node.id, "offered"), node.memory_total)
        memory.add_metric((node.id, "available"), node.memory_available)
        yield memory
        cores = GaugeMetricFamily("meshgate_node_cores", "This node's CPU cores", labels=("node",))
        cores.add_metric((node.id,), node.cpu_count)
        yield cores
        runners = GaugeMetricFamily("meshgate_node_runners", "Runner processes this agent runs", labels=("node",))
        runners.add_metric((node.id,), self._runners())
        yield runners
        bandwidth = GaugeMetricFamily(
            "meshgate_link_bandwidth_bytes_per_second", "Measured bandwidth of a link", labels=("src", "dst")
        )
        latency = GaugeMetricFamily(
            "meshgate_link_latency_seconds", "Measured one-way latency of a link", labels=("src", "dst")
        )
        for link in self._links():
            bandwidth.add_metric((link.src, link.dst), link.bandwidth)
            latency.add_metric((link.src, link.dst), link.latency)
        yield bandwidth
        yield latency
