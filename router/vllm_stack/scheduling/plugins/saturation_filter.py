"""Filter: drop engines whose own queue is at or above a limit; when none is left, say "saturated".

An engine whose queue is unknown (metrics stale or never scraped) is kept: unknown is not full. When
every candidate is saturated the scheduling result's reason is ``all_saturated``, which the director
answers with a 429 and ``Retry-After`` (shed load rather than queue more where no engine has room).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from vllm_stack.engines.engine import Engine
from vllm_stack.engines.load import queue_length
from vllm_stack.scheduling.framework import Reason, RequestContext
from vllm_stack.scheduling.registry import Parameters, PluginContext


class SaturationFilter:
    type_name = "saturation-filter"
    empty_reason = Reason.ALL_SATURATED

    def __init__(self, name: str = "saturation", max_waiting: float = 64) -> None:
        self.name = name
        self.max_waiting = max_waiting

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> SaturationFilter:
        return cls(name, parameters.number("max_waiting", 64, minimum=0))

    def filter(self, ctx: RequestContext, engines: Sequence[Engine]) -> Sequence[Engine]:
        now = time.monotonic()
        limit = self.max_waiting
        kept = [e for e in engines if (q := queue_length(e, now)) is None or q < limit]
        return engines if len(kept) == len(engines) else kept
