"""The router's own Prometheus metrics (prefix ``vllm_stack_router_``, never ``vllm:``).

Every router instance owns its own :class:`CollectorRegistry`, so two routers in one process never
share series. Labelled children used on the hot path are cached in small bounded dictionaries because
``Metric.labels()`` costs a lock and a tuple build on every call.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from vllm_stack.version import router_version

PREFIX = "vllm_stack_router_"

#: Latency buckets (seconds) wide enough for both fast stubs and slow CPU engines.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
DECISION_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)

#: Bound on cached label children (models x engines x statuses) so hostile model names cannot grow memory.
_MAX_CACHED_CHILDREN = 4096


class _ChildCache:
    """A bounded cache of ``metric.labels(*key)`` children."""

    __slots__ = ("_metric", "_children")

    def __init__(self, metric: Counter | Gauge | Histogram) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], object] = {}

    def get(self, *key: str):  # noqa: ANN201 - returns the prometheus child type of the metric
        child = self._children.get(key)
        if child is None:
            if len(self._children) >= _MAX_CACHED_CHILDREN:
                self._children.clear()
            child = self._metric.labels(*key)
            self._children[key] = child
        return child


class RouterMetrics:
    """All router metrics, registered in a registry private to one router instance."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_total = Counter(
            PREFIX + "requests_total",
            "Requests finished by the router.",
            ["model", "engine", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            PREFIX + "request_duration_seconds",
            "End-to-end request latency seen by the router.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "ttft_seconds",
            "Time to the first streamed chunk, seen by the router.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            PREFIX + "itl_seconds",
            "Time between streamed chunks, seen by the router.",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            PREFIX + "in_flight_requests",
            "Requests the router has in flight per engine.",
            ["engine"],
            registry=r,
        )
        self.routing_decisions = Counter(
            PREFIX + "routing_decisions_total",
            "Routing decisions by strategy and reason.",
            ["strategy", "reason"],
            registry=r,
        )
        self.routing_decision_seconds = Histogram(
            PREFIX + "routing_decision_seconds",
            "Time spent choosing an engine.",
            buckets=DECISION_BUCKETS,
            registry=r,
        )
        self.retries_total = Counter(
            PREFIX + "retries_total", "Requests retried on another engine.", ["model", "reason"], registry=r
        )
        self.engine_healthy = Gauge(
            PREFIX + "engine_healthy",
            "1 when the engine is healthy for the model.",
            ["engine", "model"],
            registry=r,
        )
        self.circuit_breaker_state = Gauge(
            PREFIX + "circuit_breaker_state",
            "Circuit breaker state per engine: 0 closed, 1 half-open, 2 open.",
            ["engine"],
            registry=r,
        )
        self.engine_scrape_errors = Counter(
            PREFIX + "engine_scrape_errors_total",
            "Failed scrapes of an engine's /metrics.",
            ["engine"],
            registry=r,
        )
        self.build_info = Gauge(PREFIX + "build_info", "Router build information.", ["version"], registry=r)
        self.build_info.labels(router_version()).set(1)

        self._requests = _ChildCache(self.requests_total)
        self._duration = _ChildCache(self.request_duration)
        self._ttft = _ChildCache(self.ttft)
        self._itl = _ChildCache(self.itl)
        self._in_flight = _ChildCache(self.in_flight)
        self._decisions = _ChildCache(self.routing_decisions)
        self._retries = _ChildCache(self.retries_total)

    # Hot-path helpers (cached children).
    def observe_request(self, model: str, engine: str, status: str, duration: float) -> None:
        self._requests.get(model, engine, status).inc()
        self._duration.get(model).observe(duration)

    def observe_ttft(self, model: str, seconds: float) -> None:
        self._ttft.get(model).observe(seconds)

    def itl_child(self, model: str):  # noqa: ANN201
        """The ITL histogram child for a model (the proxy observes every chunk gap on it)."""
        return self._itl.get(model)

    def in_flight_child(self, engine: str):  # noqa: ANN201
        return self._in_flight.get(engine)

    def routing_decision(self, strategy: str, reason: str, seconds: float) -> None:
        self._decisions.get(strategy, reason).inc()
        self.routing_decision_seconds.observe(seconds)

    def retry(self, model: str, reason: str) -> None:
        self._retries.get(model, reason).inc()

    def forget_engine(self, engine: str) -> None:
        """Drop the per-engine series of an engine that left, so gauges do not report ghosts."""
        for gauge in (self.in_flight, self.circuit_breaker_state):
            try:
                gauge.remove(engine)
            except KeyError:
                pass
        self._in_flight = _ChildCache(self.in_flight)
        for labels in list(_label_sets(self.engine_healthy)):
            if labels[0] == engine:
                self.engine_healthy.remove(*labels)

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition of this router's registry and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _label_sets(metric: Gauge) -> list[tuple[str, ...]]:
    return [tuple(labels) for labels in metric._metrics]  # noqa: SLF001 - no public API to list children
