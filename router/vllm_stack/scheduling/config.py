"""Scheduling configuration: plugins with parameters, profiles of weighted plugin references.

The router's YAML config takes a ``scheduling`` section shaped like the Gateway API Inference
Extension's ``EndpointPickerConfig``::

    scheduling:
      plugins:                       # instances: a type, an optional name, parameters
        - type: circuit-breaker-filter
        - name: load
          type: least-loaded-scorer
        - type: max-score-picker
          parameters: {reason: least_loaded}
        - type: request-tracker      # hooks (prepare-data, admission, pre-request,
                                     # response-complete) run when listed here
      schedulingProfiles:
        - name: default
          plugins:
            - pluginRef: circuit-breaker-filter
            - pluginRef: load
              weight: 2
            - pluginRef: max-score-picker

What a plugin is, its class declares (``roles``, checked against the protocols when the type is
registered): filter, scorer, picker, profile handler, and the hooks prepare-data, admission,
pre-request, response-complete. A profile without a picker gets a ``max-score-picker``; without a listed profile
handler, one profile gets the ``single-profile-handler`` (several profiles need one listed). The
``--routing-logic`` names are built-in configurations of this shape (:mod:`.profiles`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_stack.config import ConfigError
from vllm_stack.engines.adapter_placement import AdapterPlacement
from vllm_stack.engines.load import SaturationLimits
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.disaggregation import disaggregation_of
from vllm_stack.scheduling.framework import (
    Filter,
    Picker,
    Profile,
    ProfileHandler,
    Role,
    Scheduler,
    Scorer,
)
from vllm_stack.scheduling.plugins.max_score_picker import MaxScorePicker
from vllm_stack.scheduling.plugins.single_profile_handler import SingleProfileHandler
from vllm_stack.scheduling.registry import PluginContext, PluginRegistry, PluginState


@dataclass(frozen=True, slots=True)
class Hooks:
    """The stage hooks of a configuration, in the order their plugins are listed."""

    prepare: tuple[Callable[..., Any], ...] = ()
    admission: tuple[Callable[..., Any], ...] = ()
    pre_request: tuple[Callable[..., Any], ...] = ()
    response_complete: tuple[Callable[..., Any], ...] = ()


@dataclass(frozen=True, slots=True)
class SchedulingSetup:
    """What a configuration builds: the scheduler, the hooks, and a description for ``/engines``."""

    scheduler: Scheduler
    hooks: Hooks
    plugins: Mapping[str, Any] = field(default_factory=dict)
    description: Mapping[str, Any] = field(default_factory=dict)


#: The roles a profile's plugin reference may take.
_PROFILE_ROLES = frozenset({Role.FILTER, Role.SCORER, Role.PICKER})


def _key(entry: Mapping[str, Any], *names: str) -> Any:  # noqa: ANN401 - YAML values
    for name in names:
        if name in entry:
            return entry[name]
    return None


def _plugins(
    raw: Any, registry: PluginRegistry, context: PluginContext
) -> tuple[dict[str, Any], dict[str, str]]:  # noqa: ANN401
    if not isinstance(raw, Sequence) or isinstance(raw, str) or not raw:
        raise ConfigError("scheduling.plugins must be a non-empty list")
    instances: dict[str, Any] = {}
    types: dict[str, str] = {}
    for entry in raw:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("type"), str):
            raise ConfigError(f"scheduling.plugins: each entry needs a 'type' (got {entry!r})")
        unknown = set(entry) - {"name", "type", "parameters"}
        if unknown:
            raise ConfigError(f"scheduling.plugins: unknown keys {sorted(unknown)} in {entry!r}")
        type_name = entry["type"]
        name = entry.get("name") or type_name
        if not isinstance(name, str):
            raise ConfigError(f"scheduling.plugins: name must be a string (got {name!r})")
        if name in instances:
            raise ConfigError(f"scheduling.plugins: the name {name!r} is used twice")
        instances[name] = registry.create(type_name, name, entry.get("parameters"), context)
        types[name] = type_name
    return instances, types


def _profile(entry: Any, instances: Mapping[str, Any], metrics: RouterMetrics) -> Profile:  # noqa: ANN401
    if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
        raise ConfigError(f"scheduling.schedulingProfiles: each profile needs a name (got {entry!r})")
    name = entry["name"]
    refs = entry.get("plugins") or []
    if not isinstance(refs, Sequence) or isinstance(refs, str):
        raise ConfigError(f"profile {name!r}: plugins must be a list")
    filters: list[Filter] = []
    scorers: list[tuple[Scorer, float]] = []
    pickers: list[Picker] = []
    for ref in refs:
        ref_name = _key(ref, "pluginRef", "plugin_ref") if isinstance(ref, Mapping) else ref
        if ref_name not in instances:
            raise ConfigError(f"profile {name!r}: no plugin named {ref_name!r}")
        plugin = instances[ref_name]
        weight = _key(ref, "weight") if isinstance(ref, Mapping) else None
        roles = plugin.roles
        if Role.FILTER in roles:
            filters.append(plugin)
        if Role.SCORER in roles:
            w = 1.0 if weight is None else weight
            if isinstance(w, bool) or not isinstance(w, int | float) or w < 0:
                raise ConfigError(f"profile {name!r}: weight of {ref_name!r} must be a number >= 0")
            scorers.append((plugin, float(w)))
        if Role.PICKER in roles:
            pickers.append(plugin)
        if _PROFILE_ROLES.isdisjoint(roles):
            raise ConfigError(f"profile {name!r}: {ref_name!r} is not a filter, scorer or picker")
    if len(pickers) > 1:
        raise ConfigError(f"profile {name!r}: more than one picker")
    picker = pickers[0] if pickers else MaxScorePicker()
    return Profile(name, filters, scorers, picker, metrics)


def build_scheduling(
    raw: Mapping[str, Any],
    registry: PluginRegistry,
    state: PluginState,
    metrics: RouterMetrics,
    adapters: AdapterPlacement | None = None,
    saturation: SaturationLimits | None = None,
) -> SchedulingSetup:
    """Build plugins, profiles and hooks from a ``scheduling`` mapping (``ConfigError`` when invalid)."""
    if not isinstance(raw, Mapping):
        raise ConfigError("scheduling must be a mapping")
    unknown = set(raw) - {"plugins", "schedulingProfiles", "scheduling_profiles"}
    if unknown:
        raise ConfigError(f"scheduling: unknown keys {sorted(unknown)}")
    state.begin_build()
    applied = False
    try:
        context = PluginContext(state, metrics, adapters, saturation or SaturationLimits())
        instances, types = _plugins(raw.get("plugins"), registry, context)
        entries = _key(raw, "schedulingProfiles", "scheduling_profiles")
        if not isinstance(entries, Sequence) or isinstance(entries, str) or not entries:
            raise ConfigError("scheduling.schedulingProfiles must be a non-empty list")
        profiles: dict[str, Profile] = {}
        for entry in entries:
            profile = _profile(entry, instances, metrics)
            if profile.name in profiles:
                raise ConfigError(f"scheduling: profile {profile.name!r} is defined twice")
            profiles[profile.name] = profile
        handlers = [p for p in instances.values() if Role.PROFILE_HANDLER in p.roles]
        if len(handlers) > 1:
            raise ConfigError("scheduling: more than one profile handler")
        handler: ProfileHandler = handlers[0] if handlers else SingleProfileHandler()
        check = getattr(handler, "check", None)
        if check is not None:
            check(profiles)
        ordered = list(instances.values())
        hooks = Hooks(
            prepare=tuple(p.prepare for p in ordered if Role.PREPARE_DATA in p.roles),
            admission=tuple(p.admit for p in ordered if Role.ADMISSION in p.roles),
            pre_request=tuple(p.pre_request for p in ordered if Role.PRE_REQUEST in p.roles),
            response_complete=tuple(
                p.response_complete for p in ordered if Role.RESPONSE_COMPLETE in p.roles
            ),
        )
        description = {
            "plugins": types,
            "profiles": {
                p.name: {
                    "filters": [f.name for f in p.filters],
                    "scorers": {s.name: w for s, w in p.scorers},
                    "picker": p.picker.name,
                }
                for p in profiles.values()
            },
        }
        disaggregation = disaggregation_of(handler, profiles, instances)
        scheduler = Scheduler(profiles, handler, disaggregation)
        setup = SchedulingSetup(scheduler, hooks, instances, description)
        applied = True
        return setup
    finally:
        state.end_build(applied)
