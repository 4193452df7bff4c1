"""Plugin types by name, their parameters, and the state that outlives a configuration reload.

A plugin type is a class with a ``type_name``, a ``create(name, parameters, context)`` class method and
its ``roles`` (:class:`~vllm_stack.scheduling.framework.Role`), which registration checks against the
framework's protocols.
A :class:`PluginRegistry` maps type names to such classes; the router is given one (the built-ins of
:func:`vllm_stack.scheduling.plugins.builtin_registry`, plus whatever a caller registers), so a new
strategy is one file and one registration, and a test can add one without touching the package.

A reload rebuilds every plugin instance from the new configuration. What must survive it (an index of
where prefixes are cached, a rotation position) lives in the :class:`PluginState` store, which belongs
to the router and is handed to every factory: a plugin asks it for its entry by a key of its own and
gets the same object back after a reload.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, TypeVar

from vllm_stack.config import SWITCH_VALUES, ConfigError, switch_value
from vllm_stack.engines.adapter_placement import AdapterPlacement
from vllm_stack.engines.load import SaturationLimits
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.framework import Role, plugin_roles

T = TypeVar("T")


class PluginState:
    """Router-lifetime plugin state, by key. Entries with ``forget_engine(name)`` hear of departed engines."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, ...], Any] = {}
        self._asked: set[tuple[str, ...]] | None = None  # keys asked for by the build under way
        self._closing: set[asyncio.Task[None]] = set()  # dropped entries closing their connections

    def get(self, key: tuple[str, ...], create: Callable[[], T]) -> T:
        """The entry for ``key``, created by ``create()`` the first time it is asked for."""
        if self._asked is not None:
            self._asked.add(key)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = create()
        return entry  # type: ignore[no-any-return]

    def forget_engine(self, name: str) -> None:
        """An engine left: every entry that keeps per-engine data drops that engine's."""
        for entry in self._entries.values():
            forget = getattr(entry, "forget_engine", None)
            if forget is not None:
                forget(name)

    def begin_build(self) -> None:
        """A configuration is being built: note which entries its plugins ask for."""
        self._asked = set()

    def end_build(self, applied: bool) -> None:
        """The build is over. Applied: entries no plugin of it asked for are dropped (a plugin removed
        by the reload takes its state with it). Rejected: the running plugins keep everything."""
        asked, self._asked = self._asked, None
        if applied and asked is not None:
            for key in [k for k in self._entries if k not in asked]:
                self._close_soon(self._entries.pop(key))

    def _close_soon(self, entry: Any) -> None:  # noqa: ANN401 - any plugin state
        """A dropped entry that holds connections closes them, in the background (reloads are synchronous)."""
        aclose = getattr(entry, "aclose", None)
        if aclose is None:
            return
        try:
            task = asyncio.get_running_loop().create_task(aclose())
        except RuntimeError:  # no loop (a build outside the server, e.g. a test): nothing was opened
            return
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """The router stops: entries holding connections (``aclose``) close them."""
        entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            aclose = getattr(entry, "aclose", None)
            if aclose is not None:
                await aclose()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[tuple[str, ...]]:
        return iter(self._entries)


@dataclass(frozen=True, slots=True)
class PluginContext:
    """What a plugin factory is given besides its parameters."""

    state: PluginState
    metrics: RouterMetrics
    adapters: AdapterPlacement | None = None  # the router's LoRA adapter placement
    saturation: SaturationLimits = SaturationLimits()  # the router's saturation rule (engines.load)


class Parameters:
    """A plugin's ``parameters`` mapping, read with types; unknown keys are a :class:`ConfigError`."""

    def __init__(self, plugin: str, raw: Mapping[str, Any] | None) -> None:
        if raw is not None and not isinstance(raw, Mapping):
            raise ConfigError(f"plugin {plugin!r}: parameters must be a mapping")
        self.plugin = plugin
        self._raw = dict(raw or {})
        self._read: set[str] = set()

    def _get(self, key: str, default: Any) -> Any:  # noqa: ANN401 - the caller converts
        self._read.add(key)
        return self._raw.get(key, default)

    def number(self, key: str, default: float, *, minimum: float | None = None) -> float:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"plugin {self.plugin!r}: parameter {key!r} must be a number")
        if minimum is not None and value < minimum:
            raise ConfigError(f"plugin {self.plugin!r}: parameter {key!r} must be >= {minimum}")
        return float(value)

    def string(self, key: str, default: str) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise ConfigError(f"plugin {self.plugin!r}: parameter {key!r} must be a string")
        return value

    def switch(self, key: str, default: str) -> str:
        """``auto``, ``on`` or ``off`` (YAML's booleans, as ``on``/``off`` unquoted parse, accepted)."""
        value = switch_value(self._get(key, default))
        if value not in SWITCH_VALUES:
            raise ConfigError(f"plugin {self.plugin!r}: parameter {key!r} must be auto, on or off")
        return value

    def mapping(self, key: str) -> dict[str, str]:
        value = self._get(key, {})
        if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ConfigError(f"plugin {self.plugin!r}: parameter {key!r} must map strings to strings")
        return dict(value)

    def done(self) -> None:
        """Raise on parameters the plugin does not know (a typo must not be ignored silently)."""
        unknown = sorted(set(self._raw) - self._read)
        if unknown:
            raise ConfigError(f"plugin {self.plugin!r}: unknown parameters {unknown}")


class PluginType(Protocol):
    """A plugin class: its registered type name, what it does, and its factory."""

    type_name: ClassVar[str]
    roles: ClassVar[Collection[Role]]

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> Any: ...  # noqa: ANN401


class PluginRegistry:
    """Type name -> plugin class. Owned by whoever builds the router; no process-wide registry."""

    def __init__(self) -> None:
        self._types: dict[str, type[PluginType]] = {}

    def register(self, plugin: type[PluginType]) -> type[PluginType]:
        """Add a plugin type (usable as a class decorator). A name can be registered once; a class
        whose roles do not match its methods is refused (``TypeError``, see ``plugin_roles``)."""
        plugin_roles(plugin)
        name = plugin.type_name
        if name in self._types and self._types[name] is not plugin:
            raise ValueError(f"plugin type {name!r} is already registered")
        self._types[name] = plugin
        return plugin

    def create(
        self, type_name: str, name: str, parameters: Mapping[str, Any] | None, context: PluginContext
    ) -> Any:  # noqa: ANN401
        plugin = self._types.get(type_name)
        if plugin is None:
            raise ConfigError(
                f"plugin {name!r}: unknown type {type_name!r}; known: {', '.join(sorted(self._types))}"
            )
        params = Parameters(name, parameters)
        instance = plugin.create(name, params, context)
        params.done()
        try:
            plugin_roles(instance)  # what the factory made is what runs: its roles are checked too
        except TypeError as err:
            raise ConfigError(f"plugin {name!r}: {err}") from None
        return instance

    def types(self) -> list[str]:
        return sorted(self._types)
