"""The ``--routing-logic`` strategies: production-stack's names plus ours, each a built-in scheduling
configuration of the same shape a user writes in the router's YAML (:mod:`.config`).

Adding a strategy name is one entry in :func:`builtin_config` and its name in the routing_logic
setting's values (:data:`vllm_stack.settings.scheduling.ROUTING_LOGICS`); adding a behaviour is a plugin.
``prefixaware`` is the prefix-cache picker: block-aligned chained keys of the whole prompt, an index
of which engine was sent which blocks, and a load bound; where engines publish KV events and the
router has the model's tokenizer, the events keep that index exact (:mod:`.index.feed`).
``kvaware`` (production-stack's name) asks LMCache's controller where the prompt's KV is and falls back
to the prefix-cache picker (:mod:`.plugins.lmcache_lookup_picker`).
"""

from __future__ import annotations

from typing import Any

from vllm_stack.config import ConfigError, RouterConfig
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.config import build_scheduling
from vllm_stack.scheduling.framework import Scheduler
from vllm_stack.scheduling.plugins import builtin_registry
from vllm_stack.scheduling.plugins.pd_profile_handler import PREFILL_PROFILE
from vllm_stack.scheduling.registry import PluginState
from vllm_stack.settings.scheduling import ROUTING_LOGICS

_PREFIX_PICKER = "prefix-cache-picker"
_PD_HANDLER = "pd-profile-handler"
_DECIDER = "uncached-tokens-decider"


def _single(name: str, *plugins: dict[str, Any], scorers: dict[str, float] | None = None) -> dict[str, Any]:
    """One profile named ``name``: the circuit-breaker filter, then ``plugins``."""
    listed = [{"type": "circuit-breaker-filter"}, *plugins]
    refs: list[dict[str, Any]] = [{"pluginRef": "circuit-breaker-filter"}]
    for p in plugins:
        ref: dict[str, Any] = {"pluginRef": p.get("name", p["type"])}
        if scorers and ref["pluginRef"] in scorers:
            ref["weight"] = scorers[ref["pluginRef"]]
        refs.append(ref)
    return {"plugins": listed, "schedulingProfiles": [{"name": name, "plugins": refs}]}


def _prefix_picker(config: RouterConfig) -> dict[str, Any]:
    parameters: dict[str, Any] = {"epsilon": config.session_balance_epsilon, "kv_events": config.kv_events}
    if config.tokenizers:
        parameters["tokenizers"] = dict(config.tokenizers)
    if config.prefix_min_match_length:
        parameters["min_match_chars"] = config.prefix_min_match_length
    return {"type": _PREFIX_PICKER, "parameters": parameters}


def builtin_config(config: RouterConfig) -> dict[str, Any]:
    """The scheduling configuration of ``config.routing_logic``."""
    logic = config.routing_logic
    epsilon = config.session_balance_epsilon
    if logic == "roundrobin":
        return _single(logic, {"type": "round-robin-picker"})
    if logic == "random":
        return _single(logic, {"type": "random-picker"})
    if logic in ("leastloaded", "disaggregated_prefill"):
        # production-stack's disaggregated_prefill: whole and decode requests go by load, prefill
        # legs by prefix (with_disaggregation adds that profile)
        return _single(
            logic,
            {"type": "least-loaded-scorer"},
            {"type": "max-score-picker", "parameters": {"reason": "least_loaded"}},
            scorers={"least-loaded-scorer": 1.0},
        )
    if logic == "p2c":
        return _single(logic, {"type": "power-of-two-picker"})
    if logic == "session":
        return _single(
            logic, {"type": "consistent-hash-picker", "parameters": {"key": "session", "epsilon": epsilon}}
        )
    if logic == "prefixaware":
        return _single(logic, _prefix_picker(config))
    if logic == "kvaware":
        picker = _prefix_picker(config)
        picker["type"] = "lmcache-lookup-picker"
        picker["parameters"] |= {
            "controller_url": config.lmcache_controller_url,
            "threshold": config.kv_aware_threshold,
            "timeout": config.lmcache_lookup_timeout,
        }
        return _single(logic, picker)
    if logic == "priority":
        return _priority_threshold(config)
    raise ConfigError(f"routing_logic must be one of {ROUTING_LOGICS} (got {logic!r})")


