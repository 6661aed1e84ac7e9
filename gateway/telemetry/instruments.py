"""Counters and histograms keyed by label values, cheap enough for every request, exported by ``prometheus_client``.

``prometheus_client``'s own ``Counter`` and ``Histogram`` take a lock on every call and a histogram walks its
buckets: about 1.7 us per ``observe`` and 3 us with ``.labels()`` on a 2-core build machine, where the gateway
spends about 10 us of CPU per streamed token (``benchmarks/relay.py``), so one observation per token alone would
break the 5% overhead budget. The gateway and the agent update metrics from their event loop only, so these keep plain
dicts (no lock) and hand ``prometheus_client`` metric families when the registry is collected: the library still
owns the registry, the exposition formats and the content negotiation.

``Histogram.observe(key, value, count)`` adds ``count`` observations of ``value`` at once: the inter-token latency
of a stream is observed once per request as its mean gap, ``generated_tokens - 1`` times, so ``_sum / _count`` is
the exact mean over tokens and the buckets place each request's gaps at its mean.

Imports ``prometheus_client`` and the standard library only.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["Counter", "Histogram", "Instruments", "WithLabels", "exposition"]


class Counter:
    """A monotonic count per label-value tuple."""

    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name, self.doc, self.labels = name, doc, tuple(labels)
        self.values: dict[tuple[str, ...], float] = {}

    def inc(self, key: tuple[str, ...], amount: float = 1.0) -> None:
        self.values[key] = self.values.get(key, 0.0) + amount

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name.removesuffix("_total"), self.doc, labels=self.labels)
        for key, value in self.values.items():
            family.add_metric(key, value)
        return family


class Histogram:
    """Bucketed observations per label-value tuple (Prometheus' cumulative ``le`` buckets at export)."""

    def __init__(self, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]) -> None:
        self.name, self.doc, self.labels = name, doc, tuple(labels)
        self.bounds = sorted(buckets)
        self.rows: dict[tuple[str, ...], list[float]] = {}  # per key: a count per bucket, +Inf's, then the sum

    def observe(self, key: tuple[str, ...], value: float, count: int = 1) -> None:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = [0.0] * (len(self.bounds) + 2)
        row[bisect_left(self.bounds, value)] += count  # the first bucket whose bound is >= value (``le``)
        row[-1] += value * count

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
        names = [*(repr(float(b)) for b in self.bounds), "+Inf"]
        for key, row in self.rows.items():
            cumulative, buckets = 0.0, []
            for name, count in zip(names, row[:-1], strict=True):
                cumulative += count
                buckets.append((name, cumulative))
            family.add_metric(list(key), buckets, row[-1])
        return family


class Instruments(Collector):
    """A collector of ``Counter`` and ``Histogram`` objects, plus families computed at scrape (``extra``)."""

    def __init__(self, instruments: Iterable[Counter | Histogram]) -> None:
        self.instruments = list(instruments)

    def extra(self) -> Iterable[Metric]:
        """Families read when scraped (gauges of the moment); none by default."""
        return ()

    def collect(self) -> Iterator[Metric]:
        for instrument in self.instruments:
            yield instrument.family()
        yield from self.extra()


class WithLabels(Collector):
    """``collector``'s families with ``labels`` added to every sample (a process's constant labels, such as the
    ``worker`` of ``meshgate serve --workers``), as Prometheus' target labels would add them."""

    def __init__(self, collector: Collector, labels: dict[str, str]) -> None:
        self.collector = collector
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self.collector.collect():  # each collect builds new families: relabelled in place
            family.samples = [s._replace(labels={**s.labels, **self.labels}) for s in family.samples]
            yield family


def exposition(registry: CollectorRegistry, accept: str) -> tuple[bytes, str]:
    """``registry`` in the format ``accept`` asks for (Prometheus text 0.0.4 by default, or OpenMetrics)."""
    encode, content_type = choose_encoder(accept)
    return encode(registry), content_type
