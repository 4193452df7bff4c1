"""The router's discovery metrics, read from a discovery source's status at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from vllm_stack.engines.discovery.base import DiscoveryStatus
from vllm_stack.metrics import PREFIX


class DiscoveryCollector(Collector):
    """Whether engine discovery works, read from its status at scrape time (a Role without a verb, an
    unreachable API server: the last known engines keep serving, so nothing else would show it)."""

    def __init__(self, status: DiscoveryStatus) -> None:
        self._status = status

    def collect(self) -> Iterator[Metric]:
        status = self._status
        healthy = GaugeMetricFamily(
            PREFIX + "discovery_healthy",
            "1 while engine discovery follows the platform (Kubernetes: pods listed and watched), else 0.",
            labels=["source"],
        )
        healthy.add_metric([status.source], 1.0 if status.healthy else 0.0)
        yield healthy
        failures = CounterMetricFamily(
            PREFIX + "discovery_failures",
            "Failed discovery attempts by reason (forbidden, unauthorized, gone, unreachable, server_error, "
            "closed_early, protocol, unexpected, http_<status>).",
            labels=["source", "reason"],
        )
        for reason, count in sorted(status.failures_total.items()):
            failures.add_metric([status.source, reason], float(count))
        yield failures
