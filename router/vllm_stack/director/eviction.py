"""Eviction of in-flight sheddable requests for critical ones that wait (off by default).

A critical request that reaches a full engine waits in that engine's queue (or, when no engine
passes its profile's filters, in the router's queue) until a running request there ends. Sheddable
work may hold those slots for a long time (a batch of long answers); the router's saturation rule
stops new sheddable requests, but not the ones already running. With eviction on, a critical request
that has waited ``eviction_after`` seconds without its first token, while every engine of its model
is full, makes the router abort one in-flight sheddable request: its connection to the engine is
closed (vLLM aborts a request whose connection closes, freeing its slot and KV blocks) and its client
is answered with the reason (:meth:`ProxiedRequest.evict <vllm_stack.director.request.ProxiedRequest.evict>`).

Which one, and how many (docs/scheduling.md, "Eviction"):

- only sheddable requests (priority < 0); never a standard or a critical one;
- on the engine the critical request waits on (any engine of its model when it waits in the router's
  queue);
- one per waiting critical request per check (the server's sweep, once a second): eviction frees
  exactly the slot needed, and the next check sees whether that was enough;
- the youngest first among those whose answer has begun (they hold a running slot for sure and have
  had the least work done), else the youngest of the rest (non-streamed answers show no progress).

"Full" is the engine's own figures: something waits there (the saturation rule's queue estimate is
above 0). An engine whose figures are unknown (stale, never scraped) is not full: nothing is evicted
on a guess, as nothing is held in the queue on one.

Only requests the router relays are tracked (``track`` on their leg's start, ``forget`` at their end),
and only while eviction is on: with it off the request path reads one setting.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from vllm_stack.engines.engine import Engine
from vllm_stack.engines.load import queue_estimate
from vllm_stack.engines.registry import EngineRegistry
from vllm_stack.metrics import RouterMetrics
from vllm_stack.tenants.declaration import TenantTable

log = logging.getLogger(__name__)

#: The reason an evicted request is answered with (reason header, error code, metric label).
EVICTED = "evicted"
#: The header that names why the router dropped a request (llm-d's router names it so): evicted here,
#: queue_full or queue_timeout by the director.
DROPPED_REASON = b"x-llm-d-request-dropped-reason"


class Evictable(Protocol):
    """An in-flight request as eviction sees it (a :class:`~vllm_stack.director.request.ProxiedRequest`)."""

    @property
    def priority(self) -> int: ...

    @property
    def tenant(self) -> str:
        """Who sent it (its rejection is counted under its tenant's metric label)."""
        ...

    def eviction_engine(self) -> Engine | None:
        """The engine its answer is being relayed from; None when no leg is open."""
        ...

    def answer_begun(self) -> bool:
        """Whether its first token (a streamed answer's first event) has arrived."""
        ...

    def evict(self, message: str) -> bool:
        """Abort it on its engine and answer its client that it was evicted; False when it could not
        be (it ended, or has no leg open)."""
        ...


class Evictor:
    """The in-flight sheddable requests per model, and the choice of which to evict."""

    __slots__ = ("registry", "metrics", "tenants", "_sheddable")

    def __init__(
        self, registry: EngineRegistry, metrics: RouterMetrics, tenants: Callable[[], TenantTable]
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        # The declared tenants as they are now (a reload replaces them): the victims' metric labels
        self.tenants = tenants
        # model (pool) -> the sheddable requests relayed now, in the order their legs started
        self._sheddable: dict[str, dict[Evictable, None]] = {}

    def track(self, model: str, request: Evictable) -> None:
        """A sheddable request's leg started (again, on a retry: it keeps its place)."""
        self._sheddable.setdefault(model, {})[request] = None

    def forget(self, model: str, request: Evictable) -> None:
        """A tracked request ended."""
        held = self._sheddable.get(model)
        if held is not None:
            held.pop(request, None)
            if not held:
                del self._sheddable[model]

    def tracked(self, model: str) -> int:
        """How many sheddable requests of ``model`` are in flight (for tests and ``GET /engines``)."""
        return len(self._sheddable.get(model, ()))

    def for_waiting(self, model: str, engine: Engine | None, waited: float, after: float) -> bool:
        """A critical request of ``model`` has waited ``waited`` seconds without its first token, on
        ``engine`` (None: in the router's queue): evict one sheddable request when it has waited
        ``after`` and every engine of the model is full. True when one was evicted."""
        if waited < after or model not in self._sheddable:
            return False
        engines = self.registry.candidates(model)
        if not engines or not all(_full(e) for e in engines):
            return False
        victim = choose(self._sheddable[model], engine)
        if victim is None:
            return False
        on = victim.eviction_engine()
        log.info(
            "evicting a sheddable request on %s for a critical request of %s that waited %.1fs",
            on.name if on is not None else "?",
            model,
            waited,
        )
        if not victim.evict(
            f"The request was evicted to make room for critical work on model '{model}'; try again later."
        ):
            return False
        self.metrics.tenant_rejected(self.tenants().label(victim.tenant), EVICTED)
        return True


def choose(requests: Iterable[Evictable], engine: Engine | None) -> Evictable | None:
    """The request to evict for a critical request waiting on ``engine`` (None: any engine): of the
    sheddable requests there, the youngest whose answer has begun, else the youngest. ``requests``
    are in the order their legs started (oldest first)."""
    youngest: Evictable | None = None
    for request in reversed(list(requests)):
        if request.priority >= 0:  # never a standard or critical one (a tracked one cannot be; guarded)
            continue
        on = request.eviction_engine()
        if on is None or (engine is not None and on is not engine):
            continue
        if request.answer_begun():
            return request
        if youngest is None:
            youngest = request
    return youngest


def _full(engine: Engine) -> bool:
    """Something waits on ``engine`` (no free running slot), by its own fresh figures."""
    waiting = queue_estimate(engine)
    return waiting is not None and waiting > 0
