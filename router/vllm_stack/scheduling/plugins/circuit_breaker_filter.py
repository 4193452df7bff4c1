"""Filter: drop engines whose circuit breaker refuses traffic (open, or half-open with a probe out)."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_stack.discovery.circuit import BreakerState
from vllm_stack.discovery.engine import Engine
from vllm_stack.scheduling.framework import RequestContext


class CircuitBreakerFilter:
    name = "circuit_breaker"

    def filter(self, ctx: RequestContext, engines: Sequence[Engine]) -> Sequence[Engine]:
        for e in engines:  # fast path: all closed, no copy
            if e.breaker.state is not BreakerState.CLOSED:
                return [e for e in engines if e.breaker.available()]
        return engines
