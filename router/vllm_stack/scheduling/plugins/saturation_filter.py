"""Filter: drop saturated engines (the saturation rule of :mod:`vllm_stack.engines.load`); when none is
left, say "saturated".

By default the rule's limits are the router's (``saturation_max_waiting``: 5 waiting,
``saturation_max_kv_cache_usage``: 0.8, ``critical_reserve_slots``: 0, ``tenant_headroom_slots``: 1); the
parameters ``max_waiting``, ``max_kv_cache_usage``, ``reserve_slots`` and ``headroom_slots`` override them
for this filter. An engine whose figures are unknown (stale or never scraped) is kept:
unknown is not full. When every candidate is saturated the scheduling result's reason is
``all_saturated``: the director holds a standard or critical request in the model's queue until an
engine has room, and answers a sheddable one 429 with ``Retry-After`` (shed rather than wait).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vllm_stack.engines.engine import Engine
from vllm_stack.engines.load import SaturationLimits, saturation_rule
from vllm_stack.scheduling.framework import Reason, RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext


class SaturationFilter:
    type_name = "saturation-filter"
    roles = (Role.FILTER,)
    empty_reason = Reason.ALL_SATURATED

    def __init__(self, name: str = "saturation", limits: SaturationLimits | None = None) -> None:
        self.name = name
        self.limits = limits or SaturationLimits()
        # filter(ctx, engines) is the rule itself (no call of this class's on the hot path)
        self.filter: Callable[[RequestContext, Sequence[Engine]], Sequence[Engine]] = saturation_rule(
            self.limits
        )

    def filter(self, ctx: RequestContext, engines: Sequence[Engine]) -> Sequence[Engine]:
        """The protocol's method; instances shadow it with the rule itself (see ``__init__``)."""
        return saturation_rule(self.limits)(ctx, engines)

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> SaturationFilter:
        default = context.saturation
        limits = SaturationLimits(
            parameters.number("max_waiting", default.max_waiting, minimum=0),
            parameters.number("max_kv_cache_usage", default.max_kv_cache_usage, minimum=0),
            int(parameters.number("reserve_slots", default.reserve_slots, minimum=0)),
            int(parameters.number("headroom_slots", default.headroom_slots, minimum=0)),
        )
        return cls(name, limits)
