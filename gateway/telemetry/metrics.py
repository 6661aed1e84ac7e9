"""The gateway's ``/metrics``: what its requests did, and the cluster as the state store has it when scraped.

Each app has its own ``CollectorRegistry`` (several gateways in one process never share series). Per request,
``gateway.telemetry.middleware`` calls ``GatewayMetrics.observe`` with the finished ``RequestRecord``; the
gauges (queues, instances, nodes, links) are read at scrape: ``refresh`` reads the store once (nodes, links,
instances: three reads, concurrent), then the registry is collected. Label values are bounded: ``protocol`` is
one of five words, ``endpoint`` a route template (``other`` when no route matched), ``model`` a catalog model
(``other`` for a name the catalog lacks, ``-`` when the request named none), ``instance`` an instance id.

    meshgate_requests_total{protocol,endpoint,model,status}              counter
    meshgate_request_duration_seconds{protocol,endpoint,model}           histogram, until the last byte is sent
    meshgate_time_to_first_token_seconds{protocol,model}                 histogram, until the runner's first token
    meshgate_inter_token_latency_seconds{model}                          histogram, a stream's mean gap per token
    meshgate_prompt_tokens_total / meshgate_generated_tokens_total / meshgate_instance_requests_total
                                                        {model,instance}  counters (generations only)
    meshgate_queue_depth{instance}, meshgate_active_sequences{instance}  gauges, this gateway's admission queues
    meshgate_class_requests_total{class,model}                           counter, generations by priority class
    meshgate_class_time_to_first_token_seconds{class}                   histogram, TTFT by class
    meshgate_class_queue_depth{instance,class}, meshgate_class_active_sequences{instance,class}   gauges, the
                                            admission queues by class (interactive, batch)
    meshgate_instances{state}, meshgate_instance_info{instance,model,backend,strategy,state}   gauges
    meshgate_node_memory_bytes{node,kind}   kind: offered (the node's memory for models), available (free now, the
                                            planner's input), used (what the placed instances reserve there)
    meshgate_node_cores{node}, meshgate_link_bandwidth_bytes_per_second{src,dst}, meshgate_link_latency_seconds
    meshgate_prefix_cache_hits_total / meshgate_prompt_tokens_cached_total{model,instance}   counters: generations
                                            whose prompt reused a prefix the runner held, and the tokens reused
    meshgate_route_decisions_total{model,rule}   requests this gateway routed, by rule (``routing``: only,
                                            prefix, tier, affinity, spill, least_loaded)
    meshgate_replica_load{instance,kind}    gauges, every gateway's: kind running, queued (``loads``)
    meshgate_replacements_total{model}      instances this gateway re-placed after a failure
    meshgate_stream_resumes_total{model}, meshgate_resume_wait_seconds{model}   counter, histogram: streams moved
                                            to another replica after theirs failed, and what each client waited
    meshgate_runner_restarts_total{node,model}   runners the embedded agent started again (single machine; a
                                            ``meshgate node`` agent serves its own on its ``/metrics``)
    meshgate_kv_tier_bytes / meshgate_kv_tier_budget_bytes / meshgate_kv_tier_entries{instance,tier}   gauges:
                                            a replica's KV cache tier (``tier``: ram, disk), as its head runner
                                            last reported it (``gateway.cluster.kv_tiers``, every few seconds)
    meshgate_kv_tier_hits{instance,tier}, meshgate_kv_tier_misses / meshgate_kv_tier_restored_tokens /
    meshgate_kv_tier_saved / meshgate_kv_tier_refused{instance}   the runner's own counts since it started,
                                            as gauges (they restart with the runner); only replicas with a tier
    process_*                               the gateway process (CPU seconds, memory, open files)

Under ``meshgate serve --workers N`` every series, ``process_*`` too, carries a ``worker`` label (0..N-1): each
worker is its own process with its own counts, and a scrape of the shared port reaches one of them (the kernel
picks, as for any connection), so one scrape shows one worker's figures (docs/operations.md, "Gateway workers").

Counters count since this process started; with several gateways, sum them (not the KV tier's: every gateway
reports the same runner's). Imports ``prometheus_client``, ``telemetry.instruments``, ``telemetry.record`` and
``telemetry.kv_tier``; the control plane is read duck-typed, never imported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import CollectorRegistry

from meshgate.gateway.telemetry.instruments import Counter, Histogram, Instruments, WithLabels
from meshgate.gateway.telemetry.kv_tier import KvTier
from meshgate.gateway.telemetry.record import RequestRecord

__all__ = ["GatewayMetrics"]

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STATES = ("starting", "ready", "draining", "failed")


@dataclass(frozen=True)
class PlaneSnapshot:
    """What a scrape reports of the control plane, read once per scrape (``Snapshots.snapshot``: the gateway's
    ``ControlPlane`` fills it). The records are the cluster's (``Node``, ``Link``, ``Instance``), read by field."""

    nodes: Sequence[Any] = ()
    links: Sequence[Any] = ()
    instances: Sequence[Any] = ()
    queues: Mapping[str, Any] = field(default_factory=dict)  # instance id -> this gateway's queue (``admission.Load``)
    replacements: Mapping[str, int] = field(default_factory=dict)  # model -> instances this gateway re-placed
    routed: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (model, rule) -> requests routed
    replica_load: Callable[[str], Any] | None = None  # instance id -> every gateway's load (running, queued)
    restarts: Metric | None = None  # an embedded agent's runner restarts
    kv_tiers: Mapping[str, KvTier] = field(default_factory=dict)  # instance id -> its runner's KV tier, last read


