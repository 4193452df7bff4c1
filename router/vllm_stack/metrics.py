"""The router's own Prometheus metrics (prefix ``vllm_stack_router_``, never ``vllm:``).

Every router instance owns its own :class:`CollectorRegistry`, so two routers in one process never
share series. The per-request metrics use small lock-free primitives (below) instead of
``prometheus_client``'s: the router is single-threaded (one event loop), and the client library's
lock and bucket scan per observation cost about as much as a third of the router's whole per-request
budget. They are exposed through a custom collector in the same registry; rarely-changing metrics
(health, breaker, scrape errors, build info) use ``prometheus_client`` directly.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    Exemplar,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector

from vllm_stack.version import router_version

PREFIX = "vllm_stack_router_"

#: Latency buckets (seconds) wide enough for both fast stubs and slow CPU engines.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
DECISION_BUCKETS = (1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3)

#: Why a request was turned away for its tenant (docs/tenants.md): the queue counts ``queue_full`` and
#: ``queue_timeout``, the rate limiter ``rate_limited``, eviction ``evicted``; no other value is counted.
REJECTION_REASONS = ("queue_full", "queue_timeout", "rate_limited", "evicted")

#: Bound on label sets per metric (models x engines x statuses); past it the oldest half is dropped
#: (a counter reset, which rate() handles) so hostile or churning labels cannot grow memory forever.
MAX_SERIES = 10_000


class _Value:
    """A counter or gauge child: a float with inc/dec/set."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum", "exemplars")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: +Inf
        self.sum = 0.0
        # Per bucket, the latest traced observation (trace id, value, time): made on the first one
        self.exemplars: list[tuple[str, float, float] | None] | None = None

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_traced(self, value: float, trace_id: str) -> None:
        """An observation whose request is traced: it becomes its bucket's exemplar (OpenMetrics)."""
        i = bisect.bisect_left(self.bounds, value)
        self.counts[i] += 1
        self.sum += value
        exemplars = self.exemplars
        if exemplars is None:
            exemplars = self.exemplars = [None] * len(self.counts)
        exemplars[i] = (trace_id, value, time.time())

    def observe_zeros(self, n: int) -> None:
        """``n`` observations of 0 at once (stream events that arrived together)."""
        self.counts[0] += n


