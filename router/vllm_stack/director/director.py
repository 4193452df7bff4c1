"""The director of proxied requests: its settings, its collaborators, and the one reason-to-error map.

The director is swapped into nothing and swapped out of nothing: a configuration reload hands it a
new scheduling setup and settings (:meth:`Director.configure`); requests in flight keep the objects
they started with. Everything a request needs is reached from here, not from the router object, so
the director knows nothing of the application that assembled it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from vllm_stack.engines.registry import EngineRegistry
from vllm_stack.errors import RouterError, no_healthy_engine
from vllm_stack.metrics import RouterMetrics
from vllm_stack.relay.pool import EnginePools
from vllm_stack.scheduling.config import Hooks, SchedulingSetup
from vllm_stack.scheduling.framework import Reason, Scheduler

log = logging.getLogger(__name__)

_RETRY_AFTER = [(b"retry-after", b"1")]


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What a proxied request reads of the configuration; swapped as a whole on reload."""

    retries: int = 2
    request_timeout: float = 600.0
    engine_auth: bytes | None = None  # "Bearer <VLLM_API_KEY>" sent to engines
    access_log: bool = False


class Director:
    """What every proxied request (:class:`~vllm_stack.director.request.ProxiedRequest`, started by
    the API layer with this director) reaches: engines, pools, metrics, scheduling, hooks, settings."""

    __slots__ = ("registry", "pools", "metrics", "scheduler", "hooks", "settings")

    def __init__(
        self,
        registry: EngineRegistry,
        pools: EnginePools,
        metrics: RouterMetrics,
        setup: SchedulingSetup,
        settings: ProxySettings,
    ) -> None:
        self.registry = registry
        self.pools = pools
        self.metrics = metrics
        self.scheduler: Scheduler = setup.scheduler
        self.hooks: Hooks = setup.hooks
        self.settings = settings

    def configure(self, setup: SchedulingSetup, settings: ProxySettings) -> None:
        """A reload: new scheduling and settings for the requests that start from now on."""
        self.scheduler = setup.scheduler
        self.hooks = setup.hooks
        self.settings = settings

    @staticmethod
    def error_for(reason: str, model: str, message: str = "") -> RouterError:
        """The client's error for a request that got no engine: every reason, one place."""
        if reason in (Reason.NO_CANDIDATE, Reason.ALL_FILTERED):
            return no_healthy_engine(model)
        if reason == Reason.ALL_SATURATED:
            return RouterError(
                429,
                message or f"Every engine of model '{model}' is saturated; try again shortly.",
                code="engines_saturated",
                headers=_RETRY_AFTER,
            )
        if reason == Reason.OVERLOADED:
            return RouterError(
                429,
                message or f"Model '{model}' is overloaded; try again shortly.",
                code="overloaded",
                headers=_RETRY_AFTER,
            )
        if reason == Reason.ADAPTER_UNAVAILABLE:
            return RouterError(
                502, message or f"The LoRA adapter '{model}' could not be loaded.", code="adapter_load_failed"
            )
        log.error("no error is mapped for scheduling reason %r", reason)
        return RouterError(500, "The router could not route the request.", code="internal_error")
