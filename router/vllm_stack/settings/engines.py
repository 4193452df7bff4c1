"""How the router talks to its engines: health, circuit breaking, time limits, TLS, retries, LoRA."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_stack.settings.declare import ConfigError, setting


def _adapters(value: Any) -> tuple[Any, ...]:  # noqa: ANN401 - YAML as given
    """``lora_adapters`` as given (checked by vllm_stack.engines.adapters)."""
    if not isinstance(value, list | tuple):
        raise ValueError("expected a list of {name, source, base_model, tier}")
    return tuple(value)


def _weighted(value: Any) -> dict[str, Any]:  # noqa: ANN401 - YAML as given
    if not isinstance(value, Mapping):
        raise ValueError("expected a mapping of model name to [{model, weight}, ...]")
    return dict(value)


@dataclass(frozen=True)
class EngineGroup:
    """Engine health and connections, and the LoRA adapters placed on the engines."""

    __slots__ = ()

    engine_scrape_interval: float = setting(
        1.0, doc="seconds between /metrics scrapes (default 1)", chart="routerSpec.engineScrapeInterval"
    )
    health_check_interval: float = setting(
        5.0, doc="seconds between health checks (default 5)", chart="routerSpec.healthCheckInterval"
    )
    health_failure_threshold: int = setting(
        3, doc="failed health checks that make an engine unhealthy", flag=""
    )
    health_success_threshold: int = setting(2, doc="passed health checks that make it healthy again", flag="")
    circuit_failure_threshold: int = setting(
        5, doc="failures in a row that open an engine's circuit", flag=""
    )
    circuit_open_seconds: float = setting(10.0, doc="seconds an open circuit stays open", flag="")
    request_timeout: float = setting(
        600.0, doc="seconds an engine may stay silent (default 600)", chart="routerSpec.requestTimeout"
    )
    connect_timeout: float = setting(5.0, doc="seconds a connection to an engine may take", flag="")
    engine_ca_file: str | None = setting(
        None,
        doc="CA bundle for https engines (default: the system's)",
        restart="the engines' TLS context (pooled connections, control session) is built at start",
    )
    # production-stack's --max-instance-failover-reroute-attempts is the same count (its reroutes of a
    # request whose instance failed, onto another instance); its default is 0, ours 2.
    retries: int = setting(
        2,
        doc="extra attempts on another engine (default 2)",
        aliases=("--max-instance-failover-reroute-attempts",),
    )
    stream_continuation: bool = setting(
        True,
        doc="a stream whose engine breaks after it began is continued on another engine of the model "
        '(one of the retries; docs/hardening.md "A stream that survives its engine"); off: it ends '
        "with an error event",
        negatable=True,
        chart="routerSpec.streamContinuation",
    )
    wake_sleeping_engines: bool = setting(
        True,
        doc="a request whose model's engines all sleep (vLLM's sleep mode) wakes one and waits for it "
        "in the queue (default); off: it is answered 503 engine_sleeping",
        negatable=True,
    )
    # LoRA adapters (vllm_stack.engines.adapters): [{name, source, base_model, tier}], checked there
    lora_adapters: tuple[Mapping[str, Any], ...] = setting(
        (),
        compare=False,
        doc="LoRA adapters: [{name, source, base_model, tier, criticality}] (docs/scheduling.md)",
        flag="",
        parse=_adapters,
    )
    weighted_models: Mapping[str, Any] | None = setting(
        None,
        compare=False,
        doc="weighted model names: {name: [{model, weight}, ...]} (canary / blue-green splits)",
        flag="",
        chart="routerSpec.weightedModels",
        parse=_weighted,
    )
    lora_load_timeout: float = setting(120.0, doc="seconds one LoRA adapter load may take (default 120)")

    def check(self) -> None:
        """Raise :class:`ConfigError` on engine settings that cannot work."""
        if self.retries < 0 or self.request_timeout <= 0:
            raise ConfigError("retries must be >= 0; max_body_bytes and request_timeout > 0")
        if self.engine_scrape_interval <= 0 or self.health_check_interval <= 0:
            raise ConfigError("scrape and health-check intervals must be > 0")
        if self.lora_load_timeout <= 0:
            raise ConfigError("lora_load_timeout must be > 0")
