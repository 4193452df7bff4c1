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

    __slots__ = ("listener",)

    def __init__(self, director: Director, ctx: RequestContext, listener: PickListener) -> None:
        DirectedRequest.__init__(self, director, ctx, 1)
        self.listener = listener
        self._begin()

    def _send(self) -> None:
        self.listener.picked(self)

    def _answer(self, error: RouterError | None) -> None:
        if error is not None:
            self.listener.refused(error)

    def _accounted(self, engine_name: str, duration: float, answer_end: bytes | None) -> None:
        if self.director.settings.access_log:
            log.info(
                "pick %s -> %s %s %.1f ms",
                self.ctx.path,
                self.status,
                engine_name,
                duration * 1e3,
                extra=self.ctx.log_fields(),
            )

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
        self._end(str(status), FAILURE if status >= 500 else SUCCESS, answer_end)

    def lost(self, status: str = "client_closed") -> None:
        """The gateway's stream ended before the answer did (the client left, or the gateway gave up),
        or it sent nothing of the answer for the picker's answer timeout (``answer_timeout``): the books
        must not wait for an end that may never come."""
        self._end(status, RELEASED)

    def check_timeout(self, now: float) -> None:
        """The picker's sweep: a request waiting in the queue or on a stage past its timeout is refused.
        Once picked, the engine's silence is the gateway's to time out."""
        if not self.done:
            self.stage_timed_out(now, self.director.settings.request_timeout)
