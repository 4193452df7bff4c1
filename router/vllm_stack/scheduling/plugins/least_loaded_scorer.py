"""Scorer: prefer the engine with the least load (router in-flight plus engine queue)."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_stack.engines.engine import Engine
from vllm_stack.engines.load import engine_loads
from vllm_stack.scheduling.framework import RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext


class LeastLoadedScorer:
    type_name = "least-loaded-scorer"
    roles = (Role.SCORER,)

    def __init__(self, name: str = "least_loaded") -> None:
        self.name = name

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> LeastLoadedScorer:
        return cls(name)

    def score(self, ctx: RequestContext, engines: Sequence[Engine]) -> list[float]:
        return [1.0 / (1.0 + load) for load in engine_loads(engines)]
