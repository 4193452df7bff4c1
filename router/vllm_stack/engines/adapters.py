"""The LoRA adapter catalog and weighted model names, from the router's configuration.

An adapter is registered with its name (what clients put in ``model``), its source (a local path on
the engines, or ``hf:ORG/NAME`` for a Hub repository the engine downloads), its base model and a tier:

- ``hot``: loaded on every engine of the base model at start, again when an engine joins or restarts,
  and never unloaded by the router;
- ``warm``: loaded on demand, kept while used, unloaded only after every cold one;
- ``cold``: loaded on demand, unloaded first.

A weighted model name maps a client-visible name to weighted targets (base models or adapters): the
canary / blue-green split (90/10). A request with a session key always gets the same target (a user
does not flip between versions); one without gets the exact split by smooth weighted round-robin.

Both are plain data checked once (:class:`ConfigError` on anything that cannot work); the router swaps
a new catalog in on reload. Placement (which engine holds which adapter) is :mod:`.adapter_placement`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from vllm_stack.config import ConfigError
from vllm_stack.priority import parse_priority

TIERS = ("hot", "warm", "cold")
HUB_PREFIX = "hf:"
MAX_ADAPTERS = 10_000  # a bound on what a configuration can make the router hold
MAX_TARGETS = 64


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """One registered adapter."""

    name: str
    source: str  # a path on the engines, or hf:ORG/NAME
    base_model: str
    tier: str = "warm"
    priority: int | None = None  # its requests' default priority (``criticality``); None: its base model's

    @property
    def lora_path(self) -> str:
        """What ``POST /v1/load_lora_adapter`` gets as ``lora_path`` (vLLM resolves a Hub id itself)."""
        return self.source.removeprefix(HUB_PREFIX)

    @property
    def pinned(self) -> bool:
        return self.tier == "hot"

    def card(self) -> dict[str, Any]:
        """Its ``/v1/models`` entry, shaped like vLLM's for a loaded adapter."""
        return {
            "id": self.name,
            "object": "model",
            "owned_by": "vllm",
            "root": self.source,
            "parent": self.base_model,
        }


@dataclass(frozen=True, slots=True)
class WeightedName:
    """A client-visible model name split over weighted targets."""

    name: str
    targets: tuple[str, ...]
    weights: tuple[int, ...]


class TargetChooser:
    """Chooses a weighted name's target: sticky by session key, else smooth weighted round-robin
    (nginx's: over any window of ``sum(weights)`` requests each target gets exactly its weight)."""

    def __init__(self, entry: WeightedName) -> None:
        self.entry = entry
        self._total = sum(entry.weights)
        self._current = [0] * len(entry.weights)

    def choose(self, session_key: str | None) -> str:
        entry = self.entry
        if session_key is not None:
            point = xxhash.xxh3_64_intdigest(session_key.encode("utf-8", "surrogatepass")) % self._total
            for target, weight in zip(entry.targets, entry.weights, strict=True):
                if point < weight:
                    return target
                point -= weight
        current = self._current
        best = 0
        for i, weight in enumerate(entry.weights):
            current[i] += weight
            if current[i] > current[best]:
                best = i
        current[best] -= self._total
        return entry.targets[best]


