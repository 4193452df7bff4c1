"""Profile handler: run the one profile there is (the handler of every built-in strategy)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm_stack.config import ConfigError
from vllm_stack.scheduling.framework import Profile, RequestContext, SchedulingResult
from vllm_stack.scheduling.registry import Parameters, PluginContext


class SingleProfileHandler:
    type_name = "single-profile-handler"
    single = True  # the scheduler may run the only profile directly

    def __init__(self, name: str = "single-profile-handler") -> None:
        self.name = name

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> SingleProfileHandler:
        return cls(name)

    def check(self, profiles: Mapping[str, Profile]) -> None:
        if len(profiles) != 1:
            raise ConfigError(f"{self.type_name} needs exactly one scheduling profile, got {len(profiles)}")

    def pick_profiles(self, ctx: RequestContext, profiles: Mapping[str, Profile]) -> Sequence[Profile]:
        return list(profiles.values())

    def combine(self, ctx: RequestContext, results: Mapping[str, SchedulingResult]) -> SchedulingResult:
        return next(iter(results.values()))
