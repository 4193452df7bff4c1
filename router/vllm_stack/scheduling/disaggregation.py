"""Disaggregated serving as scheduling: the decode profile, then the decider, then the prefill profile.

The order is llm-d's (its pd profile handler). A disaggregated request's decode engine is the
scheduler's ordinary decision (the strategy's profile for the request's priority); the decider says
whether a prefill leg is worth it; only then does the ``prefill`` profile pick, and claim, a prefill
engine (:meth:`Disaggregation.prefill_step`). Where the prefill request names its decode engine
(LMCache's protocol) the decode decision is made before the decider; in vLLM's protocol any decode
engine can pull the KV the prefill engine holds, so that decision waits for the hand-over and is
made with the load of that moment. A request served decode-only therefore leaves nothing on
the prefill pool: no routing decision of the prefill profile, no prefix-index entry, no share of its
recent decisions, no booking.

The decider's input is the estimate of the prefill profile's picker, over the engines the profile's
filters keep, of the prompt tokens the engine it would pick lacks (the picker's
``uncached_tokens(ctx, engines)``: the prefix-cache picker's, computed without placing the request);
the picker then picks among those same engines, so the engine it picks is the one estimated. A picker
without an estimate gives 0.

Declared in the scheduling YAML like any strategy: a ``pd-profile-handler`` naming the decode profile
(and the critical requests' one), the prefill profile and the decider plugin
(:mod:`.plugins.pd_profile_handler`). A configuration written before that handler existed, with a
profile named ``prefill`` and another handler, still disaggregates: the ``prefill`` profile behind the
configuration's decider (:func:`disaggregation_of`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_stack.config import ConfigError
from vllm_stack.engines.engine import Engine
from vllm_stack.scheduling.framework import Decider, Profile, RequestContext, Role, SchedulingResult
from vllm_stack.scheduling.plugins.pd_profile_handler import PREFILL_PROFILE
from vllm_stack.scheduling.plugins.uncached_tokens_decider import UncachedTokensDecider


@dataclass(frozen=True, slots=True)
class PrefillPick:
    """What :meth:`Disaggregation.prefill_step` found: the prefill profile's decision, or None and
    the ``disagg_requests_total`` outcome that serves the request decode-only."""

    result: SchedulingResult | None
    outcome: str = ""  # "" when a prefill engine was picked; else "no_prefill_engine" or "short"
    uncached_tokens: int = 0  # the decider's input


class Disaggregation:
    """The decider and the prefill profile of one scheduling configuration."""

    __slots__ = ("prefill", "decider", "_estimate")

    def __init__(self, prefill: Profile, decider: Decider) -> None:
        self.prefill = prefill
        self.decider = decider
        self._estimate = getattr(prefill.picker, "uncached_tokens", None)

    def prefill_step(self, ctx: RequestContext, candidates: Sequence[Engine]) -> PrefillPick:
        """The decider over the prefill profile's filtered ``candidates`` (the model's prefill
        engines), then, only when it says so, the prefill profile's pick, which claims the engine
        (sets ``ctx.prefill_tokens`` to what that engine is expected to prefill)."""
        profile = self.prefill
        started = time.perf_counter()
        engines = profile.filtered(ctx, candidates)
        if isinstance(engines, str):  # none left: the profile decided none (recorded as any decision)
            return PrefillPick(profile.no_engine(engines, started), "no_prefill_engine")
        uncached = self._estimate(ctx, engines) if self._estimate is not None else 0
        if not self.decider.decide(ctx, uncached):
            return PrefillPick(None, "short", uncached)
        return PrefillPick(profile.pick(ctx, engines, started), "", uncached)


def disaggregation_of(
    handler: Any,  # noqa: ANN401 - the configuration's profile handler, whatever its type
    profiles: Mapping[str, Profile],
    plugins: Mapping[str, Any],
) -> Disaggregation | None:
    """The configuration's disaggregation, or None (every request served whole): the prefill
    profile and decider its ``pd-profile-handler`` names; without one, a profile named ``prefill``
    (a configuration from before that handler) behind the one decider listed, else the default
    ``uncached-tokens-decider``."""
    prefill = getattr(handler, "prefill_profile", None)
    if prefill is None:  # not a pd-profile-handler
        if PREFILL_PROFILE not in profiles:
            return None
        prefill = PREFILL_PROFILE
    deciders = [p for p in plugins.values() if Role.DECIDER in p.roles]
    named = getattr(handler, "decider_name", "")
    if named:
        decider = plugins.get(named)
        if decider is None or Role.DECIDER not in decider.roles:
            raise ConfigError(f"{handler.name}: no decider plugin named {named!r}")
    elif len(deciders) > 1:
        raise ConfigError("scheduling: more than one decider; name one in the pd-profile-handler")
    else:
        decider = deciders[0] if deciders else UncachedTokensDecider()
    return Disaggregation(profiles[prefill], decider)