class _Family:
    """Label values -> child, for one metric."""

    def __init__(
        self, name: str, doc: str, kind: str, labels: Sequence[str], buckets: tuple[float, ...] = ()
    ) -> None:
        self.name = name
        self.doc = doc
        self.kind = kind
        self.labels = tuple(labels)
        self.buckets = tuple(float(b) for b in buckets)
        self.children: dict[tuple[str, ...], _Value | _HistogramChild] = {}

    def child(self, *values: str) -> _Value | _HistogramChild:
        c = self.children.get(values)
        if c is None:
            if len(self.children) >= MAX_SERIES:
                for key in list(self.children)[: MAX_SERIES // 2]:
                    del self.children[key]
            c = _HistogramChild(self.buckets) if self.kind == "histogram" else _Value()
            self.children[values] = c
        return c

    def remove_where(self, label: str, value: str) -> None:
        i = self.labels.index(label)
        for key in [k for k in self.children if k[i] == value]:
            del self.children[key]

    def collect(self) -> Metric:
        if self.kind == "counter":
            fam: Metric = CounterMetricFamily(self.name, self.doc, labels=self.labels)
            for key, c in self.children.items():
                fam.add_metric(key, c.value)  # type: ignore[union-attr]
        elif self.kind == "gauge":
            fam = GaugeMetricFamily(self.name, self.doc, labels=self.labels)
            for key, c in self.children.items():
                fam.add_metric(key, c.value)  # type: ignore[union-attr]
        else:
            fam = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
            for key, h in self.children.items():
                assert isinstance(h, _HistogramChild)
                cumulative: list[Any] = []
                running = 0
                exemplars = h.exemplars
                for i, (bound, count) in enumerate(zip((*self.buckets, math.inf), h.counts, strict=True)):
                    running += count
                    le = "+Inf" if bound == math.inf else _fmt(bound)
                    exemplar = exemplars[i] if exemplars is not None else None
                    if exemplar is None:
                        cumulative.append((le, running))
                    else:
                        trace_id, value, at = exemplar
                        cumulative.append((le, running, Exemplar({"trace_id": trace_id}, value, at)))
                fam.add_metric(key, cumulative, h.sum)
        return fam


def _fmt(bound: float) -> str:
    return repr(float(bound))


class _FastCollector(Collector):
    def __init__(self, families: list[_Family]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            yield family.collect()


class RouterMetrics:
    """All router metrics, registered in a registry private to one router instance."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_total = _Family(
            PREFIX + "requests_total",
            "Requests finished by the router.",
            "counter",
            ["model", "engine", "status"],
        )
        self.request_duration = _Family(
            PREFIX + "request_duration_seconds",
            "End-to-end request latency seen by the router.",
            "histogram",
            ["model"],
            LATENCY_BUCKETS,
        )
        self.ttft = _Family(
            PREFIX + "ttft_seconds",
            "Time to the first streamed chunk, seen by the router.",
            "histogram",
            ["model"],
            LATENCY_BUCKETS,
        )
        self.itl = _Family(
            PREFIX + "itl_seconds",
            "Time between streamed events (tokens), seen by the router; events read together count 0.",
            "histogram",
            ["model"],
            ITL_BUCKETS,
        )
        self.in_flight = _Family(
            PREFIX + "in_flight_requests",
            "Requests the router has in flight per engine.",
            "gauge",
            ["engine"],
        )
        self.routing_decisions = _Family(
            PREFIX + "routing_decisions_total",
            "Routing decisions by strategy and reason.",
            "counter",
            ["strategy", "reason"],
        )
        self.routing_decision_seconds = _Family(
            PREFIX + "routing_decision_seconds",
            "Time spent choosing an engine.",
            "histogram",
            [],
            DECISION_BUCKETS,
        )
        self.retries_total = _Family(
            PREFIX + "retries_total", "Requests retried on another engine.", "counter", ["model", "reason"]
        )
        # Prefix-cache routing: what the index predicted for the chosen engine against what the engine
        # reported (usage.prompt_tokens_details.cached_tokens), so a wrong index shows.
        self.prefix_predictions = _Family(
            PREFIX + "prefix_predictions_total",
            "Prefix-cache predictions per request by index mode and outcome: exact (within one block), "
            "over (the index claimed more than the engine had), under (the engine had more), unreported.",
            "counter",
            ["mode", "outcome"],
        )
        self.prefix_predicted_tokens = _Family(
            PREFIX + "prefix_predicted_cached_tokens_total",
            "Prompt tokens the index predicted cached on the chosen engine.",
            "counter",
            ["mode"],
        )
        self.prefix_cached_tokens = _Family(
            PREFIX + "prefix_engine_cached_tokens_total",
            "Prompt tokens the engine reported cached, for requests whose usage reported it.",
            "counter",
            ["mode"],
        )
        # The router's per-model queue (vllm_stack.director.queue)
        self.queue_length = _Family(
            PREFIX + "queue_length",
            "Requests waiting in the router's queue for an engine of the model (every engine saturated, "
            "or none ready yet).",
            "gauge",
            ["model"],
        )
        self.queue_wait = _Family(
            PREFIX + "queue_wait_seconds",
            "Time requests spent in the router's queue, observed when they left it (any outcome).",
            "histogram",
            ["model", "class"],
            LATENCY_BUCKETS,
        )
        self.queue_exits = _Family(
            PREFIX + "queue_exits_total",
            "Requests that left the router's queue, by class and outcome: dispatched, timeout, "
            "client_closed, displaced (a full queue made room for a higher priority), failed.",
            "counter",
            ["model", "class", "outcome"],
        )
        # Tenants (docs/tenants.md): ``tenant`` is a bounded label (declared names, default, other)
        self.tenant_queue_wait = _Family(
            PREFIX + "tenant_queue_wait_seconds",
            "Time requests spent in the router's queue by model, priority class (band) and tenant, observed "
            "when they left it (any outcome).",
            "histogram",
            ["model", "class", "tenant"],
            LATENCY_BUCKETS,
        )
        self.tenant_rejections = _Family(
            PREFIX + "tenant_rejections_total",
            "Requests turned away by tenant and reason: queue_full (429: a full band, or pushed out of "
            "it), queue_timeout (429, 503 with no engine: waited the queue's TTL), rate_limited (429: "
            "over the tenant's rate limit), evicted (503: a sheddable request aborted for critical work).",
            "counter",
            ["tenant", "reason"],
        )
        self.tenant_tokens = _Family(
            PREFIX + "tenant_tokens",
            "Tokens counted against the tenant's tokens-per-minute limit in its current window (set by "
            "the rate limiter).",
            "gauge",
            ["tenant"],
        )
        # Disaggregated prefill (vllm_stack.director.disagg)
        self.disagg_requests = _Family(
            PREFIX + "disagg_requests_total",
            "Requests of models with prefill engines, by outcome: disaggregated (prefill there, decode "
            "elsewhere), short (the uncached part was below the threshold: decode only), no_prefill_engine, "
            "prefill_failed (served decode-only after the prefill leg failed), client_params (the client "
            "sent kv_transfer_params itself: passed through).",
            "counter",
            ["model", "outcome"],
        )
        self.prefill_seconds = _Family(
            PREFIX + "disagg_prefill_seconds",
            "Time of the prefill leg of disaggregated requests (its answer, or its failure).",
            "histogram",
            ["model"],
            LATENCY_BUCKETS,
        )
        # LMCache-aware routing (vllm_stack.scheduling.plugins.lmcache_lookup_picker)
        self.lmcache_lookups = _Family(
            PREFIX + "lmcache_lookups_total",
            "Requests of the kvaware picker by outcome: routed (to the engine whose LMCache holds the "
            "prompt's prefix), miss (no instance holds its first chunk), below_threshold (the holder lacks "
            "more than the threshold), holder_unavailable (the holder is no candidate engine now), "
            "holder_busy (over the in-flight bound), short_prompt (under one 256-token chunk), no_tokens "
            "(no tokenizer for the model), error, timeout, bad_answer, backoff (the controller failed "
            "recently: not asked). Every outcome but routed falls back to the prefix-cache picker.",
            "counter",
            ["model", "outcome"],
        )
        self.lmcache_lookup_seconds_family = _Family(
            PREFIX + "lmcache_lookup_seconds",
            "Time of one lookup at the LMCache controller (its answer, or its failure).",
            "histogram",
            [],
            LATENCY_BUCKETS,
        )
        # The Inference Extension: gateway mode's questions to an endpoint picker, and our picker's streams
        self.endpoint_picker = _Family(
            PREFIX + "endpoint_picker_requests_total",
            "Gateway mode: requests whose engine was asked of the endpoint picker, by outcome: picked, "
            "immediate (it answered the client itself, e.g. 429), unknown_endpoint (it named no engine of "
            "this router), error (down or broken), timeout. error, timeout and unknown_endpoint are "
            "scheduled here (fail-open) or answered 503 (fail-closed).",
            "counter",
            ["outcome"],
        )
        self.endpoint_picker_ends = _Family(
            PREFIX + "endpoint_picker_answer_ends_total",
            "Gateway mode: picked requests whose answer's end was told to the endpoint picker (told), or "
            "whose picker stream had ended before it (cut: the picker stopped or failed while the answer "
            "was under way; a gateway that passes the answer through its picker, as Envoy does, would have "
            "failed the request), or that the picker did not close in time (timeout).",
            "counter",
            ["outcome"],
        )
        self.endpoint_picker_seconds_family = _Family(
            PREFIX + "endpoint_picker_seconds",
            "Gateway mode: time from sending a request's body to the endpoint picker to its answer.",
            "histogram",
            [],
            LATENCY_BUCKETS,
        )
        self.ext_proc_streams = _Family(
            PREFIX + "ext_proc_streams_total",
            "Endpoint picker: ext_proc streams (one per gateway request) by outcome: picked, immediate "
            "(an error answered by the gateway), header_only (no body: any engine), aborted (the stream "
            "ended before an answer), protocol_error, idle_timeout (silent while its request arrived: "
            "408), evicted (stalled at the stream cap, its place given to a new stream: 408), refused "
            "(the stream cap reached: RESOURCE_EXHAUSTED), answer_timeout (picked, then no answer "
            "message for ext_proc_answer_timeout: the engine booking released).",
            "counter",
            ["outcome"],
        )
        self._fast = [
            self.endpoint_picker,
            self.endpoint_picker_ends,
            self.endpoint_picker_seconds_family,
            self.ext_proc_streams,
            self.lmcache_lookups,
            self.lmcache_lookup_seconds_family,
            self.disagg_requests,
            self.prefill_seconds,
            self.queue_length,
            self.queue_wait,
            self.queue_exits,
            self.tenant_queue_wait,
            self.tenant_rejections,
            self.tenant_tokens,
            self.requests_total,
            self.request_duration,
            self.ttft,
            self.itl,
            self.in_flight,
            self.routing_decisions,
            self.routing_decision_seconds,
            self.retries_total,
            self.prefix_predictions,
            self.prefix_predicted_tokens,
            self.prefix_cached_tokens,
        ]
        r.register(_FastCollector(self._fast))
        self._decision_seconds = self.routing_decision_seconds.child()
        self.lmcache_lookup_seconds = self.lmcache_lookup_seconds_family.child()
        self.endpoint_picker_seconds = self.endpoint_picker_seconds_family.child()

        self.engine_healthy = Gauge(
            PREFIX + "engine_healthy",
            "1 when the engine is healthy for the model.",
            ["engine", "model"],
            registry=r,
        )
        self.engines_sleeping = Gauge(
            PREFIX + "engines_sleeping",
            "Healthy engines asleep (vLLM's sleep mode): not candidates until woken.",
            registry=r,
        )
        self.engine_wakeups = Counter(
            PREFIX + "engine_wakeups_total",
            "Sleeping engines the router woke for a request that had no awake engine, by outcome.",
            ["outcome"],
            registry=r,
        )
        # Streams that survive their engine (director.continuation): not on the plain path
        self.stream_continuations = Counter(
            PREFIX + "stream_continuations_total",
            "Streams whose engine broke after they began, by outcome: continued (sent to another engine), "
            "completed (a continued stream ended whole), refused (the other engine answered with an "
            "error), or why none was tried (parameter_<name>, partial_event, too_long, no_engine, ...).",
            ["model", "outcome"],
            registry=r,
        )
        self.stream_continuation_seconds = Histogram(
            PREFIX + "stream_continuation_seconds",
            "Time from a stream's break to the first event of its continuation: the client's extra wait.",
            buckets=LATENCY_BUCKETS,
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
        self.rate_limit_store_errors = Counter(
            PREFIX + "rate_limit_store_errors_total",
            "Rate-limit decisions or corrections the shared store (Redis) failed; each decision then "
            "falls back to this replica's own buckets.",
            registry=r,
        )
        # LoRA adapters (not on the plain path): loads, unloads and where adapter requests were sent.
        self.adapter_loads = Counter(
            PREFIX + "adapter_loads_total",
            "LoRA adapter loads the router made, by tier and outcome (ok, failed).",
            ["tier", "outcome"],
            registry=r,
        )
        self.adapter_load_seconds = Histogram(
            PREFIX + "adapter_load_seconds",
            "Time of one POST /v1/load_lora_adapter the router made (an eviction before it included).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.adapter_unloads = Counter(
            PREFIX + "adapter_unloads_total",
            "LoRA adapters the router unloaded to free a slot, by tier.",
            ["tier"],
            registry=r,
        )
        self.adapter_placements = Counter(
            PREFIX + "adapter_placements_total",
            "Where requests for registered adapters were sent: held (an engine had it), loading (a load "
            "under way), free_slot, evict (an adapter unloaded first), over_capacity (no slot could be freed).",
            ["outcome"],
            registry=r,
        )
        # The Batch API (vllm_stack.batch): figures of the shared store, and this router's lines.
        self.batches = Gauge(
            PREFIX + "batches",
            "Batches by status (validating, in_progress, finalizing, completed, failed, expired, cancelling, "
            "cancelled), as the batch store holds them (every router replica reports the same figures).",
            ["status"],
            registry=r,
        )
        self.batch_lines = Counter(
            PREFIX + "batch_lines",
            "Batch lines this router sent, by outcome: completed (the engine's 200), failed (an error "
            "answer, written to the error file), retried (held back while no engine had a running slot to "
            "spare beyond the reserve, shed by the director, or their engine failed: sent again later).",
            ["outcome"],
            registry=r,
        )
        self.batch_queue_depth = Gauge(
            PREFIX + "batch_queue_depth",
            "Batch lines waiting to be sent, in every running batch.",
            registry=r,
        )
        self.batch_lines_in_flight = Gauge(
            PREFIX + "batch_lines_in_flight", "Batch lines this router has sent and awaits.", registry=r
        )
        self.build_info = Gauge(PREFIX + "build_info", "Router build information.", ["version"], registry=r)
        self.build_info.labels(router_version()).set(1)

    # Hot-path helpers.
    def observe_request(self, model: str, engine: str, status: str, duration: float) -> None:
        self.requests_total.child(model, engine, status).inc()
        self.request_duration.child(model).observe(duration)  # type: ignore[union-attr]

    def observe_ttft(self, model: str, seconds: float) -> None:
        self.ttft.child(model).observe(seconds)  # type: ignore[union-attr]

    def observe_ttft_traced(self, model: str, seconds: float, trace_id: str) -> None:
        """TTFT of a traced request: its trace id becomes the bucket's exemplar (the dashboard's link)."""
        self.ttft.child(model).observe_traced(seconds, trace_id)  # type: ignore[union-attr]

    def itl_child(self, model: str) -> _HistogramChild:
        """The ITL histogram of a model (an exchange holds it for the length of its stream)."""
        return self.itl.child(model)  # type: ignore[return-value]

    def in_flight_child(self, engine: str) -> _Value:
        return self.in_flight.child(engine)  # type: ignore[return-value]

    def routing_decision(self, strategy: str, reason: str, seconds: float) -> None:
        self.routing_decisions.child(strategy, reason).inc()
        self._decision_seconds.observe(seconds)  # type: ignore[union-attr]

    def decision_counter(self, strategy: str, reason: str) -> _Value:
        """The counter of one (strategy, reason) pair, for a caller that keeps it (a profile does)."""
        return self.routing_decisions.child(strategy, reason)  # type: ignore[return-value]

    def observe_decision_seconds(self, seconds: float) -> None:
        self._decision_seconds.observe(seconds)  # type: ignore[union-attr]

    def observe_prefix_prediction(self, mode: str, predicted: int, cached: int | None, block: int) -> None:
        """One request's predicted cached prompt tokens against the engine's report (None: not reported)."""
        self.prefix_predicted_tokens.child(mode).inc(predicted)  # type: ignore[union-attr]
        if cached is None:
            outcome = "unreported"
        else:
            self.prefix_cached_tokens.child(mode).inc(cached)  # type: ignore[union-attr]
            outcome = (
                "over" if predicted - cached >= block else "under" if cached - predicted >= block else "exact"
            )
        self.prefix_predictions.child(mode, outcome).inc()  # type: ignore[union-attr]

    def queue_length_child(self, model: str) -> _Value:
        return self.queue_length.child(model)  # type: ignore[return-value]

    def queue_exit(self, model: str, cls: str, outcome: str, seconds: float) -> None:
        self.queue_wait.child(model, cls).observe(seconds)  # type: ignore[union-attr]
        self.queue_exits.child(model, cls, outcome).inc()

    def tenant_queue_exit(self, model: str, cls: str, tenant: str, seconds: float) -> None:
        """A request of ``tenant`` (its metric label) left ``model``'s queue after ``seconds``."""
        self.tenant_queue_wait.child(model, cls, tenant).observe(seconds)  # type: ignore[union-attr]

    def tenant_rejected(self, tenant: str, reason: str) -> None:
        """A request of ``tenant`` (its metric label) was turned away for ``reason``, one of
        :data:`REJECTION_REASONS` (anything else is a bug of the caller's, refused here)."""
        if reason not in REJECTION_REASONS:
            raise ValueError(f"not a tenant rejection reason: {reason!r} (REJECTION_REASONS)")
        self.tenant_rejections.child(tenant, reason).inc()

    def tenant_tokens_child(self, tenant: str) -> _Value:
        """The gauge of ``tenant``'s (its metric label) tokens in its current rate-limit window."""
        return self.tenant_tokens.child(tenant)  # type: ignore[return-value]

    def lmcache_lookup(self, model: str, outcome: str) -> None:
        self.lmcache_lookups.child(model, outcome).inc()

    def disagg(self, model: str, outcome: str) -> None:
        self.disagg_requests.child(model, outcome).inc()

    def observe_prefill(self, model: str, seconds: float) -> None:
        self.prefill_seconds.child(model).observe(seconds)  # type: ignore[union-attr]

    def retry(self, model: str, reason: str) -> None:
        self.retries_total.child(model, reason).inc()

    def forget_engine(self, engine: str) -> None:
        """Drop the per-engine series of an engine that left, so gauges do not report ghosts and
        pod churn under Kubernetes does not grow the series forever."""
        self.in_flight.remove_where("engine", engine)
        self.requests_total.remove_where("engine", engine)
        for gauge in (self.circuit_breaker_state, self.engine_scrape_errors):
            try:
                gauge.remove(engine)
            except KeyError:
                pass
        for labels in [tuple(k) for k in self.engine_healthy._metrics]:  # noqa: SLF001 - no public listing
            if labels[0] == engine:
                self.engine_healthy.remove(*labels)

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """This router's registry in the format the scraper accepts: OpenMetrics (which carries the
        TTFT exemplars) when its ``Accept`` names it, as Prometheus's does, else the text format."""
        if "application/openmetrics-text" in accept:
            return openmetrics.generate_latest(self.registry), openmetrics.CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
