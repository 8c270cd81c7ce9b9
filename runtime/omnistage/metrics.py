"""Prometheus metrics through prometheus_client.

Each component (worker, orchestrator, operator) keeps its own `CollectorRegistry`, never the
process-wide default one: tests run several components in one process, and each must report only
its own state. Components expose their state through collectors that read it when scraped, so
there is no second copy of a number to keep in step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

HTTP_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                        120.0, 300.0)
"""Up to five minutes: a diffusion request or a long stream takes far longer than the 10 s where
prometheus_client's default buckets stop."""


def new_registry(*collectors: Collector) -> CollectorRegistry:
    """A registry for one component, holding `collectors`."""
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """The registry's samples and their content type, in the format the Accept header asks for
    (OpenMetrics when a scraper asks for it, else the Prometheus text format)."""
    encode, content_type = choose_encoder(accept or "")
    return encode(registry), content_type


def family(kind: type[GaugeMetricFamily | CounterMetricFamily], name: str, doc: str,
           common: Mapping[str, str], samples: Iterable[tuple[Sequence[str], float]],
           labels: Sequence[str] = ()) -> Metric:
    """A gauge or counter family for a collector: every sample carries the `common` labels, then
    its own values for `labels`. A counter's name ends in _total."""
    fam = kind(name, doc, labels=[*common, *labels])
    for values, value in samples:
        fam.add_metric([*common.values(), *values], value)
    return fam


def summary(name: str, doc: str, common: Mapping[str, str], count: int,
            total: float) -> SummaryMetricFamily:
    """A summary without quantiles: the sample count and the sum of the observations."""
    fam = SummaryMetricFamily(name, doc, labels=list(common))
    fam.add_metric(list(common.values()), count_value=count, sum_value=total)
    return fam


class HttpMetrics:
    """Request metrics of an HTTP server, for its component's registry.

    `route` is the route template (never the raw path), so label cardinality stays bounded.
    """

    def __init__(self, registry: CollectorRegistry, prefix: str = "omnistage_http") -> None:
        self.requests = Counter(
            f"{prefix}_requests", "HTTP requests, by route template, method and status",
            ["route", "method", "status"], registry=registry)
        self.duration = Histogram(
            f"{prefix}_request_duration_seconds",
            "HTTP request latency by route template; a stream counts until its last byte",
            ["route"], buckets=HTTP_LATENCY_BUCKETS, registry=registry)
        self.inflight = Gauge(f"{prefix}_inflight_requests", "HTTP requests being served",
                              registry=registry)
        self.disconnects = Counter(f"{prefix}_client_disconnects",
                                   "Requests aborted because the client went away",
                                   registry=registry)
        self.stream_errors = Counter(f"{prefix}_stream_errors",
                                     "Streams that ended with an error event after they started",
                                     registry=registry)

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        """Count one finished request."""
        self.requests.labels(route, method, str(status)).inc()
        self.duration.labels(route).observe(seconds)
