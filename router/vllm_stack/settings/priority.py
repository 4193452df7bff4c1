"""Request priority and the router's queue: which requests wait, which are shed, and for how long."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_stack.priority import served_models
from vllm_stack.settings.auth import key_set
from vllm_stack.settings.declare import ConfigError, setting


def _models(value: Any) -> tuple[Any, ...]:  # noqa: ANN401 - YAML or a flag's string
    """``models`` as given (checked by vllm_stack.priority.served_models)."""
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    if not isinstance(value, list | tuple):
        raise ValueError(
            "expected a list of model names or {name, criticality, engine_priority, engine_kind}"
        )
    return tuple(value)


@dataclass(frozen=True)
class PriorityGroup:
    """Request priority (docs/scheduling.md, "Request priority"): the built-in strategies get the criticality
    chains. The saturation rule (vllm_stack.engines.load): queue >= max_waiting or KV usage >= max_kv.
    The per-model queue: requests wait there while every engine is saturated (or none is ready yet)."""

    __slots__ = ()

    # A request for a model with no ready engine waits in its queue (scale from zero) instead of a 404.
    models: tuple[Any, ...] = setting(
        (),
        compare=False,
        doc="the models this router serves: [name | {name, criticality, engine_priority, engine_kind}] "
        "(vllm_stack.priority; engine_kind: vllm_stack.engines.kinds, default vllm)",
        flag="",
        parse=_models,
    )
    priority_scheduling: bool = setting(
        True,
        doc="the built-in strategies schedule by criticality",
        flag="",
        chart="routerSpec.priority.enabled",
    )
    priority_header: str = setting(
        "x-request-priority",
        doc="the header a client names its request's priority in",
        flag="",
        chart="routerSpec.priority.header",
    )
    priority_api_keys_file: str | None = setting(
        None,
        doc="keys that may raise a request's priority above its model's, one per line "
        "(or env VLLM_STACK_PRIORITY_API_KEYS)",
        chart="routerSpec.priority.apiKeysSecret",
    )
    priority_api_keys: frozenset[str] = key_set("priority_api_keys_file", "VLLM_STACK_PRIORITY_API_KEYS")
    saturation_max_waiting: float = setting(
        5.0, doc="an engine with this many waiting requests is saturated", flag="",
        chart="routerSpec.priority.saturation.maxWaiting",
    )  # fmt: skip
    saturation_max_kv_cache_usage: float = setting(
        0.8, doc="an engine with this KV-cache usage (0..1) is saturated", flag="",
        chart="routerSpec.priority.saturation.maxKvCacheUsage",
    )  # fmt: skip
    critical_max_waiting: float = setting(
        50.0, doc="critical requests keep engines whose queue is below this", flag="",
        chart="routerSpec.priority.criticalMaxWaiting",
    )  # fmt: skip
    critical_reserve_slots: int = setting(
        0, doc="running slots per engine kept free of non-critical work (0: none)", flag="",
        chart="routerSpec.priority.criticalReserveSlots",
    )  # fmt: skip
    queue_max_per_model: int = setting(
        1000,
        doc="requests the router's queue holds per model (default 1000; 0: off)",
        chart="routerSpec.priority.queue.maxPerModel",
    )
    queue_max_per_band: int = setting(
        0,
        doc="requests the router's queue holds per model and priority band, fair by tenant "
        "(default 0: as many as queue_max_per_model)",
        chart="routerSpec.priority.queue.maxPerBand",
    )
    queue_timeout: float = setting(
        60.0,
        doc="seconds a request may wait in the router's queue, then 429 queue_timeout "
        "(503 when its model has no engine) (default 60)",
        chart="routerSpec.priority.queue.timeoutSeconds",
    )

    def check(self) -> None:
        """Raise :class:`ConfigError` on priority and queue settings that cannot work."""
        try:
            served_models(self.models)
        except ValueError as exc:
            raise ConfigError(f"models: {exc}") from None
        if (
            self.saturation_max_waiting < 0
            or self.critical_max_waiting < 0
            or self.critical_reserve_slots < 0
        ):
            raise ConfigError(
                "saturation_max_waiting, critical_max_waiting and critical_reserve_slots must be >= 0"
            )
        if not 0 < self.saturation_max_kv_cache_usage <= 1:
            raise ConfigError("saturation_max_kv_cache_usage must be in (0, 1]")
        if self.queue_max_per_model < 0 or self.queue_max_per_band < 0 or self.queue_timeout <= 0:
            raise ConfigError("queue_max_per_model and queue_max_per_band must be >= 0 and queue_timeout > 0")
        if not self.priority_header or self.priority_header.lower() != self.priority_header.strip().lower():
            raise ConfigError("priority_header must be a header name")
