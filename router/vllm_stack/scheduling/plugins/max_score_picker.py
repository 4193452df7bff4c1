"""Picker: the highest score; ties rotate so equal engines share the traffic."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_stack.engines.engine import Engine
from vllm_stack.scheduling.framework import RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext


class MaxScorePicker:
    type_name = "max-score-picker"
    roles = (Role.PICKER,)

    def __init__(self, name: str = "max_score", reason: str = "max_score") -> None:
        self.name = name
        self.reason = reason
        self._turn = 0

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> MaxScorePicker:
        return cls(name, parameters.string("reason", "max_score"))

    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]:
        n = len(engines)
        self._turn = (self._turn + 1) % (1 << 30)
        if scores is None or n == 1:
            return engines[self._turn % n], self.reason
        best = max(scores)
        tied = [i for i, s in enumerate(scores) if s >= best - 1e-12]
        return engines[tied[self._turn % len(tied)]], self.reason
