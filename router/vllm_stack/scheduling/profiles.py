"""Strategy name -> profile. The names are production-stack's ``--routing-logic`` values plus ours."""

from __future__ import annotations

from vllm_stack.config import RouterConfig
from vllm_stack.scheduling.framework import Profile
from vllm_stack.scheduling.plugins.circuit_breaker_filter import CircuitBreakerFilter
from vllm_stack.scheduling.plugins.consistent_hash_picker import ConsistentHashPicker, prefix_key, session_key
from vllm_stack.scheduling.plugins.least_loaded_scorer import LeastLoadedScorer
from vllm_stack.scheduling.plugins.max_score_picker import MaxScorePicker
from vllm_stack.scheduling.plugins.power_of_two_picker import PowerOfTwoPicker
from vllm_stack.scheduling.plugins.random_picker import RandomPicker
from vllm_stack.scheduling.plugins.round_robin_picker import RoundRobinPicker


def build_profile(config: RouterConfig) -> Profile:
    """The profile for ``config.routing_logic``.

    ``prefixaware`` is, for now, bounded-load consistent hashing on the first ``prefix_chars`` bytes
    of the prompt/messages: requests sharing a prefix land on the same engine (and its prefix cache).
    The KV-event-aware scorer of the cache-aware routing issue replaces it.
    """
    filters = [CircuitBreakerFilter()]
    logic = config.routing_logic
    if logic == "roundrobin":
        return Profile(logic, filters, [], RoundRobinPicker())
    if logic == "random":
        return Profile(logic, filters, [], RandomPicker())
    if logic == "leastloaded":
        return Profile(logic, filters, [(LeastLoadedScorer(), 1.0)], MaxScorePicker(reason="least_loaded"))
    if logic == "p2c":
        return Profile(logic, filters, [], PowerOfTwoPicker())
    if logic == "session":
        return Profile(
            logic, filters, [], ConsistentHashPicker("session", session_key, config.session_balance_epsilon)
        )
    if logic == "prefixaware":
        return Profile(
            logic, filters, [], ConsistentHashPicker("prefix", prefix_key, config.session_balance_epsilon)
        )
    raise ValueError(f"unknown routing logic {logic!r}")
