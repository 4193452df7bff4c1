"""The director of proxied requests: its settings, its collaborators, and the one reason-to-error map.

The director is swapped into nothing and swapped out of nothing: a configuration reload hands it a
new scheduling setup and settings (:meth:`Director.configure`); requests in flight keep the objects
they started with. Everything a request needs is reached from here, not from the router object, so
the director knows nothing of the application that assembled it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_stack.director.disagg import DisaggSettings
from vllm_stack.director.eviction import DROPPED_REASON, Evictor
from vllm_stack.director.pd_notify import PdNotifications
from vllm_stack.director.queue import RequestQueue
from vllm_stack.engines.registry import EngineRegistry
from vllm_stack.errors import RouterError, no_healthy_engine
from vllm_stack.metrics import RouterMetrics
from vllm_stack.relay.pool import EnginePools
from vllm_stack.scheduling.config import Hooks, SchedulingSetup
from vllm_stack.scheduling.framework import Reason, RequestContext, Scheduler, SchedulingResult
from vllm_stack.tenants.shares import TenantShares

if TYPE_CHECKING:
    from vllm_stack.director.endpoint_picker import EndpointPickerClient
    from vllm_stack.tracing.otel import RequestTracer

log = logging.getLogger(__name__)

_RETRY_AFTER = [(b"retry-after", b"1")]

#: reason -> (status, code, default message, whether to send Retry-After)
_ERRORS: dict[str, tuple[int, str, str, bool]] = {
    # retry-after and the x-ratelimit-* headers come with the refusal (vllm_stack.director.rate_gate)
    Reason.RATE_LIMITED: (429, "rate_limit_exceeded", "Rate limit reached; try again later.", False),
    Reason.ALL_SATURATED: (
        429,
        "engines_saturated",
        "Every engine of model '{model}' is saturated; try again shortly.",
        True,
    ),
    Reason.OVERLOADED: (429, "overloaded", "Model '{model}' is overloaded; try again shortly.", True),
    Reason.ADAPTER_UNAVAILABLE: (
        502,
        "adapter_load_failed",
        "The LoRA adapter '{model}' could not be loaded.",
        False,
    ),
    Reason.QUEUE_FULL: (429, "queue_full", "The queue of model '{model}' is full; try again shortly.", True),
    Reason.QUEUE_TIMEOUT: (
        429,
        "queue_timeout",
        "No engine of model '{model}' had room in time; try again shortly.",
        True,
    ),
}

#: Reasons a request is dropped (by the queue, or the rate limits before it): their answers name the
#: reason in :data:`DROPPED_REASON`, as llm-d's router does (the rejection metric's reasons; eviction
#: adds its own)
_DROPPED = frozenset({Reason.QUEUE_FULL, Reason.QUEUE_TIMEOUT, Reason.RATE_LIMITED})


def engines_asleep(model: str, waking: bool) -> RouterError:
    """The 503 for a model whose healthy engines all sleep and that the request could not wake (a
    request that waits for a wake-up and is not served in time gets ``queue_timeout`` instead)."""
    how = (
        "no request can wait for one to wake (the router's queue is off: queue_max_per_model 0)"
        if waking
        else "the router does not wake them (router setting wake_sleeping_engines is off)"
    )
    return RouterError(
        503,
        f"Every engine of model '{model}' is asleep and {how}; wake one with POST /wake_up?id=ENGINE_ID "
        "(ids in GET /engines).",
        code="engine_sleeping",
        headers=_RETRY_AFTER,
    )


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What a proxied request reads of the configuration; swapped as a whole on reload."""

    retries: int = 2
    request_timeout: float = 600.0
    engine_auth: bytes | None = None  # "Bearer <VLLM_API_KEY>" sent to engines
    access_log: bool = False
    queue_timeout: float = 60.0  # seconds a request may wait in the model's queue
    queue_enabled: bool = True  # requests wait for room (False: answered at once, as before)
    # Configured models: one with no ready engine is waited for in its queue (scale from zero)
    served_models: frozenset[str] = frozenset()
    # Disaggregated prefill for models with prefill-role engines (None: off, no request checks)
    disagg: DisaggSettings | None = None
    debug_headers: bool = False  # answers carry x-vllm-stack-route (see route_header)
    # Seconds a critical request waits for its first token before sheddable work is evicted for it
    # (director.eviction; None: eviction off, nothing tracked)
    eviction_after: float | None = None
    # A request whose model's engines all sleep wakes one and waits for it (False: refused, 503)
    wake_sleeping: bool = True
    # A stream whose engine breaks goes on on another engine (director.continuation; False: broken off)
    stream_continuation: bool = True
    # The tenant headroom is kept (tenant_headroom_slots > 0): requests on engines are counted per tenant
    # and a request whose tenant is past its share is marked held_back as it is scheduled
    tenant_headroom: bool = False


