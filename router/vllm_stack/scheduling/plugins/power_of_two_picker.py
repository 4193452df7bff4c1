"""Picker: power of two choices: sample two engines at random, take the less loaded.

Nearly as good as least-loaded at balancing, without every router replica herding onto the same
"least loaded" engine between two scrapes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_stack.engines.engine import Engine
from vllm_stack.engines.load import engine_loads
from vllm_stack.scheduling.framework import RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext


class PowerOfTwoPicker:
    type_name = "power-of-two-picker"
    roles = (Role.PICKER,)

    def __init__(self, rng: random.Random | None = None, name: str = "p2c") -> None:
        self.name = name
        self._rng = rng or random.Random()

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> PowerOfTwoPicker:
        return cls(name=name)

    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]:
        if len(engines) == 1:
            return engines[0], "p2c_single"
        a, b = self._rng.sample(range(len(engines)), 2)
        la, lb = engine_loads([engines[a], engines[b]])
        if la == lb:
            return engines[a], "p2c_tie"
        return (engines[a] if la < lb else engines[b]), "p2c"
