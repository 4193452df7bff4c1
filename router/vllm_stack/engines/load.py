"""Engine load, as every routing plugin sees it: one module, one rule for stale metrics.

Three figures describe an engine's load:
- ``in_flight``: the router's own count of requests it sent there and has not finished; exact and
  instant (kept by the director);
- the scraped ``vllm:num_requests_waiting`` / ``running`` / KV usage: the engine's own view, up to one
  scrape interval old, and **unknown** once older than the engine's ``stale_after``;
- the completion tracker (:class:`CompletionStats`): smoothed time to first token and duration of the
  requests that engine finished, fed by the ``request-tracker`` response-complete plugin.

The stale rule: scraped figures older than ``stale_after`` are not zero, they are unknown
(:func:`fresh_telemetry` answers None). A comparison across engines uses a scraped term only when
every engine compared has it fresh; otherwise the term is dropped for all of them, never zeroed for
one, so traffic is not pushed to the engine the router knows least about.

Saturation (:func:`saturated`), the one rule every plugin and the router's queue use: an engine is
saturated when its estimated waiting queue is at least ``max_waiting`` (5) or its KV cache usage at
least ``max_kv_cache_usage`` (0.8). The queue estimate (:func:`queue_estimate`) is the scraped
``num_requests_waiting`` moved by the router's own in-flight count since that scrape, while the engine
was queuing: there a request sent adds one and a finished one takes one away, so a request held in
the router's queue is dispatched the moment one ends there, not a scrape later. An engine that was
not queuing at the scrape had free running slots: once its slot count is known (``running_slots``,
the most it ran at a scrape where others waited), what the router sent since beyond those slots is
waiting; before that it stays at 0 until the next scrape (a burst on an engine never seen full is not
held back by a guess). Without the slot count, a scrape that caught a saturated engine with an empty
queue for a moment let the router's whole queue go there at once, and critical requests then found
every engine past their own limit for as long as that backlog took to drain.
An engine whose figures are stale or missing is **not** saturated: unknown
is not full, and a metrics outage must not hold all traffic in the router's queue until it times
out (the circuit breaker and the health checks deal with engines that really fail).

Critical headroom (``critical_reserve_slots``, off by default): a critical request reaches an engine at
once and, where the engine schedules by priority, goes to the head of its queue, but it still waits for a
running slot to free (vLLM preempts for priority only when KV blocks run out). With a reserve of ``r``,
an engine whose slot count is known (the most it ran at a scrape where others waited) is also
saturated once what is there reaches its slots less ``r``, so standard and sheddable work leaves ``r``
slots to critical requests.

Tenant headroom (``tenant_headroom_slots``, :mod:`vllm_stack.tenants.shares`): for a request whose tenant
holds more than its share of the model's engines (averaged over seconds) while another tenant is active (the director marks it
``held_back`` on the request's context), an engine whose slot count is known is also saturated once what
is there reaches its slots less the critical reserve and the headroom, so a tenant within its share finds
a free slot at once instead of waiting behind the one that fills them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from operator import attrgetter
from typing import Protocol, TypeVar


@dataclass(slots=True)
class EngineTelemetry:
    """Load figures scraped from the engine's ``/metrics`` (summed over ``model_name``)."""

    running: float
    waiting: float
    kv_cache_usage: float | None
    prefix_cache_queries: float | None
    prefix_cache_hits: float | None
    scraped_at: float  # time.monotonic()
    block_size: int | None = None  # tokens per KV block (vllm:cache_config_info)
    num_blocks: int | None = None  # KV capacity in blocks (vllm:cache_config_info num_gpu_blocks)
    # vllm:lora_requests_info (its latest series): adapter slots, and the adapters with requests
    # running or waiting there (None: the engine does not serve LoRA, or published no such series)
    max_loras: int | None = None
    running_adapters: frozenset[str] | None = None
    waiting_adapters: frozenset[str] | None = None
    # vllm:engine_sleep_state: 0 awake, else vLLM's sleep level (1: weights offloaded, 2: discarded);
    # None: the engine does not publish it (another kind, an older vLLM)
    sleep_level: int | None = None
    # The router's own in-flight count there when the figures arrived: what it sent or finished
    # since moves the queue estimate between scrapes (:func:`queue_estimate`).
    in_flight: int = 0


class LoadedEngine(Protocol):
    """What these rules read of an engine (:class:`vllm_stack.engines.engine.Engine`, which imports this
    module: named here by what is read, so the import runs one way)."""

    telemetry: EngineTelemetry | None
    stale_after: float  # seconds after which its scraped figures are unknown
    in_flight: int  # the router's own count of requests sent there and not finished
    running_slots: int | None  # requests it runs at once, once seen queuing


E = TypeVar("E", bound=LoadedEngine)  # the rules that keep engines give back what they were given

