"""What one attempt holds on one engine, booked and released in one place.

Sending a request to an engine books four things: a turn of its circuit breaker (the half-open
probe slot when the breaker is testing the engine), its in-flight count, the prompt tokens the
picker expects it to prefill (until the first token), and the in-flight gauge. They used to be
booked in two places (a request's leg, a disaggregated request's prefill leg) and undone in about
nine, each undo repeating the list; a counter added to one place and forgotten in another leaks
for ever. Here :class:`EngineBooking` books them when it is made and :meth:`EngineBooking.settle` is
the one release path: it tells the breaker how the attempt went and undoes the rest, at most once.
A new counter is one line in each of the two methods.
"""

from __future__ import annotations

from typing import Final

from vllm_stack.engines.engine import Engine
from vllm_stack.metrics import _Value

#: How an attempt ended, for the engine's circuit breaker:
SUCCESS: Final = "success"  # a complete answer below 500
FAILURE: Final = "failure"  # the engine failed (unreachable, broke its answer, 5xx, went silent)
RELEASED: Final = "released"  # says nothing of the engine (the client left, a 429, a plugin refused)


class EngineBooking:
    """An attempt's claim on ``engine``: booked on construction, released by :meth:`settle` once."""

    __slots__ = ("engine", "gauge", "prefill_tokens", "open")

    def __init__(self, engine: Engine, gauge: _Value, prefill_tokens: int = 0) -> None:
        self.engine = engine
        self.gauge = gauge  # the engine's in-flight gauge child (the caller's metrics)
        self.prefill_tokens = prefill_tokens  # still booked on engine.prefill_tokens
        self.open = True
        engine.breaker.acquire()
        engine.in_flight += 1
        if prefill_tokens:
            engine.prefill_tokens += prefill_tokens
        gauge.inc()

    def first_token(self) -> None:
        """The engine has prefilled the prompt (its first token is out): its prefill estimate is released."""
        tokens = self.prefill_tokens
        if tokens:
            self.prefill_tokens = 0
            self.engine.prefill_tokens -= tokens

    def settle(self, outcome: str) -> bool:
        """Release everything booked, the breaker told ``outcome`` (:data:`SUCCESS`, :data:`FAILURE`
        or :data:`RELEASED`); False, and nothing done, when it was already settled."""
        if not self.open:
            return False
        self.open = False
        engine = self.engine
        breaker = engine.breaker
        if outcome == SUCCESS:
            breaker.success()
        elif outcome == FAILURE:
            breaker.failure()
        else:
            breaker.release()
        engine.in_flight -= 1
        tokens = self.prefill_tokens
        if tokens:
            self.prefill_tokens = 0
            engine.prefill_tokens -= tokens
        self.gauge.dec()
        return True
