"""Profile handler: each model its own profile (e.g. session affinity for a chat model, round-robin
for an embedding model behind the same router).

Parameters: ``profiles`` (model name -> profile name) and ``default`` (the profile of every other
model; empty: the first profile). One profile runs per request, so its result is the request's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm_stack.config import ConfigError
from vllm_stack.scheduling.framework import Profile, RequestContext, Role, SchedulingResult
from vllm_stack.scheduling.registry import Parameters, PluginContext


class ModelProfileHandler:
    type_name = "model-profile-handler"
    roles = (Role.PROFILE_HANDLER,)

    def __init__(self, name: str, by_model: Mapping[str, str], default: str = "") -> None:
        self.name = name
        self.by_model = dict(by_model)
        self.default = default
        self._chosen: dict[str, tuple[Profile, ...]] = {}

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> ModelProfileHandler:
        return cls(name, parameters.mapping("profiles"), parameters.string("default", ""))

    def check(self, profiles: Mapping[str, Profile]) -> None:
        """Every profile it names exists (called once the profiles are built)."""
        for profile in [*self.by_model.values(), *([self.default] if self.default else [])]:
            if profile not in profiles:
                raise ConfigError(f"{self.name}: no scheduling profile named {profile!r}")
        default = profiles[self.default] if self.default else next(iter(profiles.values()))
        self._chosen = {"": (default,)}
        self._chosen.update({model: (profiles[p],) for model, p in self.by_model.items()})

    def pick_profiles(self, ctx: RequestContext, profiles: Mapping[str, Profile]) -> Sequence[Profile]:
        chosen = self._chosen
        # an adapter without a profile of its own runs its base model's (``pool``)
        return chosen.get(ctx.model) or chosen.get(ctx.pool) or chosen[""]

    def combine(self, ctx: RequestContext, results: Mapping[str, SchedulingResult]) -> SchedulingResult:
        return next(iter(results.values()))
