"""Eviction of in-flight sheddable requests for critical ones that wait (docs/scheduling.md, "Eviction")."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_stack.settings.declare import ConfigError, setting


@dataclass(frozen=True)
class EvictionGroup:
    """Off by default: evicting answers work a client already waits for with an error, which a
    deployment must choose. On, a critical request that has waited ``eviction_after`` seconds for its
    first token while every engine of its model is full makes the router abort one in-flight sheddable
    request on those engines (vllm_stack.director.eviction)."""

    __slots__ = ()

    eviction_enabled: bool = setting(
        False,
        doc="abort in-flight sheddable requests for critical ones that wait while every engine is full",
        flag="",
        chart="routerSpec.priority.eviction.enabled",
    )
    eviction_after: float = setting(
        2.0,
        doc="seconds a critical request waits for its first token before a sheddable one is evicted",
        flag="",
        chart="routerSpec.priority.eviction.afterSeconds",
    )

    def check(self) -> None:
        """Raise :class:`ConfigError` on eviction settings that cannot work."""
        if self.eviction_after <= 0:
            raise ConfigError("eviction_after must be > 0")