class Snapshots(Protocol):
    """What ``GatewayMetrics.refresh`` reads: the app's control plane."""

    async def snapshot(self) -> PlaneSnapshot: ...


class GatewayMetrics(Instruments):
    """One gateway app's metrics and its registry (``registry``)."""

    def __init__(self, *, worker: int | None = None) -> None:
        """``worker``: this process's index under ``serve --workers``, a ``worker`` label on every series."""
        self.requests = Counter(
            "meshgate_requests_total", "HTTP requests answered", ("protocol", "endpoint", "model", "status")
        )
        self.duration = Histogram(
            "meshgate_request_duration_seconds",
            "From the request's arrival to its response's last byte",
            ("protocol", "endpoint", "model"),
            DURATION_BUCKETS,
        )
        self.ttft = Histogram(
            "meshgate_time_to_first_token_seconds",
            "From the request's arrival to the first generated token reaching the gateway",
            ("protocol", "model"),
            TTFT_BUCKETS,
        )
        self.itl = Histogram(
            "meshgate_inter_token_latency_seconds",
            "Time between generated tokens (each stream counted as its mean gap, once per gap)",
            ("model",),
            ITL_BUCKETS,
        )
        self.class_requests = Counter(
            "meshgate_class_requests_total", "Generations by priority class", ("class", "model")
        )
        self.class_ttft = Histogram(
            "meshgate_class_time_to_first_token_seconds",
            "From the request's arrival to its first generated token, by priority class",
            ("class",),
            TTFT_BUCKETS,
        )
        self.prompt_tokens = Counter("meshgate_prompt_tokens_total", "Prompt tokens read", ("model", "instance"))
        self.generated_tokens = Counter("meshgate_generated_tokens_total", "Tokens generated", ("model", "instance"))
        self.instance_requests = Counter(
            "meshgate_instance_requests_total", "Generations sent to an instance", ("model", "instance")
        )
        self.prefix_hits = Counter(
            "meshgate_prefix_cache_hits_total",
            "Generations whose prompt began with tokens the runner still held (prefix reuse)",
            ("model", "instance"),
        )
        self.cached_tokens = Counter(
            "meshgate_prompt_tokens_cached_total",
            "Prompt tokens taken from a runner's cache instead of evaluated",
            ("model", "instance"),
        )
        self.resumes = Counter(
            "meshgate_stream_resumes_total", "Streams continued on another replica after theirs failed", ("model",)
        )
        self.resume_wait = Histogram(
            "meshgate_resume_wait_seconds",
            "Seconds a stream's client waited for another replica to take it over",
            ("model",),
            (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120),
        )
        super().__init__(
            [
                self.requests,
                self.class_requests,
                self.class_ttft,
                self.resumes,
                self.resume_wait,
                self.duration,
                self.ttft,
                self.itl,
                self.prompt_tokens,
                self.generated_tokens,
                self.instance_requests,
                self.prefix_hits,
                self.cached_tokens,
            ]
        )
        self.registry = CollectorRegistry()
        if worker is None:
            self.registry.register(self)
            ProcessCollector(registry=self.registry)
        else:
            labels = {"worker": str(worker)}
            self.registry.register(WithLabels(self, labels))
            self.registry.register(WithLabels(ProcessCollector(registry=None), labels))
        self._plane = PlaneSnapshot()  # as of the last scrape

    def observe(
        self, record: RequestRecord, protocol: str, endpoint: str, model: str, status: str, ended: float
    ) -> None:
        """Count one finished request (``ended``: ``time.perf_counter()`` after its last byte)."""
        self.requests.inc((protocol, endpoint, model, status))
        self.duration.observe((protocol, endpoint, model), ended - record.started)
        first = record.first_token_at
        if record.klass is not None:
            self.class_requests.inc((record.klass, model))
            if first is not None:
                self.class_ttft.observe((record.klass,), first - record.started)
        if first is not None:
            self.ttft.observe((protocol, model), first - record.started)
            gaps = (record.generated_tokens or 0) - 1
            if gaps > 0 and record.ended_at is not None:
                self.itl.observe((model,), (record.ended_at - first) / gaps, gaps)
        if record.resumes:
            self.resumes.inc((model,), record.resumes)
            self.resume_wait.observe((model,), record.resume_wait)
        if record.instance is not None:
            key = (model, record.instance)
            self.instance_requests.inc(key)
            self.prompt_tokens.inc(key, record.prompt_tokens or 0)
            self.generated_tokens.inc(key, record.generated_tokens or 0)
            if record.cached_tokens:
                self.prefix_hits.inc(key)
                self.cached_tokens.inc(key, record.cached_tokens)

    async def refresh(self, plane: Snapshots | None) -> None:
        """Read what the scrape reports of ``plane`` (the app's ``ControlPlane``), once."""
        self._plane = await plane.snapshot() if plane is not None else PlaneSnapshot()
        self.forget_instances({i.id for i in self._plane.instances})

    def forget_instances(self, live: set[str]) -> None:
        """Drop the per-instance series of instances that no longer exist: over churn (autoscaling, re-placement
        by new ids, keep-alive) they would grow without bound."""
        for counter in (
            self.prompt_tokens,
            self.generated_tokens,
            self.instance_requests,
            self.prefix_hits,
            self.cached_tokens,
        ):  # each labelled (model, instance)
            counter.values = {k: v for k, v in counter.values.items() if k[1] in live}

    def extra(self) -> Iterator[Metric]:
        yield from self._queues()
        yield from self._instance_families()
        yield from self._node_families()
        yield from self._restarts()
        yield from self._kv_tiers()

    def _queues(self) -> Iterable[Metric]:
        depth = GaugeMetricFamily("meshgate_queue_depth", "Requests waiting for a slot", labels=("instance",))
        active = GaugeMetricFamily(
            "meshgate_active_sequences", "Generations in flight from this gateway", labels=("instance",)
        )
        by_class = ("instance", "class")
        class_depth = GaugeMetricFamily(
            "meshgate_class_queue_depth", "Requests waiting for a slot, by priority class", labels=by_class
        )
        class_active = GaugeMetricFamily(
            "meshgate_class_active_sequences", "Generations in flight from this gateway, by class", labels=by_class
        )
        known = {i.id for i in self._plane.instances}
        for instance_id, load in self._plane.queues.items():
            if instance_id in known or load.active or load.queued:
                depth.add_metric((instance_id,), load.queued)
                active.add_metric((instance_id,), load.active)
                batch_queued, batch_active = load.batch_queued, load.batch_active
                class_depth.add_metric((instance_id, "interactive"), load.queued - batch_queued)
                class_depth.add_metric((instance_id, "batch"), batch_queued)
                class_active.add_metric((instance_id, "interactive"), load.active - batch_active)
                class_active.add_metric((instance_id, "batch"), batch_active)
        return depth, active, class_depth, class_active

    def _instance_families(self) -> Iterable[Metric]:
        counts = dict.fromkeys(STATES, 0)
        info = GaugeMetricFamily(
            "meshgate_instance_info",
            "One per instance: its model, backend, strategy and state",
            labels=("instance", "model", "backend", "strategy", "state"),
        )
        for i in self._plane.instances:
            state = i.state.__struct_config__.tag
            counts[state] = counts.get(state, 0) + 1
            info.add_metric((i.id, i.model, i.placement.backend, i.placement.strategy, state), 1)
        by_state = GaugeMetricFamily("meshgate_instances", "Instances by lifecycle state", labels=("state",))
        for state, count in counts.items():
            by_state.add_metric((state,), count)
        return by_state, info

    def _node_families(self) -> Iterable[Metric]:
        memory = GaugeMetricFamily("meshgate_node_memory_bytes", "A node's memory for models", labels=("node", "kind"))
        cores = GaugeMetricFamily("meshgate_node_cores", "A node's CPU cores", labels=("node",))
        used: dict[str, int] = {}
        for i in self._plane.instances:
            if i.state.__struct_config__.tag != "failed":
                for node, size in i.placement.memory_per_node.items():
                    used[node] = used.get(node, 0) + size
        for n in self._plane.nodes:
            memory.add_metric((n.id, "offered"), n.memory_total)
            memory.add_metric((n.id, "available"), n.memory_available)
            memory.add_metric((n.id, "used"), used.get(n.id, 0))
            cores.add_metric((n.id,), n.cpu_count)
        bandwidth = GaugeMetricFamily(
            "meshgate_link_bandwidth_bytes_per_second", "Measured bandwidth of a link", labels=("src", "dst")
        )
        latency = GaugeMetricFamily(
            "meshgate_link_latency_seconds", "Measured one-way latency of a link", labels=("src", "dst")
        )
        for link in self._plane.links:
            bandwidth.add_metric((link.src, link.dst), link.bandwidth)
            latency.add_metric((link.src, link.dst), link.latency)
        return memory, cores, bandwidth, latency

    def _restarts(self) -> Iterable[Metric]:
        replaced = CounterMetricFamily(
            "meshgate_replacements", "Instances re-placed by this gateway after a failure", labels=("model",)
        )
        for model, count in self._plane.replacements.items():
            replaced.add_metric((model,), count)
        yield replaced
        routed = CounterMetricFamily(
            "meshgate_route_decisions", "Requests routed to a replica, by rule", labels=("model", "rule")
        )
        for (model, rule), count in self._plane.routed.items():
            routed.add_metric((model, rule), count)
        yield routed
        replica_load = self._plane.replica_load
        if replica_load is not None:
            load = GaugeMetricFamily(
                "meshgate_replica_load", "Generations on a replica, every gateway's", labels=("instance", "kind")
            )
            for i in self._plane.instances:
                view = replica_load(i.id)
                load.add_metric((i.id, "running"), view.running)
                load.add_metric((i.id, "queued"), view.queued)
            yield load
        if self._plane.restarts is not None:  # an embedded agent (one machine): its runners are this gateway's
            yield self._plane.restarts

    def _kv_tiers(self) -> Iterable[Metric]:
        known = {i.id for i in self._plane.instances}
        tiers = {i: t for i, t in self._plane.kv_tiers.items() if i in known}
        if not tiers:  # no replica has a tier (or none reported yet): no empty families
            return ()
        per_tier = ("instance", "tier")
        size = GaugeMetricFamily("meshgate_kv_tier_bytes", "Bytes a replica's KV tier holds", labels=per_tier)
        budget = GaugeMetricFamily(
            "meshgate_kv_tier_budget_bytes", "Bytes a replica's KV tier may hold", labels=per_tier
        )
        entries = GaugeMetricFamily(
            "meshgate_kv_tier_entries", "Prompt states a replica's KV tier holds", labels=per_tier
        )
        hits = GaugeMetricFamily(
            "meshgate_kv_tier_hits",
            "Prompts whose start a replica's KV tier held, since its runner started (the runner's count)",
            labels=per_tier,
        )
        misses = GaugeMetricFamily(
            "meshgate_kv_tier_misses",
            "Prompts a replica's KV tier held no start of, since its runner started (the runner's count)",
            labels=("instance",),
        )
        restored = GaugeMetricFamily(
            "meshgate_kv_tier_restored_tokens",
            "Prompt tokens taken from a replica's KV tier instead of evaluated, since its runner started",
            labels=("instance",),
        )
        saved = GaugeMetricFamily(
            "meshgate_kv_tier_saved",
            "Prompt states a replica's KV tier kept, since its runner started (the runner's count)",
            labels=("instance",),
        )
        refused = GaugeMetricFamily(
            "meshgate_kv_tier_refused",
            "Damaged KV tier files a replica's runner refused to load, since it started (the runner's count)",
            labels=("instance",),
        )
        for instance_id, t in tiers.items():
            for tier, (held, allowed, count, hit) in (
                ("ram", (t.ram_bytes, t.ram_budget, t.ram_entries, t.hits_ram)),
                ("disk", (t.disk_bytes, t.disk_budget, t.disk_entries, t.hits_disk)),
            ):
                size.add_metric((instance_id, tier), held)
                budget.add_metric((instance_id, tier), allowed)
                entries.add_metric((instance_id, tier), count)
                hits.add_metric((instance_id, tier), hit)
            misses.add_metric((instance_id,), t.misses)
            restored.add_metric((instance_id,), t.restored_tokens)
            saved.add_metric((instance_id,), t.saved)
            refused.add_metric((instance_id,), t.refused)
        return size, budget, entries, hits, misses, restored, saved, refused
