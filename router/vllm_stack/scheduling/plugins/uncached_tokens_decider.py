"""Decider of disaggregated serving: a prefill leg only for a long enough uncached part of the prompt.

A short uncached part is prefilled by the decode engine faster than a hand-over takes, so below
``min_uncached_tokens`` (the router's ``disagg_min_uncached_tokens``, 256) the request is served
decode-only. The input is the prefill profile's picker's estimate (:mod:`..disaggregation`).
"""

from __future__ import annotations

from vllm_stack.scheduling.framework import RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext

DEFAULT_MIN_UNCACHED_TOKENS = 256


class UncachedTokensDecider:
    type_name = "uncached-tokens-decider"
    roles = (Role.DECIDER,)

    def __init__(
        self, name: str = "uncached-tokens-decider", min_uncached_tokens: int = DEFAULT_MIN_UNCACHED_TOKENS
    ) -> None:
        self.name = name
        self.min_uncached_tokens = min_uncached_tokens

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> UncachedTokensDecider:
        minimum = parameters.number("min_uncached_tokens", DEFAULT_MIN_UNCACHED_TOKENS, minimum=0)
        return cls(name, int(minimum))

    def decide(self, ctx: RequestContext, uncached_tokens: int) -> bool:
        """Worth a prefill leg: the uncached part reaches the threshold (reaching it is enough)."""
        return uncached_tokens >= self.min_uncached_tokens
