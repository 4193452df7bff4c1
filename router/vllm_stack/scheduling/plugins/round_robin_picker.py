"""Picker: strict rotation over the candidates."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_stack.discovery.engine import Engine
from vllm_stack.scheduling.framework import RequestContext


class RoundRobinPicker:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]:
        i = self._next
        self._next = (i + 1) % (1 << 30)
        return engines[i % len(engines)], "round_robin"
