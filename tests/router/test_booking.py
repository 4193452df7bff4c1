"""An attempt's books on its engine: booked once, released once, the breaker told how it went.

The request path's tests check that the books are back to zero after each way a request ends
(tests/router/test_director.py, test_disagg.py, test_failover.py); these check the one object they
all go through.
"""

from __future__ import annotations

from vllm_stack.engines.booking import FAILURE, RELEASED, SUCCESS, EngineBooking
from vllm_stack.engines.circuit import BreakerState, CircuitBreaker
from vllm_stack.engines.engine import Engine
from vllm_stack.metrics import RouterMetrics


def _engine(threshold: int = 2) -> Engine:
    clock = [0.0]
    engine = Engine("e", "http://10.0.0.1:8000", CircuitBreaker(threshold, 10.0, clock=lambda: clock[0]))
    engine.healthy = True
    return engine


def _gauge(metrics: RouterMetrics) -> float:
    return metrics.in_flight_child("e").value


def test_booking_books_everything_and_settling_releases_it_once() -> None:
    engine, metrics = _engine(), RouterMetrics()
    booking = EngineBooking(engine, metrics.in_flight_child("e"), prefill_tokens=300)
    second = EngineBooking(engine, metrics.in_flight_child("e"), prefill_tokens=0)
    assert (engine.in_flight, engine.prefill_tokens, _gauge(metrics)) == (2, 300, 2)
    assert booking.settle(SUCCESS) is True
    assert booking.settle(FAILURE) is False  # a second way out changes nothing
    assert (engine.in_flight, engine.prefill_tokens, _gauge(metrics)) == (1, 0, 1)
    assert engine.breaker.state is BreakerState.CLOSED
    second.settle(RELEASED)
    assert (engine.in_flight, engine.prefill_tokens, _gauge(metrics)) == (0, 0, 0)


def test_the_first_token_releases_the_prefill_estimate_once() -> None:
    engine, metrics = _engine(), RouterMetrics()
    booking = EngineBooking(engine, metrics.in_flight_child("e"), prefill_tokens=120)
    booking.first_token()
    booking.first_token()
    assert (engine.in_flight, engine.prefill_tokens) == (1, 0)
    booking.settle(SUCCESS)
    assert (engine.in_flight, engine.prefill_tokens) == (0, 0)


def test_the_outcome_is_what_the_breaker_hears() -> None:
    """Two failures open a breaker of threshold 2; a success between them resets the count; a
    release counts neither way."""
    engine, metrics = _engine(threshold=2), RouterMetrics()
    gauge = metrics.in_flight_child("e")
    EngineBooking(engine, gauge).settle(FAILURE)
    EngineBooking(engine, gauge).settle(SUCCESS)
    EngineBooking(engine, gauge).settle(FAILURE)
    EngineBooking(engine, gauge).settle(RELEASED)
    assert engine.breaker.state is BreakerState.CLOSED
    EngineBooking(engine, gauge).settle(FAILURE)
    assert engine.breaker.state is BreakerState.OPEN
    assert engine.in_flight == 0 and _gauge(metrics) == 0
