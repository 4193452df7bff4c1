"""Picker: strict rotation over the candidates.

The rotation position lives in the router's plugin state, so a configuration reload continues the
rotation instead of sending the next request to the first engine again.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_stack.engines.engine import Engine
from vllm_stack.scheduling.framework import RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext


class Turn:
    """A rotation position (a mutable box, kept across reloads)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


class RoundRobinPicker:
    type_name = "round-robin-picker"
    roles = (Role.PICKER,)

    def __init__(self, name: str = "round_robin", turn: Turn | None = None) -> None:
        self.name = name
        self._turn = turn if turn is not None else Turn()

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> RoundRobinPicker:
        return cls(name, context.state.get((cls.type_name, name), Turn))

    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]:
        turn = self._turn
        i = turn.value
        turn.value = (i + 1) % (1 << 30)
        return engines[i % len(engines)], "round_robin"
