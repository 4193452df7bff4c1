"""Per-engine circuit breaker: stop sending requests to an engine that keeps failing.

Closed (normal) -> open after ``failure_threshold`` consecutive failures -> after ``open_seconds`` one
request is let through as a probe (half-open) -> its success closes the breaker, its failure re-opens it.
Active health checks cannot see an engine that answers ``/health`` but fails real requests; this can.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import IntEnum


class BreakerState(IntEnum):
    """Values match the ``vllm_stack_router_circuit_breaker_state`` gauge."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


class CircuitBreaker:
    __slots__ = (
        "failure_threshold",
        "open_seconds",
        "state",
        "_failures",
        "_opened_at",
        "_probing",
        "_on_change",
        "_clock",
    )

    def __init__(
        self,
        failure_threshold: int = 5,
        open_seconds: float = 10.0,
        on_change: Callable[[BreakerState], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.open_seconds = open_seconds
        self.state = BreakerState.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False
        self._on_change = on_change
        self._clock = clock

    def available(self) -> bool:
        """May a request be sent now? (No side effect: the scheduler calls this on every candidate.)"""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return self._clock() - self._opened_at >= self.open_seconds
        return not self._probing

    def acquire(self) -> None:
        """Called when a request is actually sent: an open breaker past its cool-down becomes half-open."""
        if self.state is BreakerState.CLOSED:
            return
        if self.state is BreakerState.OPEN:
            self._set(BreakerState.HALF_OPEN)
        self._probing = True

    def success(self) -> None:
        self._failures = 0
        self._probing = False
        if self.state is not BreakerState.CLOSED:
            self._set(BreakerState.CLOSED)

    def failure(self) -> None:
        self._failures += 1
        self._probing = False
        if self.state is BreakerState.HALF_OPEN or (
            self.state is BreakerState.CLOSED and self._failures >= self.failure_threshold
        ):
            self._opened_at = self._clock()
            self._set(BreakerState.OPEN)

    def trip(self) -> None:
        """Open now, whatever the count: the engine stopped answering even its metrics (a hang).
        Each call restarts the cool-down, so it stays open while the hang lasts."""
        self._opened_at = self._clock()
        self._probing = False
        if self.state is not BreakerState.OPEN:
            self._set(BreakerState.OPEN)

    def release(self) -> None:
        """The request ended without telling anything about the engine (e.g. the client went away)."""
        self._probing = False

    def _set(self, state: BreakerState) -> None:
        self.state = state
        if self._on_change is not None:
            self._on_change(state)
