"""Profile handler: production-stack's ``priority`` routing logic, one profile at or below a priority
threshold and another above it.

production-stack's rule (its proposal ``proposals/priority-routing.md``, merged after its commit
a6c01db): a request's priority in vLLM's sense (lower is served first) from the ``x-request-priority``
header, else the body's ``priority``, else a default; at or below ``threshold`` the request goes to the
least-loaded engine (it matters most, so it gets the shortest queue), above it round-robin (spread,
no load signal needed). Here the priority is the router's own (:mod:`vllm_stack.api.priority`:
header, body, then the model's or adapter's configured criticality), whose sense is the Inference
Extension's (higher is more important), so the vLLM-sense value compared is its negation; a request
of the standard class (priority 0: it named none, or 0) counts as ``default``.

Parameters: ``threshold`` (0), ``default`` (0), ``at_or_below`` (the profile at or below; the first)
and ``above`` (the profile above; the second).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm_stack.config import ConfigError
from vllm_stack.scheduling.framework import Profile, RequestContext, Role, SchedulingResult
from vllm_stack.scheduling.registry import Parameters, PluginContext


class PriorityThresholdProfileHandler:
    type_name = "priority-threshold-profile-handler"
    roles = (Role.PROFILE_HANDLER,)

    def __init__(
        self, name: str, threshold: int = 0, default: int = 0, at_or_below: str = "", above: str = ""
    ) -> None:
        self.name = name
        self.threshold = threshold
        self.default = default
        self.at_or_below_name = at_or_below
        self.above_name = above
        self._at_or_below: tuple[Profile, ...] = ()
        self._above: tuple[Profile, ...] = ()

    @classmethod
    def create(
        cls, name: str, parameters: Parameters, context: PluginContext
    ) -> PriorityThresholdProfileHandler:
        return cls(
            name,
            int(parameters.number("threshold", 0)),
            int(parameters.number("default", 0)),
            parameters.string("at_or_below", ""),
            parameters.string("above", ""),
        )

    def check(self, profiles: Mapping[str, Profile]) -> None:
        """Both profiles exist (the first and the second when not named)."""
        listed = list(profiles.values())
        for given in (self.at_or_below_name, self.above_name):
            if given and given not in profiles:
                raise ConfigError(f"{self.name}: no scheduling profile named {given!r}")
        if not (self.at_or_below_name and self.above_name) and len(listed) < 2:
            raise ConfigError(
                f"{self.name}: needs two scheduling profiles (at or below, above the threshold)"
            )
        below = profiles[self.at_or_below_name] if self.at_or_below_name else listed[0]
        above = profiles[self.above_name] if self.above_name else listed[1]
        self._at_or_below, self._above = (below,), (above,)

    def vllm_priority(self, ctx: RequestContext) -> int:
        """The request's priority in vLLM's sense (lower first), ``default`` for the standard class."""
        return -ctx.priority if ctx.priority else self.default

    def pick_profiles(self, ctx: RequestContext, profiles: Mapping[str, Profile]) -> Sequence[Profile]:
        return self._at_or_below if self.vllm_priority(ctx) <= self.threshold else self._above

    def combine(self, ctx: RequestContext, results: Mapping[str, SchedulingResult]) -> SchedulingResult:
        return next(iter(results.values()))
