"""Picker: uniformly random."""

from __future__ import annotations

import random
from collections.abc import Sequence

from vllm_stack.discovery.engine import Engine
from vllm_stack.scheduling.framework import RequestContext


class RandomPicker:
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]:
        return engines[self._rng.randrange(len(engines))], "random"
