"""One gateway request as the endpoint picker sees it: the director's stages, then the engine named to
the gateway instead of relayed to, and its answer watched as it passes back through the picker.

The engine is booked (in-flight count, prefill estimate, breaker turn) from the pick until the gateway's
stream reports the answer's end, so the router's own load figures, the queue and the completion hooks
(prefill release, usage, request tracker) see a picked request as they see a relayed one. There are no
retries here: a gateway that cannot reach the engine retries on the fallback endpoints it was given.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

from vllm_stack.director.stages import DirectedRequest
from vllm_stack.engines.booking import FAILURE, RELEASED, SUCCESS, EngineBooking
from vllm_stack.engines.engine import Engine
from vllm_stack.errors import RouterError
from vllm_stack.scheduling.framework import RequestContext

if TYPE_CHECKING:
    from vllm_stack.director.director import Director

log = logging.getLogger(__name__)


class PickListener(Protocol):
    """The stream the request was picked for (:class:`~vllm_stack.epp.stream.Exchange`)."""

    def picked(self, request: PickedRequest) -> None:
        """The engine is booked and every pre-request hook ran: tell the gateway."""
        ...

    def refused(self, error: RouterError) -> None:
        """No engine (shed, none healthy, queue timeout, a plugin's refusal): tell the gateway."""
        ...


class PickedRequest(DirectedRequest):
    """The director's stages for a request whose bytes the gateway relays."""

    __slots__ = ("listener", "answer_end")

    def __init__(self, director: Director, ctx: RequestContext, listener: PickListener) -> None:
        DirectedRequest.__init__(self, director, ctx, 1)
        self.listener = listener
        self.answer_end: bytes | None = None
        self._begin()

    def _send(self) -> None:
        self.listener.picked(self)

    def _fail(self, error: RouterError) -> None:
        if self.done:
            return
        self.done = True
        self.status = str(error.status)
        self.listener.refused(error)
        self._account()

    def first_byte(self) -> None:
        """The answer's first body bytes went by: its TTFT, and the prefill estimate released."""
        if self.ctx.ttft is None:
            self.ctx.ttft = time.perf_counter() - self.ctx.arrived
            self.director.metrics.observe_ttft(self.ctx.model_label, self.ctx.ttft)
            self.first_token()

    def served_by(self, engine: Engine) -> None:
        """The gateway reports another engine served it (a fallback): the books move there."""
        if self.done or self.booking is None or engine is self.engine:
            return
        self._settle(RELEASED)  # the pick's engine: its in-flight count and breaker turn given back
        self.engine = engine
        self.booking = EngineBooking(engine, self.director.metrics.in_flight_child(engine.name), 0)

    def answered(self, status: int, answer_end: bytes) -> None:
        """The answer ended (its last body bytes, or trailers, went by)."""
        if self.done:
            return
        self.done = True
        self.status = str(status)
        self.answer_end = answer_end
        self._settle(FAILURE if status >= 500 else SUCCESS)
        self._account()

    def lost(self, status: str = "client_closed") -> None:
        """The gateway's stream ended before the answer did (the client left, or the gateway gave up),
        or it sent nothing of the answer for the picker's answer timeout (``answer_timeout``): the books
        must not wait for an end that may never come."""
        if self.done:
            return
        self.done = True
        self.status = status
        self._leave_stages()
        self._settle(RELEASED)
        self._account()

    def check_timeout(self, now: float) -> None:
        """The picker's sweep: a request waiting in the queue or on a stage past its timeout is refused.
        Once picked, the engine's silence is the gateway's to time out."""
        if not self.done:
            self.stage_timed_out(now, self.director.settings.request_timeout)

    def _account(self) -> None:
        director = self.director
        ctx = self.ctx
        duration = ctx.duration = time.perf_counter() - ctx.arrived
        engine_name = self.engine_name()
        director.metrics.observe_request(ctx.model_label, engine_name, self.status, duration)
        if director.settings.access_log:
            log.info("pick %s -> %s %s %.1f ms", ctx.path, self.status, engine_name, duration * 1e3)
        if director.hooks.response_complete:
            self._run_completion_hooks(duration, self.answer_end)
