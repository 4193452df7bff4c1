"""Router settings from the command line and a YAML file (production-stack flag names accepted).

Precedence: built-in defaults < YAML file < flags given on the command line. The YAML file uses the
flag names with ``-`` or ``_`` (``routing-logic: session`` or ``routing_logic: session``); lists may be
YAML lists or comma-separated strings. Each setting is declared once, in its group in
:mod:`vllm_stack.settings` (default, flag, reload rule, chart value); this module reads a file and the
flags into them. :func:`load_config` is pure, so the hot-reload watcher can call it again and swap the
result in.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from vllm_stack.settings import (
    AuthGroup,
    BatchGroup,
    DisaggGroup,
    DiscoveryGroup,
    EngineGroup,
    EvictionGroup,
    GatewayGroup,
    PriorityGroup,
    RateLimitGroup,
    SchedulingGroup,
    ServerGroup,
    TenantsGroup,
    TracingGroup,
    declared,
)
from vllm_stack.settings.declare import ConfigError
from vllm_stack.settings.disagg import DISAGG_PROTOCOLS
from vllm_stack.settings.discovery import DISCOVERY_KINDS, ENGINE_ROLES
from vllm_stack.settings.scheduling import KV_EVENT_MODES, SWITCH_VALUES, switch_value
from vllm_stack.settings.server import JSON_PARSERS
from vllm_stack.settings.tracing import TRACE_PROTOCOLS
from vllm_stack.tenants.declaration import TenantsError, load_tenants
from vllm_stack.tenants.identity import split_key_line

__all__ = [
    "DISAGG_PROTOCOLS",
    "DISCOVERY_KINDS",
    "ENGINE_ROLES",
    "GROUPS",
    "JSON_PARSERS",
    "KV_EVENT_MODES",
    "SWITCH_VALUES",
    "TRACE_PROTOCOLS",
    "DECLARED",
    "ConfigError",
    "RouterConfig",
    "load_config",
    "read_yaml",
    "switch_value",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterConfig(
    ServerGroup,
    AuthGroup,
    DiscoveryGroup,
    EngineGroup,
    SchedulingGroup,
    PriorityGroup,
    EvictionGroup,
    DisaggGroup,
    TracingGroup,
    GatewayGroup,
    BatchGroup,
    TenantsGroup,
    RateLimitGroup,
):
    """Every router setting: the groups of :mod:`vllm_stack.settings` in one flat object. Flat, so
    ``config.port`` stays a plain slot read wherever the code reads it (the request path among them) and
    ``dataclasses.replace`` builds a changed one; the groups only declare. Immutable: a reload builds a
    new one and swaps it in."""

    @property
    def disaggregated(self) -> bool:
        """Whether prefill-role engines are used: asked for, or implied by the strategy or the roles."""
        return (
            self.disaggregation
            or self.routing_logic == "disaggregated_prefill"
            or "prefill" in self.static_roles
            or bool(self.prefill_model_labels)
        )

    def validate(self) -> RouterConfig:
        """Raise :class:`ConfigError` on settings that cannot work (each group checks its own); return
        self for chaining."""
        for group in GROUPS:
            group.check(self)
        return self


#: The groups of settings, in the order they are checked and documented.
GROUPS: tuple[type, ...] = RouterConfig.__bases__
#: Every setting by name, as the YAML file and the flags name it, group by group.
DECLARED = {d.name: d for group in GROUPS for d in declared(group)}


def _coerce(name: str, value: Any) -> Any:  # noqa: ANN401 - any setting's type
    """Convert a YAML/CLI value to the field's type (its declared ``parse`` where the type alone does
    not say how)."""
    item = DECLARED[name]
    if item.setting.parse is not None:
        return item.setting.parse(value)
    kind = item.type
    if kind == "tuple[str, ...]":
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return tuple(str(v) for v in value)
    if value is None:
        return None
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "bool":
        return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
    if kind.startswith("str"):
        return str(value)
    return value


#: Settings earlier versions had: accepted with a warning so an old file still loads.
RETIRED = {
    "upstream_client": "the router has one upstream client, its own relay (benchmarks/router/README.md)",
}


def _normalise(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name in RETIRED:
            log.warning("%s: %r is ignored: %s", source, key, RETIRED[name])
            continue
        if name in DECLARED and not DECLARED[name].setting.in_file:
            raise ConfigError(
                f"{source}: {key!r} cannot be set here (use api_keys_file / admin_api_keys_file / "
                "priority_api_keys_file / --config / the environment's VLLM_STACK_BATCH_DATABASE_URL)"
            )
        if name not in DECLARED:
            raise ConfigError(f"{source}: unknown setting {key!r}")
        try:
            out[name] = _coerce(name, value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: bad value for {key!r}: {exc}") from exc
    return out


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML config file into normalised settings (``ConfigError`` when unreadable)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping")
    data = data.get("router", data) if isinstance(data.get("router"), dict) else data
    return _normalise(data, str(path))


def read_keys(
    path: str | None, environ: Mapping[str, str], variable: str = "VLLM_STACK_API_KEYS"
) -> dict[str, str | None]:
    """API keys from a file (one per line, ``#`` comments) plus the comma list in ``variable``, each
    with its tenant's name where the line is ``NAME: KEY`` (vllm_stack.tenants.identity), else None."""
    keys: dict[str, str | None] = {}
    lines: list[str] = []
    if path:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read api keys file {path}: {exc}") from exc
    lines += environ.get(variable, "").split(",")
    for line in lines:
        line = line.strip()
        if line and not line.startswith("#"):
            key, name = split_key_line(line)
            keys[key] = name or keys.get(key)
    return keys


def load_api_keys(
    path: str | None, environ: Mapping[str, str], variable: str = "VLLM_STACK_API_KEYS"
) -> frozenset[str]:
    """The keys of :func:`read_keys` (a name on a line is not part of its key)."""
    return frozenset(read_keys(path, environ, variable))


def load_config(
    cli: Mapping[str, Any] | None = None,
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> RouterConfig:
    """Build a validated config: defaults < YAML ``config_file`` < explicit ``cli`` settings."""
    environ = os.environ if environ is None else environ
    settings: dict[str, Any] = {}
    if config_file:
        settings.update(read_yaml(config_file))
    settings.update(_normalise({k: v for k, v in (cli or {}).items() if v is not None}, "command line"))
    config = replace(RouterConfig(), **settings, config_file=config_file)
    client_keys = read_keys(config.api_keys_file, environ)
    try:
        tenants = load_tenants(config.tenants_file)
    except TenantsError as exc:
        raise ConfigError(str(exc)) from exc
    config = replace(
        config,
        api_keys=frozenset(client_keys),
        api_key_names={key: name for key, name in client_keys.items() if name},
        tenants=tenants,
        admin_api_keys=load_api_keys(config.admin_api_keys_file, environ, "VLLM_STACK_ADMIN_API_KEYS"),
        priority_api_keys=load_api_keys(
            config.priority_api_keys_file, environ, "VLLM_STACK_PRIORITY_API_KEYS"
        ),
        batch_database_url=environ.get("VLLM_STACK_BATCH_DATABASE_URL") or None,
        rate_limit_redis_url=environ.get("VLLM_STACK_RATE_LIMIT_REDIS_URL") or None,
    )
    return config.validate()