class Director:
    """What every proxied request (:class:`~vllm_stack.director.request.ProxiedRequest`, started by
    the API layer with this director) reaches: engines, pools, metrics, scheduling, hooks, settings."""

    __slots__ = (
        "registry",
        "pools",
        "metrics",
        "scheduler",
        "hooks",
        "settings",
        "queue",
        "pd_notifications",
        "tracer",
        "endpoint_picker",
        "evictor",
        "waker",
        "shares",
    )

    def __init__(
        self,
        registry: EngineRegistry,
        pools: EnginePools,
        metrics: RouterMetrics,
        setup: SchedulingSetup,
        settings: ProxySettings,
        queue: RequestQueue | None = None,
        pd_notifications: PdNotifications | None = None,
        tracer: RequestTracer | None = None,
        endpoint_picker: EndpointPickerClient | None = None,
        shares: TenantShares | None = None,
    ) -> None:
        # Each tenant's requests on engines, per model (tenant headroom)
        self.shares = shares if shares is not None else TenantShares()
        self.queue = queue if queue is not None else RequestQueue(metrics)
        self.registry = registry
        self.pools = pools
        self.metrics = metrics
        self.scheduler: Scheduler = setup.scheduler
        self.hooks: Hooks = setup.hooks
        self.settings = settings
        # LMCache's PD notifications (the lmcache hand-over protocol only; None otherwise)
        self.pd_notifications = pd_notifications
        self.tracer = tracer  # None: tracing off (vllm_stack.tracing is then never imported)
        # Gateway mode: engines are asked of this external endpoint picker (None: scheduled here)
        self.endpoint_picker = endpoint_picker
        # In-flight sheddable requests while eviction is on (settings.eviction_after)
        self.evictor = Evictor(registry, metrics, lambda: self.queue.tenants)
        # Wakes a sleeping engine of a model (engines.sleep.SleepControl.wake_for; None: nothing wakes)
        self.waker: Callable[[str], bool] | None = None

    def configure(self, setup: SchedulingSetup, settings: ProxySettings) -> None:
        """A reload: new scheduling and settings for the requests that start from now on."""
        self.scheduler = setup.scheduler
        self.hooks = setup.hooks
        self.settings = settings

    def schedule(self, ctx: RequestContext) -> SchedulingResult:
        """Scheduling for one request: the profile its priority runs (``critical`` above 0, else
        ``standard``) over its pool's candidates. Every scheduling of a request's engine (a first try, a
        retry, the queue's try, the lmcache decode pick before a prefill) comes here. With the tenant
        headroom kept, a standard or sheddable request is first marked ``held_back`` when its tenant is past
        its share (tenants.shares), and the saturation rule then keeps the headroom from it."""
        scheduler = self.scheduler
        model = ctx.pool or ctx.model
        candidates = self.registry.candidates(model)
        if ctx.priority > 0:
            return scheduler.critical(ctx, candidates)
        if self.settings.tenant_headroom:
            shares = self.shares
            if shares.tracking:
                m = shares.models.get(model)
                # past_share could say yes only with another tenant active, or for a tenant not seen yet:
                # tested here, so a model's one active tenant costs no call
                if m is not None and (len(m.seen) > 1 or ctx.tenant not in m.seen):
                    slots = sum(e.running_slots or 0 for e in candidates)  # the slots learned so far
                    ctx.held_back = shares.past_share(model, ctx.tenant, slots)
                elif ctx.held_back:  # held back by an earlier try; alone now
                    ctx.held_back = False
            elif ctx.tenant != shares.solo:  # (one tenant so far: nothing is counted, nobody held back)
                shares.note(ctx.tenant, model, sum(e.in_flight for e in candidates))
        return scheduler.standard(ctx, candidates)

    def wake_for(self, model: str) -> bool:
        """A request of ``model`` found no awake engine: whether it may wait for one of its sleeping
        engines, which is being woken (wake_sleeping on, and one sleeps)."""
        waker = self.waker
        return waker is not None and self.settings.wake_sleeping and waker(model)

    def error_for(self, reason: str, model: str, message: str = "") -> RouterError:
        """The client's error for a request that got no engine: every reason, one place. A model of an
        external provider that fails its checks is a 502 that says why (a certificate its CA bundle does
        not verify, a refused key): the operator's mistake, which waiting would not mend."""
        if reason in (Reason.NO_CANDIDATE, Reason.ALL_FILTERED):
            if reason == Reason.NO_CANDIDATE and self.registry.sleeping(model):
                return engines_asleep(model, self.settings.wake_sleeping)
            failing = self.registry.failing_provider(model)
            if failing is not None:
                name, error = failing
                return RouterError(
                    502, f"External provider {name} is unreachable: {error}", code="upstream_unreachable"
                )
            return no_healthy_engine(model)
        mapped = _ERRORS.get(reason)
        if mapped is None:
            log.error("no error is mapped for scheduling reason %r", reason)
            return RouterError(500, "The router could not route the request.", code="internal_error")
        status, code, default, retry = mapped
        headers = _RETRY_AFTER if retry else []
        if reason in _DROPPED:
            headers = [*headers, (DROPPED_REASON, reason.encode())]
        return RouterError(
            status,
            message or default.format(model=model),
            code=code,
            headers=headers,
            error_type=code if reason == Reason.RATE_LIMITED else None,
        )

    def queue_timed_out(self, model: str, pool: str, waited: float) -> RouterError:
        """A request waited ``waited`` seconds (the queue's TTL) without an engine: 429 while the model
        has engines (they were busy: back off and retry), 503 when it has none at all (scale from
        zero did not bring one in time); either way ``queue_timeout``, with retry-after."""
        error = self.error_for(
            Reason.QUEUE_TIMEOUT,
            model,
            f"No engine of model '{model}' had room within {waited:g}s; try again shortly.",
        )
        if not self.registry.candidates(pool):
            error.status = 503
        return error
