"""Profile handler: run the one profile there is (the handler of every built-in strategy).

Parameter ``profile``: the profile every request runs when the configuration has others that the
director runs itself (the ``prefill`` profile of disaggregated serving); without it the
configuration must have exactly one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm_stack.config import ConfigError
from vllm_stack.scheduling.framework import Profile, RequestContext, Role, SchedulingResult
from vllm_stack.scheduling.registry import Parameters, PluginContext


class SingleProfileHandler:
    type_name = "single-profile-handler"
    roles = (Role.PROFILE_HANDLER,)
    single = True  # the scheduler may run the only profile directly

    def __init__(self, name: str = "single-profile-handler", profile: str = "") -> None:
        self.name = name
        self.profile_name = profile
        self._chosen: tuple[Profile, ...] = ()

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> SingleProfileHandler:
        return cls(name, parameters.string("profile", ""))

    def check(self, profiles: Mapping[str, Profile]) -> None:
        if self.profile_name:
            if self.profile_name not in profiles:
                raise ConfigError(f"{self.name}: no scheduling profile named {self.profile_name!r}")
            self._chosen = (profiles[self.profile_name],)
        elif len(profiles) != 1:
            raise ConfigError(f"{self.type_name} needs exactly one scheduling profile, got {len(profiles)}")
        else:
            self._chosen = tuple(profiles.values())

    def by_priority(self) -> tuple[Profile, Profile]:
        """Every request runs the one profile: the scheduler calls its ``run`` directly."""
        return self._chosen[0], self._chosen[0]

    def pick_profiles(self, ctx: RequestContext, profiles: Mapping[str, Profile]) -> Sequence[Profile]:
        return self._chosen or list(profiles.values())

    def combine(self, ctx: RequestContext, results: Mapping[str, SchedulingResult]) -> SchedulingResult:
        return next(iter(results.values()))