#: Weight of the newest sample in the completion tracker's moving averages.
EWMA_ALPHA = 0.2


def fresh_telemetry(engine: LoadedEngine, now: float | None = None) -> EngineTelemetry | None:
    """The engine's scraped figures, or None when missing or older than its ``stale_after``."""
    t = engine.telemetry
    if t is None:
        return None
    if (time.monotonic() if now is None else now) - t.scraped_at > engine.stale_after:
        return None
    return t


def age(telemetry: EngineTelemetry) -> float:
    """Seconds since the figures were scraped."""
    return time.monotonic() - telemetry.scraped_at


_IN_FLIGHT = attrgetter("in_flight")


def in_flight(engines: Sequence[LoadedEngine]) -> list[int]:
    """The router's own in-flight count per engine (read in C: this runs for every request)."""
    return list(map(_IN_FLIGHT, engines))


def engine_loads(engines: Sequence[LoadedEngine]) -> list[float]:
    """In-flight requests plus ``vllm:num_requests_waiting`` (the queue term under the stale rule)."""
    return _scraped_or_in_flight(engines, lambda t, e: e.in_flight + t.waiting)


def _scraped_or_in_flight(
    engines: Sequence[LoadedEngine], term: Callable[[EngineTelemetry, LoadedEngine], float]
) -> list[float]:
    """``term`` of every engine, under the stale rule: when any engine's figures are unknown, the
    router's own in-flight counts for all of them (the only term they all have)."""
    now = time.monotonic()
    values: list[float] = []
    for e in engines:
        t = fresh_telemetry(e, now)
        if t is None:
            return [float(e.in_flight) for e in engines]
        values.append(term(t, e))
    return values


def bounded_capacity(counts: Sequence[float], epsilon: float) -> int:
    """Bounded loads (consistent hashing with bounded loads): an engine at or above
    ``ceil((1 + epsilon) * (total + 1) / n)`` takes no more, so with the next request counted no engine
    goes past ``1 + epsilon`` times the mean; the least loaded is always below it."""
    return math.ceil((1.0 + epsilon) * (sum(counts) + 1) / len(counts))


def queue_length(engine: LoadedEngine, now: float | None = None) -> float | None:
    """The engine's own waiting queue, or None when unknown (stale or never scraped)."""
    t = fresh_telemetry(engine, now)
    return None if t is None else t.waiting


def queue_estimate(engine: LoadedEngine, now: float | None = None) -> float | None:
    """The engine's waiting queue now (the module docstring's estimate); None when unknown (stale or
    never scraped)."""
    t = fresh_telemetry(engine, now)
    return None if t is None else _estimate(t, engine)


def _unclamped_estimate(t: EngineTelemetry, engine: LoadedEngine) -> float | None:
    """The queue estimate before it is clamped at 0; None for an engine that was not queuing at the
    scrape and whose slot count is not known (the estimate is then 0 until the next scrape)."""
    if t.waiting > 0.0:
        return t.waiting + engine.in_flight - t.in_flight
    if engine.running_slots is not None:  # free slots at the scrape: what went past them waits
        return t.running + engine.in_flight - t.in_flight - engine.running_slots
    return None


def _estimate(t: EngineTelemetry, engine: LoadedEngine) -> float:
    estimate = _unclamped_estimate(t, engine)
    return estimate if estimate is not None and estimate > 0.0 else 0.0


def queue_estimates(engines: Sequence[LoadedEngine]) -> list[float]:
    """:func:`queue_estimate` of every engine, under the stale rule."""
    return _scraped_or_in_flight(engines, _estimate)


@dataclass(frozen=True, slots=True)
class SaturationLimits:
    """When an engine counts as saturated (router settings ``saturation_max_waiting`` and
    ``saturation_max_kv_cache_usage``)."""

    max_waiting: float = 5.0
    max_kv_cache_usage: float = 0.8
    # Running slots kept free of the requests this rule admits (for critical ones, which do not use it);
    # 0: none. Applies to an engine once its slot count is known (Engine.running_slots).
    reserve_slots: int = 0
    # Running slots more kept free of a request marked held_back (its tenant is past its share); 0: none.
    headroom_slots: int = 0


def saturated(engine: LoadedEngine, limits: SaturationLimits, now: float | None = None) -> bool:
    """The saturation rule (module docstring): estimated queue >= ``max_waiting`` or KV usage >=
    ``max_kv_cache_usage``; never for an engine whose figures are unknown."""
    return not unsaturated((engine,), limits, now)


def unsaturated(engines: Sequence[E], limits: SaturationLimits, now: float | None = None) -> Sequence[E]:
    """The engines the rule does not call saturated (``engines`` itself when that is all of them)."""
    return _unsaturated(limits, None, engines, now)


