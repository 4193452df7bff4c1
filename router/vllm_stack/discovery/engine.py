"""The router's view of one engine: where it is, what it serves, whether it is usable, how loaded."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vllm_stack.discovery.circuit import CircuitBreaker


@dataclass(slots=True)
class EngineTelemetry:
    """Load figures scraped from the engine's ``/metrics`` (summed over ``model_name``)."""

    running: float
    waiting: float
    kv_cache_usage: float | None
    prefix_cache_queries: float | None
    prefix_cache_hits: float | None
    scraped_at: float  # time.monotonic()


class Engine:
    """Mutable state of one engine; owned by the :class:`~vllm_stack.discovery.registry.EngineRegistry`.

    ``in_flight`` is the router's own count of requests it sent there and has not finished; it is
    exact and instant, while the scraped queue length lags by up to one scrape interval.
    """

    __slots__ = (
        "name",
        "url",
        "ready",
        "healthy",
        "ever_healthy",
        "ejected_reason",
        "models",
        "model_cards",
        "static_models",
        "failures",
        "successes",
        "breaker",
        "in_flight",
        "telemetry",
        "stale_after",
        "last_check",
        "last_error",
        "silent_scrapes",
    )

    def __init__(
        self,
        name: str,
        url: str,
        breaker: CircuitBreaker,
        static_models: tuple[str, ...] = (),
        stale_after: float = 3.0,
    ) -> None:
        self.name = name
        self.url = url
        self.ready = True
        self.healthy = False
        self.ever_healthy = False
        self.ejected_reason: str | None = None
        self.static_models = static_models
        self.models: frozenset[str] = frozenset(static_models)
        self.model_cards: tuple[dict[str, Any], ...] = ()
        self.failures = 0
        self.successes = 0
        self.breaker = breaker
        self.in_flight = 0
        self.telemetry: EngineTelemetry | None = None
        self.stale_after = stale_after
        self.last_check = 0.0
        self.last_error: str | None = None
        self.silent_scrapes = 0  # consecutive scrapes that timed out (see EngineRegistry.engine_silent)

    def fresh_telemetry(self, now: float | None = None) -> EngineTelemetry | None:
        """Scraped figures, or None when missing or older than ``stale_after`` (unknown is not zero)."""
        t = self.telemetry
        if t is None:
            return None
        if (time.monotonic() if now is None else now) - t.scraped_at > self.stale_after:
            return None
        return t

    def routable(self) -> bool:
        return self.ready and self.healthy

    def describe(self) -> dict[str, Any]:
        """JSON view for ``GET /engines``."""
        t = self.fresh_telemetry()
        return {
            "name": self.name,
            "url": self.url,
            "ready": self.ready,
            "healthy": self.healthy,
            "ejected_reason": self.ejected_reason,
            "models": sorted(self.models),
            "circuit_breaker": self.breaker.state.name.lower(),
            "in_flight": self.in_flight,
            "load": None
            if t is None
            else {
                "num_requests_running": t.running,
                "num_requests_waiting": t.waiting,
                "kv_cache_usage_perc": t.kv_cache_usage,
                "age_seconds": round(time.monotonic() - t.scraped_at, 3),
            },
            "last_error": self.last_error,
        }
