"""Profile handler of disaggregated serving: decode profile, decider, prefill profile (llm-d's order).

Parameters:
- ``decode``: the profile that picks the decode engine (and serves every request that is not
  disaggregated); empty: the first profile;
- ``critical``: the decode profile of critical requests (priority > 0); empty: ``decode``;
- ``prefill``: the profile that picks the prefill engine (``prefill``);
- ``decider``: the name of the decider plugin (empty: the one the configuration lists, else an
  ``uncached-tokens-decider`` with its defaults).

As a handler it chooses the decode profile by priority, as the criticality handler does (the
scheduler runs it directly, no call of the handler's per request). The prefill profile runs only
when the director asks for a prefill engine and the decider said yes
(:class:`~..disaggregation.Disaggregation`, built from the names here).
"""

from __future__ import annotations

from collections.abc import Mapping

from vllm_stack.config import ConfigError
from vllm_stack.scheduling.framework import Profile
from vllm_stack.scheduling.plugins.criticality_profile_handler import CriticalityProfileHandler
from vllm_stack.scheduling.registry import Parameters, PluginContext

#: The prefill profile's name unless the handler names another (a configuration without this
#: handler disaggregates with a profile of this name).
PREFILL_PROFILE = "prefill"


class PdProfileHandler(CriticalityProfileHandler):
    """The criticality handler's choice of decode profile by priority (``default`` is ``decode`` here,
    and ``critical`` falls back to it), plus the prefill profile and the decider the disaggregation
    reads by name."""

    type_name = "pd-profile-handler"

    def __init__(
        self,
        name: str,
        decode: str = "",
        critical: str = "",
        prefill: str = PREFILL_PROFILE,
        decider: str = "",
    ) -> None:
        super().__init__(name, critical, decode)
        self.prefill_profile = prefill
        self.decider_name = decider

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> PdProfileHandler:
        return cls(
            name,
            parameters.string("decode", ""),
            parameters.string("critical", ""),
            parameters.string("prefill", PREFILL_PROFILE),
            parameters.string("decider", ""),
        )

    def check(self, profiles: Mapping[str, Profile]) -> None:
        """Every profile it names exists, and the decode profile is not the prefill one."""
        self._require(profiles, self.default_name, self.critical_name, self.prefill_profile)
        decode = self._default_of(profiles)
        if decode.name == self.prefill_profile:
            raise ConfigError(f"{self.name}: the decode profile cannot be the prefill profile")
        self._default = (decode,)
        self._critical = (profiles[self.critical_name],) if self.critical_name else self._default
