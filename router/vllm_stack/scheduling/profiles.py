"""The ``--routing-logic`` strategies: production-stack's names plus ours, each a built-in scheduling
configuration of the same shape a user writes in the router's YAML (:mod:`.config`).

Adding a strategy name is one entry in :func:`builtin_config`; adding a behaviour is a plugin.
``prefixaware`` is the prefix-cache picker: block-aligned chained keys of the whole prompt, an index
of which engine was sent which blocks, and a load bound; where engines publish KV events and the
router has the model's tokenizer, the events keep that index exact (:mod:`.index.feed`).
(production-stack's ``kvaware`` is something else, LMCache controller lookups, and is not this.)
"""

from __future__ import annotations

from typing import Any

from vllm_stack.config import ConfigError, RouterConfig
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.config import build_scheduling
from vllm_stack.scheduling.framework import Scheduler
from vllm_stack.scheduling.plugins import builtin_registry
from vllm_stack.scheduling.registry import PluginState

ROUTING_LOGICS = ("roundrobin", "random", "leastloaded", "p2c", "session", "prefixaware")


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


def builtin_config(config: RouterConfig) -> dict[str, Any]:
    """The scheduling configuration of ``config.routing_logic``."""
    logic = config.routing_logic
    epsilon = config.session_balance_epsilon
    if logic == "roundrobin":
        return _single(logic, {"type": "round-robin-picker"})
    if logic == "random":
        return _single(logic, {"type": "random-picker"})
    if logic == "leastloaded":
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
        parameters: dict[str, Any] = {"epsilon": epsilon, "kv_events": config.kv_events}
        if config.tokenizers:
            parameters["tokenizers"] = dict(config.tokenizers)
        return _single(logic, {"type": "prefix-cache-picker", "parameters": parameters})
    raise ConfigError(f"routing_logic must be one of {ROUTING_LOGICS} (got {logic!r})")


LORA_AFFINITY = "lora-affinity-filter"


def with_lora_affinity(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with the LoRA-affinity filter in every profile, unless it lists one itself: registered
    adapters are routed to where they are loaded whatever the strategy. It is the last filter, so it
    chooses among engines the others kept (an open circuit breaker does not leave it none)."""
    plugins = raw.get("plugins")
    profiles = raw.get("schedulingProfiles", raw.get("scheduling_profiles"))
    if not isinstance(plugins, list) or not isinstance(profiles, list):
        return raw  # malformed: build_scheduling reports it
    if any(isinstance(p, dict) and p.get("type") == LORA_AFFINITY for p in plugins):
        return raw
    key = "schedulingProfiles" if "schedulingProfiles" in raw else "scheduling_profiles"
    ref = {"pluginRef": LORA_AFFINITY}
    return {
        **raw,
        "plugins": [{"type": LORA_AFFINITY}, *plugins],
        key: [
            {**p, "plugins": [*(p.get("plugins") or []), ref]} if isinstance(p, dict) else p for p in profiles
        ],
    }


def scheduling_config(config: RouterConfig) -> dict[str, Any]:
    """The router's scheduling configuration: its YAML ``scheduling`` section, else the built-in one
    (with the LoRA-affinity filter when adapters are registered)."""
    raw = dict(config.scheduling) if config.scheduling is not None else builtin_config(config)
    return with_lora_affinity(raw) if config.lora_adapters else raw


def build_scheduler(config: RouterConfig, metrics: RouterMetrics) -> Scheduler:
    """A scheduler for ``config`` alone, with the built-in plugins and fresh plugin state (tests, tools)."""
    setup = build_scheduling(scheduling_config(config), builtin_registry(), PluginState(), metrics)
    return setup.scheduler