def _adapter(raw: Any, index: int) -> AdapterSpec:  # noqa: ANN401 - YAML
    where = f"lora_adapters[{index}]"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} must be a mapping with name, source and base_model")
    unknown = set(raw) - {"name", "source", "base_model", "baseModel", "tier", "criticality"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    name, source = raw.get("name"), raw.get("source")
    base = raw.get("base_model", raw.get("baseModel"))
    tier = raw.get("tier", "warm")
    for key, value in (("name", name), ("source", source), ("base_model", base)):
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{where}: {key} must be a non-empty string")
    if tier not in TIERS:
        raise ConfigError(f"{where} ({name}): tier must be one of {TIERS} (got {tier!r})")
    if name == base:
        raise ConfigError(f"{where}: the adapter {name!r} has the name of its base model")
    priority = None
    if raw.get("criticality") is not None:
        try:
            priority = parse_priority(raw["criticality"])
        except ValueError as exc:
            raise ConfigError(f"{where} ({name}): criticality: {exc}") from None
    return AdapterSpec(name, source, base, tier, priority)


def _weighted(name: Any, raw: Any) -> WeightedName:  # noqa: ANN401 - YAML
    where = f"weighted_models[{name!r}]"
    if not isinstance(name, str) or not name:
        raise ConfigError(f"weighted_models: names must be non-empty strings (got {name!r})")
    if not isinstance(raw, Sequence) or isinstance(raw, str) or not raw or len(raw) > MAX_TARGETS:
        raise ConfigError(f"{where} must be a list of 1 to {MAX_TARGETS} {{model, weight}} entries")
    targets: list[str] = []
    weights: list[int] = []
    for entry in raw:
        if not isinstance(entry, Mapping) or set(entry) - {"model", "name", "weight"}:
            raise ConfigError(f"{where}: each target is a mapping with model and weight (got {entry!r})")
        target = entry.get("model", entry.get("name"))
        weight = entry.get("weight", 1)
        if not isinstance(target, str) or not target:
            raise ConfigError(f"{where}: a target's model must be a non-empty string")
        if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
            raise ConfigError(f"{where}: the weight of {target!r} must be an integer >= 0")
        if target in targets:
            raise ConfigError(f"{where}: {target!r} is listed twice")
        targets.append(target)
        weights.append(weight)
    if sum(weights) == 0:
        raise ConfigError(f"{where}: at least one weight must be > 0")
    kept = [(t, w) for t, w in zip(targets, weights, strict=True) if w > 0]
    return WeightedName(name, tuple(t for t, _ in kept), tuple(w for _, w in kept))


class AdapterCatalog:
    """Registered adapters by name and weighted model names, checked together."""

    def __init__(self, adapters: Sequence[AdapterSpec] = (), weighted: Sequence[WeightedName] = ()) -> None:
        self.adapters: dict[str, AdapterSpec] = {}
        for spec in adapters:
            if spec.name in self.adapters:
                raise ConfigError(f"lora_adapters: {spec.name!r} is registered twice")
            self.adapters[spec.name] = spec
        if len(self.adapters) > MAX_ADAPTERS:
            raise ConfigError(f"lora_adapters: at most {MAX_ADAPTERS} adapters")
        self.weighted: dict[str, TargetChooser] = {}
        for entry in weighted:
            if entry.name in self.adapters:
                raise ConfigError(f"weighted_models: {entry.name!r} is also a registered adapter")
            for target in entry.targets:
                if target in [w.name for w in weighted]:
                    raise ConfigError(f"weighted_models: {entry.name!r} targets another weighted name")
            self.weighted[entry.name] = TargetChooser(entry)
        self.hot: tuple[AdapterSpec, ...] = tuple(s for s in self.adapters.values() if s.pinned)

    @classmethod
    def from_settings(cls, adapters: Any, weighted: Any) -> AdapterCatalog:  # noqa: ANN401 - YAML
        """From the router settings ``lora_adapters`` (a list) and ``weighted_models`` (a mapping)."""
        if adapters is None:
            adapters = ()
        if not isinstance(adapters, Sequence) or isinstance(adapters, str):
            raise ConfigError("lora_adapters must be a list of {name, source, base_model, tier}")
        if weighted is None:
            weighted = {}
        if not isinstance(weighted, Mapping):
            raise ConfigError("weighted_models must map a model name to a list of {model, weight}")
        return cls(
            [_adapter(raw, i) for i, raw in enumerate(adapters)],
            [_weighted(name, raw) for name, raw in weighted.items()],
        )

    def __bool__(self) -> bool:
        return bool(self.adapters or self.weighted)

    def get(self, name: str) -> AdapterSpec | None:
        return self.adapters.get(name)

    def target(self, name: str, session_key: str | None) -> str | None:
        """The target a weighted name sends this request to, or None when ``name`` is not one."""
        chooser = self.weighted.get(name)
        return None if chooser is None else chooser.choose(session_key)

    def cards(self) -> list[dict[str, Any]]:
        """``/v1/models`` entries of every registered adapter and weighted name."""
        cards = [spec.card() for spec in self.adapters.values()]
        cards += [
            {"id": name, "object": "model", "owned_by": "vllm-stack", "root": None, "parent": None}
            for name in self.weighted
        ]
        return cards

    def describe(self) -> dict[str, Any]:
        return {
            "adapters": {
                s.name: {"base_model": s.base_model, "tier": s.tier, "source": s.source}
                for s in self.adapters.values()
            },
            "weighted_models": {
                name: dict(zip(c.entry.targets, c.entry.weights, strict=True))
                for name, c in self.weighted.items()
            },
        }
