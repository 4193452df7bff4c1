"""Admission: refuse a request when the model's engines already hold ``per_engine`` requests each.

The example of the admission extension point. It counts the router's own in-flight requests (exact,
never stale) over the model's routable engines; at the limit the request is refused with reason
``overloaded`` (the director answers 429 with ``Retry-After``) before any work is done for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_stack.engines.engine import Engine
from vllm_stack.engines.load import in_flight
from vllm_stack.scheduling.framework import Reason, Refusal, RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext


class MaxInFlightAdmission:
    type_name = "max-in-flight-admission"
    roles = (Role.ADMISSION,)

    def __init__(self, name: str = "max-in-flight", per_engine: float = 256) -> None:
        self.name = name
        self.per_engine = per_engine

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> MaxInFlightAdmission:
        return cls(name, parameters.number("per_engine", 256, minimum=1))

    def admit(self, ctx: RequestContext, candidates: Sequence[Engine]) -> Refusal | None:
        if candidates and sum(in_flight(candidates)) >= self.per_engine * len(candidates):
            return Refusal(
                Reason.OVERLOADED,
                f"Model '{ctx.model}' has {self.per_engine:g} requests in flight per engine; try again shortly.",
            )
        return None
