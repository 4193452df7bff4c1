"""The filters of the critical chain (the Gateway API Inference Extension's, after the user's description):
keep engines with a queue below a limit, then those with the least queue, then the least KV cache use.

- ``low-queue-filter``: engines whose estimated queue (:func:`vllm_stack.engines.load.queue_estimate`)
  is below ``max_waiting`` (router setting ``critical_max_waiting``, 50); an unknown queue is kept. When
  none is left the reason is ``all_saturated`` (the request waits in the model's queue).
- ``least-queue-filter``: the engines with the least estimated queue; under the stale rule, when any
  engine's is unknown, the least router in-flight count instead.
- ``least-kv-cache-filter``: the engines with the least KV cache usage; when any engine's is unknown,
  all of them (the term is dropped, never zeroed for one).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from vllm_stack.engines.engine import Engine
from vllm_stack.engines.load import fresh_telemetry, queue_estimate, queue_estimates
from vllm_stack.scheduling.framework import Reason, RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext


def _least(engines: Sequence[Engine], values: Sequence[float]) -> Sequence[Engine]:
    low = min(values)
    kept = [e for e, v in zip(engines, values, strict=True) if v <= low]
    return engines if len(kept) == len(engines) else kept


class LowQueueFilter:
    type_name = "low-queue-filter"
    roles = (Role.FILTER,)
    empty_reason = Reason.ALL_SATURATED

    #: The description's value for critical requests; the router's ``critical_max_waiting`` by default.
    DEFAULT_MAX_WAITING = 50.0

    def __init__(self, name: str = "low-queue", max_waiting: float = DEFAULT_MAX_WAITING) -> None:
        self.name = name
        self.max_waiting = max_waiting

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> LowQueueFilter:
        return cls(name, parameters.number("max_waiting", cls.DEFAULT_MAX_WAITING, minimum=0))

    def filter(self, ctx: RequestContext, engines: Sequence[Engine]) -> Sequence[Engine]:
        now = time.monotonic()
        limit = self.max_waiting
        kept = [e for e in engines if (q := queue_estimate(e, now)) is None or q < limit]
        return engines if len(kept) == len(engines) else kept


class LeastQueueFilter:
    type_name = "least-queue-filter"
    roles = (Role.FILTER,)

    def __init__(self, name: str = "least-queue") -> None:
        self.name = name

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> LeastQueueFilter:
        return cls(name)

    def filter(self, ctx: RequestContext, engines: Sequence[Engine]) -> Sequence[Engine]:
        if len(engines) < 2:
            return engines
        return _least(engines, queue_estimates(engines))


class LeastKvCacheFilter:
    type_name = "least-kv-cache-filter"
    roles = (Role.FILTER,)

    def __init__(self, name: str = "least-kv-cache") -> None:
        self.name = name

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> LeastKvCacheFilter:
        return cls(name)

    def filter(self, ctx: RequestContext, engines: Sequence[Engine]) -> Sequence[Engine]:
        if len(engines) < 2:
            return engines
        now = time.monotonic()
        usage: list[float] = []
        for e in engines:
            t = fresh_telemetry(e, now)
            if t is None or t.kv_cache_usage is None:
                return engines
            usage.append(t.kv_cache_usage)
        return _least(engines, usage)
