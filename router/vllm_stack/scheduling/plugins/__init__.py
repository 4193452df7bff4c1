"""Scheduling plugins, one per file: filters, scorers, pickers, profile handlers and stage hooks.

:func:`builtin_registry` is the registration of every built-in type; a new plugin adds its file and
one line here (or, outside the package, registers itself on the registry it is given).
"""

from __future__ import annotations

from vllm_stack.scheduling.plugins.circuit_breaker_filter import CircuitBreakerFilter
from vllm_stack.scheduling.plugins.consistent_hash_picker import ConsistentHashPicker
from vllm_stack.scheduling.plugins.criticality_profile_handler import CriticalityProfileHandler
from vllm_stack.scheduling.plugins.least_loaded_scorer import LeastLoadedScorer
from vllm_stack.scheduling.plugins.lmcache_lookup_picker import LmcacheLookupPicker
from vllm_stack.scheduling.plugins.lora_affinity import LoraAffinity
from vllm_stack.scheduling.plugins.max_in_flight_admission import MaxInFlightAdmission
from vllm_stack.scheduling.plugins.max_score_picker import MaxScorePicker
from vllm_stack.scheduling.plugins.model_profile_handler import ModelProfileHandler
from vllm_stack.scheduling.plugins.pd_profile_handler import PdProfileHandler
from vllm_stack.scheduling.plugins.power_of_two_picker import PowerOfTwoPicker
from vllm_stack.scheduling.plugins.prefix_cache_picker import PrefixCachePicker
from vllm_stack.scheduling.plugins.priority_threshold_profile_handler import PriorityThresholdProfileHandler
from vllm_stack.scheduling.plugins.prompt_length import PromptLength
from vllm_stack.scheduling.plugins.queue_filters import LeastKvCacheFilter, LeastQueueFilter, LowQueueFilter
from vllm_stack.scheduling.plugins.random_picker import RandomPicker
from vllm_stack.scheduling.plugins.request_tracker import RequestTracker
from vllm_stack.scheduling.plugins.round_robin_picker import RoundRobinPicker
from vllm_stack.scheduling.plugins.saturation_filter import SaturationFilter
from vllm_stack.scheduling.plugins.single_profile_handler import SingleProfileHandler
from vllm_stack.scheduling.plugins.uncached_tokens_decider import UncachedTokensDecider
from vllm_stack.scheduling.plugins.upstream_headers import UpstreamHeaders
from vllm_stack.scheduling.registry import PluginRegistry

BUILTIN_TYPES = (
    CircuitBreakerFilter,
    SaturationFilter,
    LeastLoadedScorer,
    MaxScorePicker,
    RoundRobinPicker,
    RandomPicker,
    PowerOfTwoPicker,
    ConsistentHashPicker,
    PrefixCachePicker,
    LmcacheLookupPicker,
    SingleProfileHandler,
    ModelProfileHandler,
    PromptLength,
    MaxInFlightAdmission,
    UpstreamHeaders,
    RequestTracker,
    LoraAffinity,
    LowQueueFilter,
    LeastQueueFilter,
    LeastKvCacheFilter,
    CriticalityProfileHandler,
    PriorityThresholdProfileHandler,
    PdProfileHandler,
    UncachedTokensDecider,
)


def builtin_registry() -> PluginRegistry:
    """A new registry holding every built-in plugin type."""
    registry = PluginRegistry()
    for plugin in BUILTIN_TYPES:
        registry.register(plugin)
    return registry
