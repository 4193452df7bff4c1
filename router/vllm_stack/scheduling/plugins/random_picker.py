"""Picker: uniformly random."""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_stack.engines.engine import Engine
from vllm_stack.scheduling.framework import RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext


class RandomPicker:
    type_name = "random-picker"
    roles = (Role.PICKER,)

    def __init__(self, rng: random.Random | None = None, name: str = "random") -> None:
        self.name = name
        self._rng = rng or random.Random()

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> RandomPicker:
        return cls(name=name)

    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]:
        return engines[self._rng.randrange(len(engines))], "random"