class HeldBack(Protocol):
    """What the rule reads of a request's context (scheduling.framework.RequestContext)."""

    held_back: bool  # its tenant is past its share: the headroom is kept from it


def saturation_rule(limits: SaturationLimits) -> Callable[[HeldBack | None, Sequence[E]], Sequence[E]]:
    """The rule as a scheduling filter's ``filter(ctx, engines)``: a partial of the rule itself, so
    filtering makes no Python call besides the rule's."""
    return partial(_unsaturated, limits)


def _unsaturated(
    limits: SaturationLimits, ctx: HeldBack | None, engines: Sequence[E], now: float | None = None
) -> Sequence[E]:
    """The rule itself, written out in one loop: this runs for every standard request.

    Figures that show no queue and KV usage below the limit, for an engine whose slot count is not
    known, say "not saturated" whether fresh or stale, so the clock is read only for an engine whose
    figures could say "saturated" (the stale rule then decides)."""
    max_waiting = limits.max_waiting
    max_kv = limits.max_kv_cache_usage
    reserve = limits.reserve_slots
    if ctx is not None and ctx.held_back:
        reserve += limits.headroom_slots
    kept: list[E] | None = None
    for i, e in enumerate(engines):
        t = e.telemetry
        full = False
        if t is not None and (
            t.waiting > 0.0
            or e.running_slots is not None
            or (t.kv_cache_usage is not None and t.kv_cache_usage >= max_kv)
        ):
            if now is None:
                now = time.monotonic()
            if now - t.scraped_at <= e.stale_after:  # the stale rule: unknown is not full
                estimate = _unclamped_estimate(t, e)
                full = estimate is not None and estimate >= max_waiting
                slots = e.running_slots
                if not full and reserve and slots is not None:
                    # the headroom: what is there now (running, waiting, and what the router sent or saw
                    # finish since the scrape) may not reach the slots less the reserve
                    full = t.running + t.waiting + e.in_flight - t.in_flight >= slots - reserve
                if not full:
                    kv = t.kv_cache_usage
                    full = kv is not None and kv >= max_kv
        if full:
            if kept is None:
                kept = list(engines[:i])
        elif kept is not None:
            kept.append(e)
    return engines if kept is None else kept


#: Background requests an engine of unknown slot count takes per scrape (see :func:`background_room`).
PROBE_STEP = 2


def background_room(
    engine: LoadedEngine, reserve: int, max_kv_cache_usage: float, now: float | None = None
) -> int:
    """How many more background requests (batch lines) the engine takes now: the running slots it has free
    beyond ``reserve``, kept for interactive requests. vLLM does not preempt a running request for a more
    urgent one while slots (not KV blocks) run short, so a batch line holding the last slot makes the next
    interactive request wait for it to end; background work therefore only fills slots below the reserve.

    Nothing while the engine queues, its KV cache is past the saturation limit, or its figures are unknown
    (background work is not pushed to an engine the router knows nothing of). Until its slot count is known
    (``running_slots``: the most it ran at a scrape where others waited) an engine that does not queue takes
    :data:`PROBE_STEP` more per scrape, so an idle engine fills within a few scrapes and the first scrape that
    finds it queuing teaches the count."""
    t = fresh_telemetry(engine, now)
    if t is None or (t.kv_cache_usage is not None and t.kv_cache_usage >= max_kv_cache_usage):
        return 0
    waiting = _unclamped_estimate(t, engine)
    if waiting is not None and waiting > 0.0:
        return 0
    slots = engine.running_slots
    sent_since = engine.in_flight - t.in_flight  # sent (or finished, negative) since the scrape
    if slots is None:
        return max(0, PROBE_STEP - sent_since)
    return max(0, int(slots - reserve - (t.running + t.waiting + sent_since)))


class CompletionStats:
    """Per engine: smoothed TTFT and duration of finished requests, and how they ended."""

    __slots__ = ("completed", "failed", "ttft", "duration")

    def __init__(self) -> None:
        self.completed = 0
        self.failed = 0
        self.ttft: float | None = None  # seconds, streamed answers only
        self.duration: float | None = None  # seconds, successful answers

    def record(self, ok: bool, duration: float, ttft: float | None) -> None:
        if not ok:
            self.failed += 1
            return
        self.completed += 1
        self.duration = (
            duration if self.duration is None else self.duration + EWMA_ALPHA * (duration - self.duration)
        )
        if ttft is not None:
            self.ttft = ttft if self.ttft is None else self.ttft + EWMA_ALPHA * (ttft - self.ttft)

    def describe(self) -> dict[str, float | int | None]:
        return {
            "completed": self.completed,
            "failed": self.failed,
            "ttft_seconds": None if self.ttft is None else round(self.ttft, 6),
            "duration_seconds": None if self.duration is None else round(self.duration, 6),
        }