def _priority_threshold(config: RouterConfig) -> dict[str, Any]:
    """production-stack's ``priority``: urgent requests (vLLM priority at or below the threshold) to the
    least-loaded engine, the rest round-robin; a profile each, chosen by the threshold handler."""
    urgent = _single(
        "priority-least-loaded",
        {"type": "least-loaded-scorer"},
        {"type": "max-score-picker", "parameters": {"reason": "least_loaded"}},
        scorers={"least-loaded-scorer": 1.0},
    )
    rest = _single("priority-round-robin", {"type": "round-robin-picker"})
    handler = {
        "type": "priority-threshold-profile-handler",
        "parameters": {
            "threshold": config.priority_threshold,
            "default": config.priority_default,
            "at_or_below": "priority-least-loaded",
            "above": "priority-round-robin",
        },
    }
    return {
        "plugins": [*urgent["plugins"], {"type": "round-robin-picker"}, handler],
        "schedulingProfiles": [*urgent["schedulingProfiles"], *rest["schedulingProfiles"]],
    }


LORA_AFFINITY = "lora-affinity-filter"


def with_lora_affinity(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with the LoRA-affinity filter in every profile that does not reference it yet: registered
    adapters are routed to where they are loaded whatever the strategy. Where it is added it is the
    last filter, so it chooses among engines the others kept (an open circuit breaker does not leave
    it none); a profile that places it itself keeps that place."""
    plugins = raw.get("plugins")
    profiles = raw.get("schedulingProfiles", raw.get("scheduling_profiles"))
    if not isinstance(plugins, list) or not isinstance(profiles, list):
        return raw  # malformed: build_scheduling reports it
    listed = next((p for p in plugins if isinstance(p, dict) and p.get("type") == LORA_AFFINITY), None)
    name = LORA_AFFINITY if listed is None else listed.get("name", LORA_AFFINITY)
    key = "schedulingProfiles" if "schedulingProfiles" in raw else "scheduling_profiles"

    def placed(profile: Any) -> Any:  # noqa: ANN401 - a profile as written (checked later)
        if not isinstance(profile, dict):
            return profile
        refs = profile.get("plugins") or []
        if any(isinstance(r, dict) and r.get("pluginRef") == name for r in refs):
            return profile
        return {**profile, "plugins": [*refs, {"pluginRef": name}]}

    return {
        **raw,
        "plugins": plugins if listed is not None else [{"type": LORA_AFFINITY}, *plugins],
        key: [placed(p) for p in profiles],
    }


CRITICAL_PROFILE = "critical"


def with_priority(raw: dict[str, Any], config: RouterConfig) -> dict[str, Any]:
    """A built-in configuration made priority-aware (the user's description's filter chains):

    - standard and sheddable requests run the strategy's own profile behind the saturation filter
      (queue >= 5 or KV >= 0.8 is saturated); when every engine is, the director holds a standard
      request in the model's queue and answers a sheddable one 429;
    - critical requests run the ``critical`` profile: engines with a queue below
      ``critical_max_waiting`` (50), then LoRA affinity, then the least queue, then the least KV cache
      use, then round-robin among what is left. Latency first: the critical chain trades the
      strategy's cache or session affinity for the shortest queue.
    """
    (profile,) = raw["schedulingProfiles"]
    refs = profile["plugins"]
    critical_refs: list[dict[str, Any]] = [
        {"pluginRef": "circuit-breaker-filter"},
        {"pluginRef": "low-queue-filter"},
    ]
    plugins: list[dict[str, Any]] = [
        *raw["plugins"],
        {"type": "saturation-filter"},
        {"type": "low-queue-filter", "parameters": {"max_waiting": config.critical_max_waiting}},
        {"type": "least-queue-filter"},
        {"type": "least-kv-cache-filter"},
        {"type": "round-robin-picker", "name": "critical-round-robin"},
        {
            "type": "criticality-profile-handler",
            "parameters": {"critical": CRITICAL_PROFILE, "default": profile["name"]},
        },
    ]
    if config.lora_adapters:
        plugins.insert(0, {"type": LORA_AFFINITY})
        critical_refs.append({"pluginRef": LORA_AFFINITY})
    critical_refs += [
        {"pluginRef": "least-queue-filter"},
        {"pluginRef": "least-kv-cache-filter"},
        {"pluginRef": "critical-round-robin"},
    ]
    return {
        "plugins": plugins,
        "schedulingProfiles": [
            {"name": profile["name"], "plugins": [refs[0], {"pluginRef": "saturation-filter"}, *refs[1:]]},
            {"name": CRITICAL_PROFILE, "plugins": critical_refs},
        ],
    }


def with_disaggregation(raw: dict[str, Any], config: RouterConfig) -> dict[str, Any]:
    """A built-in configuration made a disaggregated strategy, as a user would write it: its profiles
    pick decode engines (and serve whole requests), the ``prefill`` profile (the circuit-breaker
    filter and the prefix-cache picker: the strategy's own instance when it has one, so one index
    serves both) prefill engines, the ``uncached-tokens-decider`` (``disagg_min_uncached_tokens``)
    decides between them on that picker's estimate, and the ``pd-profile-handler`` ties them together
    in place of the strategy's handler (whose decode profile, and critical one, it keeps)."""
    plugins = list(raw["plugins"])
    if not any(p.get("type") == _PREFIX_PICKER for p in plugins):
        plugins.append(_prefix_picker(config))
    name = next(p.get("name", p["type"]) for p in plugins if p.get("type") == _PREFIX_PICKER)
    prefill = {
        "name": PREFILL_PROFILE,
        "plugins": [{"pluginRef": "circuit-breaker-filter"}, {"pluginRef": name}],
    }
    profiles = raw["schedulingProfiles"]
    parameters = {"decode": profiles[0]["name"], "prefill": PREFILL_PROFILE, "decider": _DECIDER}
    handler = {"type": _PD_HANDLER, "parameters": parameters}
    for i, plugin in enumerate(plugins):
        if plugin.get("type") == "criticality-profile-handler":  # with_priority's: its two profiles
            parameters["decode"] = plugin["parameters"]["default"]
            parameters["critical"] = plugin["parameters"]["critical"]
            plugins[i] = handler
            break
    else:
        plugins.append(handler)
    decider = {"type": _DECIDER, "parameters": {"min_uncached_tokens": config.disagg_min_uncached_tokens}}
    return {**raw, "plugins": [*plugins, decider], "schedulingProfiles": [*profiles, prefill]}


def with_decider(raw: dict[str, Any], config: RouterConfig) -> dict[str, Any]:
    """A user's configuration written before disaggregation was declared in it (a profile named
    ``prefill``, no ``pd-profile-handler``, no decider) keeps working as it did: the prefill step is
    that profile behind an ``uncached-tokens-decider`` of the router's ``disagg_min_uncached_tokens``,
    and its own handler schedules whole and decode requests (:func:`..disaggregation.disaggregation_of`)."""
    plugins = raw.get("plugins")
    profiles = raw.get("schedulingProfiles", raw.get("scheduling_profiles"))
    if not isinstance(plugins, list) or not isinstance(profiles, list):
        return raw  # malformed: build_scheduling reports it
    if not any(isinstance(p, dict) and p.get("name") == PREFILL_PROFILE for p in profiles):
        return raw
    if any(isinstance(p, dict) and p.get("type") in (_PD_HANDLER, _DECIDER) for p in plugins):
        return raw  # declared: the configuration says what it wants
    decider = {"type": _DECIDER, "parameters": {"min_uncached_tokens": config.disagg_min_uncached_tokens}}
    return {**raw, "plugins": [*plugins, decider]}


def scheduling_config(config: RouterConfig) -> dict[str, Any]:
    """The router's scheduling configuration: its YAML ``scheduling`` section, else the built-in one
    (priority-aware unless ``priority_scheduling`` is off; with the LoRA-affinity filter when
    adapters are registered)."""
    if config.scheduling is not None:
        raw = with_decider(dict(config.scheduling), config)
    else:
        raw = builtin_config(config)
        if config.routing_logic == "priority":
            # production-stack's priority logic is its own use of priority: the criticality chains
            # (one profile each) are not added to its two profiles, and no disaggregation (whose
            # handler would replace its threshold handler)
            if config.disaggregated:
                raise ConfigError("routing_logic priority cannot be disaggregated; give a scheduling section")
            return with_lora_affinity(raw) if config.lora_adapters else raw
        if config.priority_scheduling:
            raw = with_priority(raw, config)
        if config.disaggregated:
            raw = with_disaggregation(raw, config)
    return with_lora_affinity(raw) if config.lora_adapters else raw


def build_scheduler(config: RouterConfig, metrics: RouterMetrics) -> Scheduler:
    """A scheduler for ``config`` alone, with the built-in plugins and fresh plugin state (tests, tools)."""
    setup = build_scheduling(scheduling_config(config), builtin_registry(), PluginState(), metrics)
    return setup.scheduler
