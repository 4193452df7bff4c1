"""Profile handler: a critical request runs the critical profile, every other request the default one.

Parameters: ``critical`` (the profile of requests with priority > 0; default ``critical``) and
``default`` (every other request's; empty: the first profile). Standard and sheddable requests share
a profile: what differs for them is what the director does when every engine is saturated (a
standard request waits in the model's queue, a sheddable one is answered 429).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm_stack.config import ConfigError
from vllm_stack.scheduling.framework import Profile, RequestContext, Role, SchedulingResult
from vllm_stack.scheduling.registry import Parameters, PluginContext


class CriticalityProfileHandler:
    type_name = "criticality-profile-handler"
    roles = (Role.PROFILE_HANDLER,)

    def __init__(self, name: str, critical: str = "critical", default: str = "") -> None:
        self.name = name
        self.critical_name = critical
        self.default_name = default
        self._critical: tuple[Profile, ...] = ()
        self._default: tuple[Profile, ...] = ()

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> CriticalityProfileHandler:
        return cls(name, parameters.string("critical", "critical"), parameters.string("default", ""))

    def check(self, profiles: Mapping[str, Profile]) -> None:
        """Every profile it names exists (called once the profiles are built)."""
        self._require(profiles, self.critical_name, self.default_name)
        self._critical = (profiles[self.critical_name],)
        self._default = (self._default_of(profiles),)

    def _require(self, profiles: Mapping[str, Profile], *names: str) -> None:
        """A ConfigError for the first of ``names`` (empty ones skipped) that is no profile."""
        for profile in names:
            if profile and profile not in profiles:
                raise ConfigError(f"{self.name}: no scheduling profile named {profile!r}")

    def _default_of(self, profiles: Mapping[str, Profile]) -> Profile:
        """The profile named ``default``, else the first one."""
        return profiles[self.default_name] if self.default_name else next(iter(profiles.values()))

    def by_priority(self) -> tuple[Profile, Profile]:
        """(the critical requests' profile, every other request's): the scheduler chooses between
        them itself, one comparison per request, with no call of the handler's."""
        return self._critical[0], self._default[0]

    def pick_profiles(self, ctx: RequestContext, profiles: Mapping[str, Profile]) -> Sequence[Profile]:
        return self._critical if ctx.priority > 0 else self._default

    def combine(self, ctx: RequestContext, results: Mapping[str, SchedulingResult]) -> SchedulingResult:
        return next(iter(results.values()))
