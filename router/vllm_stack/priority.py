"""Request priority: the criticality classes and their integer priorities.

The integers are the Gateway API Inference Extension's (``InferenceObjective.spec.priority``): higher is
more important, 0 is the default. A class is the sign of the integer: ``critical`` above 0, ``standard``
0, ``sheddable`` below 0. vLLM's own ``priority`` request field runs the other way (lower is handled
first), so what an engine started with ``--scheduling-policy priority`` is sent is the negation.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: The largest priority magnitude accepted (a header or a configuration value beyond it is refused).
MAX_PRIORITY = 1_000_000


class Criticality(enum.StrEnum):
    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"


#: The priority a class name stands for.
CLASS_PRIORITY = {Criticality.CRITICAL: 1, Criticality.STANDARD: 0, Criticality.SHEDDABLE: -1}


def criticality(priority: int) -> Criticality:
    """The class of an integer priority."""
    if priority > 0:
        return Criticality.CRITICAL
    return Criticality.STANDARD if priority == 0 else Criticality.SHEDDABLE


def parse_priority(value: object) -> int:
    """A class name (any case) or an integer within +-``MAX_PRIORITY``; ``ValueError`` otherwise."""
    if isinstance(value, bool):
        raise ValueError("expected critical, standard, sheddable or an integer")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str):
        text = value.strip().lower()
        if text in CLASS_PRIORITY:
            return CLASS_PRIORITY[Criticality(text)]
        try:
            number = int(text)
        except ValueError:
            raise ValueError(f"expected critical, standard, sheddable or an integer, got {value!r}") from None
    else:
        raise ValueError(f"expected critical, standard, sheddable or an integer, got {value!r}")
    if abs(number) > MAX_PRIORITY:
        raise ValueError(f"priority must be within +-{MAX_PRIORITY}")
    return number


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A model the router is configured to serve (router setting ``models``)."""

    name: str
    priority: int = 0  # its requests' default priority (``criticality``)
    engine_priority: bool = False  # its engines run vLLM with ``--scheduling-policy priority``
    # What its engines are (vllm_stack.engines.kinds: vllm, sglang); checked by the router when built
    engine_kind: str = "vllm"


def served_models(entries: Iterable[object]) -> dict[str, ServedModel]:
    """The ``models`` setting, checked: each a name or ``{name, criticality, engine_priority, engine_kind}``."""
    models: dict[str, ServedModel] = {}
    for entry in entries:
        if isinstance(entry, str):
            entry = {"name": entry}
        if not isinstance(entry, Mapping):
            raise ValueError(f"a model entry must be a name or a mapping, got {entry!r}")
        unknown = set(entry) - {"name", "criticality", "engine_priority", "engine_kind"}
        if unknown:
            raise ValueError(f"model entry {entry.get('name')!r}: unknown keys {sorted(unknown)}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a model entry needs a name, got {entry!r}")
        raw = entry.get("criticality")
        try:
            priority = 0 if raw is None else parse_priority(raw)
        except ValueError as exc:
            raise ValueError(f"model {name!r}: criticality: {exc}") from None
        engine_priority = entry.get("engine_priority", False)
        if not isinstance(engine_priority, bool):
            raise ValueError(f"model {name!r}: engine_priority must be true or false")
        engine_kind = entry.get("engine_kind", "vllm")
        if not isinstance(engine_kind, str) or not engine_kind:
            raise ValueError(f"model {name!r}: engine_kind must be the name of an engine kind")
        models[name] = ServedModel(name, priority, engine_priority, engine_kind)
    return models
