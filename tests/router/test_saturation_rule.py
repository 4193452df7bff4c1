"""The one saturation rule (vllm_stack.engines.load): thresholds, the queue estimate between scrapes,
and stale figures, on the router's own Engine objects (no HTTP: the figures are set as a scrape would)."""

from __future__ import annotations

import time

from vllm_stack.engines.circuit import CircuitBreaker
from vllm_stack.engines.engine import Engine, EngineTelemetry
from vllm_stack.engines.load import SaturationLimits, queue_estimate, saturated, unsaturated

LIMITS = SaturationLimits()  # 5 waiting, KV 0.8


def engine(
    name: str, waiting: float, kv: float | None, in_flight_at_scrape: int = 0, age: float = 0.0
) -> Engine:
    e = Engine(name, f"http://{name}", CircuitBreaker(), stale_after=3.0)
    e.in_flight = in_flight_at_scrape
    e.telemetry = EngineTelemetry(
        running=4, waiting=waiting, kv_cache_usage=kv, prefix_cache_queries=None, prefix_cache_hits=None,
        scraped_at=time.monotonic() - age, in_flight=in_flight_at_scrape,
    )  # fmt: skip
    return e


def test_the_thresholds() -> None:
    assert not saturated(engine("a", 4, 0.79), LIMITS)
    assert saturated(engine("a", 5, 0.1), LIMITS)
    assert saturated(engine("a", 0, 0.8), LIMITS)
    assert not saturated(engine("a", 0, None), LIMITS)  # no KV figure: the queue alone decides
    assert saturated(engine("a", 2, 0.1), SaturationLimits(max_waiting=2))


def test_the_queue_estimate_moves_with_the_routers_own_requests_while_the_engine_queues() -> None:
    e = engine("a", 5, 0.1, in_flight_at_scrape=3)
    assert saturated(e, LIMITS)
    e.in_flight = 2  # one of the router's requests there ended since the scrape: one waiting one runs
    assert queue_estimate(e) == 4 and not saturated(e, LIMITS)
    e.in_flight = 3  # and the router sent one more
    assert saturated(e, LIMITS)
    idle = engine("b", 0, 0.1, in_flight_at_scrape=0)
    idle.in_flight = 40  # a burst on an engine that was not queuing is not held back by a guess
    assert queue_estimate(idle) == 0 and not saturated(idle, LIMITS)


def test_an_engine_seen_full_before_counts_what_went_past_its_free_slots_while_not_queuing() -> None:
    """A scrape can catch a saturated engine with an empty queue for a moment; had the estimate stayed 0
    until the next scrape, the router's whole queue would have gone there at once (measured: critical
    p99 of 20 s at 2x load, for as long as that backlog took to drain)."""
    e = engine("a", 0, 0.1, in_flight_at_scrape=3)  # running 4, nothing waiting
    e.running_slots = 6  # seen running 6 while others waited: 2 slots free at this scrape
    e.in_flight = 3 + 2
    assert queue_estimate(e) == 0 and not saturated(e, LIMITS)  # the two free slots taken
    e.in_flight = 3 + 2 + 4
    assert queue_estimate(e) == 4 and not saturated(e, LIMITS)
    e.in_flight = 3 + 2 + 5  # five past the free slots wait: the limit
    assert queue_estimate(e) == 5 and saturated(e, LIMITS)
    e.in_flight = 1  # more ended than were sent: slots free, no queue
    assert queue_estimate(e) == 0 and not saturated(e, LIMITS)


def test_stale_figures_are_not_saturated_so_an_outage_holds_nothing_back() -> None:
    stale = engine("a", 50, 0.99, age=10.0)
    assert not saturated(stale, LIMITS) and queue_estimate(stale) is None
    never = Engine("n", "http://n", CircuitBreaker())
    assert not saturated(never, LIMITS)


def test_unsaturated_keeps_order_and_returns_the_same_sequence_when_none_is_full() -> None:
    a, b, c = engine("a", 0, 0.1), engine("b", 9, 0.1), engine("c", 1, 0.2)
    engines = (a, b, c)
    assert list(unsaturated(engines, LIMITS)) == [a, c]
    assert unsaturated((a, c), LIMITS) == (a, c)
    assert list(unsaturated((b,), LIMITS)) == []


def test_critical_headroom_keeps_slots_free_once_the_engines_slot_count_is_known() -> None:
    reserve = SaturationLimits(reserve_slots=1)
    e = engine("a", 0, 0.1)  # running 4, nothing waiting
    assert not saturated(e, reserve)  # slot count unknown: the plain rule
    e.running_slots = 6
    assert not saturated(e, reserve)  # 4 there, 5 allowed (6 slots less 1)
    e.in_flight = 1  # the router sent one more since the scrape: 5 there
    assert saturated(e, reserve)
    e.in_flight = 0
    assert not saturated(e, LIMITS)  # no reserve: no headroom rule


def test_background_work_fills_only_the_slots_beyond_the_reserve() -> None:
    """Batch lines (vllm_stack.batch) take an engine's free running slots less a reserve left to
    interactive requests: vLLM does not preempt a running line for them while slots run short."""
    from vllm_stack.engines.load import PROBE_STEP, background_room

    e = engine("a", 0, 0.1, in_flight_at_scrape=2)  # running 4, nothing waiting
    e.running_slots = 8
    assert background_room(e, 1, 0.8) == 8 - 1 - 4  # 3 slots beyond the reserve
    e.in_flight = 2 + 3  # the router sent 3 since the scrape
    assert background_room(e, 1, 0.8) == 0
    e.in_flight = 1  # one ended since: a slot more
    assert background_room(e, 1, 0.8) == 4 and background_room(e, 4, 0.8) == 1
    assert background_room(engine("b", 1, 0.1), 0, 0.8) == 0  # it queues: nothing
    assert background_room(engine("c", 0, 0.85), 0, 0.8) == 0  # its KV cache is full enough
    assert background_room(engine("d", 0, 0.1, age=10.0), 0, 0.8) == 0  # figures unknown: nothing
    unknown = engine("e", 0, 0.1, in_flight_at_scrape=1)  # slot count not learned yet
    assert background_room(unknown, 1, 0.8) == PROBE_STEP  # a few more per scrape, until it queues
    unknown.in_flight = 1 + PROBE_STEP
    assert background_room(unknown, 1, 0.8) == 0
