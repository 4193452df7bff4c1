"""The tenants declaration: each configured tenant's name, weight and limits.

Read from the ``tenants_file`` setting (the chart renders ``routerSpec.tenants`` into it)::

    tenants:
      - name: team-a
        weight: 2                  # its share of a saturated band's departures (default 1)
        requests_per_minute: 600   # limits, enforced by the rate limiter (none: unlimited)
        tokens_per_minute: 200000

Keys may be written in snake_case or, as the chart's values are, camelCase (``requestsPerMinute``).
A tenant nobody declared has weight 1 and no limits. The metric label of a request's tenant is its
name when declared (or the shared tenant's), ``other`` for every other name, so a client that makes
up names cannot grow the metrics.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from vllm_stack.tenants.identity import DEFAULT_TENANT, OTHER_TENANTS, valid_name


class TenantsError(ValueError):
    """A tenants declaration that cannot be used (the configuration loader reports it as its own error)."""


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One declared tenant. ``requests_per_minute`` / ``tokens_per_minute``: None is no limit."""

    name: str
    weight: float = 1.0
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


_FIELDS = {
    "name": "name",
    "weight": "weight",
    "requests_per_minute": "requests_per_minute",
    "requestsPerMinute": "requests_per_minute",
    "tokens_per_minute": "tokens_per_minute",
    "tokensPerMinute": "tokens_per_minute",
}


class TenantTable:
    """The declared tenants by name; immutable once built (a reload builds another)."""

    __slots__ = ("specs",)

    def __init__(self, specs: Iterable[TenantSpec] = ()) -> None:
        self.specs: Mapping[str, TenantSpec] = {s.name: s for s in specs}

    def __bool__(self) -> bool:
        return bool(self.specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TenantTable) and dict(self.specs) == dict(other.specs)

    def __hash__(self) -> int:
        return hash(tuple(self.specs.values()))

    def __repr__(self) -> str:
        return f"TenantTable({sorted(self.specs)})"

    def get(self, name: str) -> TenantSpec | None:
        return self.specs.get(name)

    def weight(self, name: str) -> float:
        """``name``'s weight in the fair queue (1 when it is not declared)."""
        spec = self.specs.get(name)
        return spec.weight if spec is not None else 1.0

    def label(self, name: str) -> str:
        """``name`` as a metric label: bounded to the declared names, the shared tenant and ``other``."""
        return name if name in self.specs or name == DEFAULT_TENANT else OTHER_TENANTS


def parse_tenants(data: Any, source: str) -> TenantTable:  # noqa: ANN401 - YAML as read
    """The declaration from a YAML document (``{tenants: [...]}`` or the list itself)."""
    if data is None:
        return TenantTable()
    if isinstance(data, Mapping):
        data = data.get("tenants", [])
    if not isinstance(data, list):
        raise TenantsError(f"{source}: expected a list of tenants ({{name, weight, ...}})")
    specs: list[TenantSpec] = []
    seen: set[str] = set()
    for i, item in enumerate(data):
        where = f"{source}: tenants[{i}]"
        if not isinstance(item, Mapping):
            raise TenantsError(f"{where}: expected a mapping with a 'name'")
        unknown = sorted(str(k) for k in item if k not in _FIELDS)
        if unknown:
            raise TenantsError(f"{where}: unknown field(s) {', '.join(unknown)}")
        values = {_FIELDS[k]: v for k, v in item.items()}
        name = values.get("name")
        if not isinstance(name, str) or not valid_name(name):
            raise TenantsError(f"{where}: 'name' must be 1-64 characters of letters, digits, '.', '_', '-'")
        if name == OTHER_TENANTS:
            raise TenantsError(f"{where}: '{OTHER_TENANTS}' is the metric label of undeclared tenants")
        if name in seen:
            raise TenantsError(f"{where}: tenant '{name}' is declared twice")
        seen.add(name)
        specs.append(
            TenantSpec(
                name,
                _weight(values.get("weight", 1.0), where),
                _limit(values.get("requests_per_minute"), where, "requests_per_minute"),
                _limit(values.get("tokens_per_minute"), where, "tokens_per_minute"),
            )
        )
    return TenantTable(specs)


def load_tenants(path: str | None) -> TenantTable:
    """The declaration in the file at ``path`` (none: no tenant declared)."""
    if not path:
        return TenantTable()
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise TenantsError(f"cannot read tenants file {path}: {exc}") from exc
    return parse_tenants(data, path)


#: A weight's bounds: its inverse is the fair queue's step per departure, which must stay a finite,
#: meaningful float (a weight of 1e-320 would make it infinite); a million to one is more than any
#: deployment's shares differ.
MIN_WEIGHT = 0.001
MAX_WEIGHT = 1_000_000
#: A limit's upper bound (per minute): far past any fleet's rate, and exact as a float (the buckets'
#: arithmetic) and as a Lua number (the Redis script's).
MAX_LIMIT = 10**12


def _weight(value: Any, where: str) -> float:  # noqa: ANN401 - YAML as read
    # compared before any conversion: float() of a huge YAML integer raises OverflowError, not ours
    if isinstance(value, bool) or not isinstance(value, int | float) or not MIN_WEIGHT <= value <= MAX_WEIGHT:
        raise TenantsError(f"{where}: 'weight' must be a positive number from {MIN_WEIGHT} to {MAX_WEIGHT}")
    return float(value)


def _limit(value: Any, where: str, field: str) -> int | None:  # noqa: ANN401 - YAML as read
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_LIMIT:
        raise TenantsError(
            f"{where}: '{field}' must be a positive integer, at most {MAX_LIMIT} (leave it out for no limit)"
        )
    return value
