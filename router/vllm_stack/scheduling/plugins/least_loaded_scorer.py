"""Scorer: prefer the engine with the least load (router in-flight plus engine queue)."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_stack.discovery.engine import Engine
from vllm_stack.scheduling.framework import RequestContext
from vllm_stack.scheduling.load import engine_loads


class LeastLoadedScorer:
    name = "least_loaded"

    def score(self, ctx: RequestContext, engines: Sequence[Engine]) -> list[float]:
        return [1.0 / (1.0 + load) for load in engine_loads(engines)]
