"""Filter: drop engines whose circuit breaker refuses traffic (open, or half-open with a probe out)."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_stack.engines.circuit import BreakerState
from vllm_stack.engines.engine import Engine
from vllm_stack.scheduling.framework import RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext


class CircuitBreakerFilter:
    type_name = "circuit-breaker-filter"
    roles = (Role.FILTER,)

    def __init__(self, name: str = "circuit_breaker") -> None:
        self.name = name

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> CircuitBreakerFilter:
        return cls(name)

    def filter(self, ctx: RequestContext, engines: Sequence[Engine]) -> Sequence[Engine]:
        for e in engines:  # fast path: all closed, no copy
            if e.breaker.state is not BreakerState.CLOSED:
                return [e for e in engines if e.breaker.available()]
        return engines
