"""One batch line as a request of the director: its stages (admission, scheduling, the model's queue,
pre-request hooks) as any client request's, at sheddable priority, then sent to the picked engine and its
whole answer read.

The engine is booked from the pick to the answer's end, so the router's load figures, the queue and the
completion hooks (prefix index, usage) see a batch line as they see any request. The director's refusal
(a 429 when every engine is saturated: a sheddable request is not queued) reaches the runner as such, and
the line is sent again later. There are no retries here: the runner decides what a failure means.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

import aiohttp

from vllm_stack.director.stages import DirectedRequest
from vllm_stack.engines.booking import FAILURE, RELEASED, SUCCESS
from vllm_stack.errors import RouterError, error_body
from vllm_stack.relay.headers import header_fields
from vllm_stack.scheduling.framework import RequestContext

if TYPE_CHECKING:
    from vllm_stack.batch.store import ClaimedLine
    from vllm_stack.director.director import Director

log = logging.getLogger(__name__)

MAX_ANSWER_BYTES = 64 * 1024 * 1024  # an engine's answer to one line, at most (embeddings of long inputs)
ANSWER_END = 2048  # the answer's last bytes the completion hooks read (usage)


def send_failed() -> bytes:
    """The error line of a batch line that a fault of the router's kept from being sent (not retried)."""
    return error_body(
        500, "The router could not send this request; it was not retried.", code="line_send_failed"
    )


class LineListener(Protocol):
    """The runner that sent the line."""

    session: aiohttp.ClientSession

    def line_ended(self, request: BatchLineRequest, status: int, body: bytes, refused: bool) -> None:
        """The line's request is over: the engine's answer (``refused`` False; status 502 when it could
        not be reached), or the router's own refusal before any engine had it (``refused`` True)."""
        ...


class BatchLineRequest(DirectedRequest):
    """The director's stages for one batch line, then one POST to the engine."""

    __slots__ = ("listener", "line", "task", "answer")

    # a line refused or let go is sent again: its response-complete hooks run for the send that is answered
    COMPLETES_UNANSWERED = False

    def __init__(
        self, director: Director, ctx: RequestContext, listener: LineListener, line: ClaimedLine
    ) -> None:
        DirectedRequest.__init__(self, director, ctx, 1)
        self.listener = listener
        self.line = line
        self.task: asyncio.Task[None] | None = None
        self.answer: bytes | None = None  # the engine's whole answer, from its end until the runner has it

    def start(self) -> None:
        """Run the director's stages (the caller has registered the request: it may end before this
        returns, refused)."""
        self._begin()

    # ---- DirectedRequest ---------------------------------------------------------------------------------------
    def _send(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._post())

    def _answer(self, error: RouterError | None) -> None:
        """The runner is told how the line ended: the router's own refusal, or the engine's answer (a line
        let go, :meth:`abandon`, is the runner's own doing: nothing to tell)."""
        if error is not None:
            self.listener.line_ended(self, error.status, error.body(), True)
        elif self.answer is not None:
            answer, self.answer = self.answer, None
            self.listener.line_ended(self, int(self.status), answer, False)

    def _accounted(self, engine_name: str, duration: float, answer_end: bytes | None) -> None:
        if self.director.settings.access_log:
            log.info(
                "batch line %s -> %s %s %.1f ms",
                self.ctx.path,
                self.status,
                engine_name,
                duration * 1e3,
                extra=self.ctx.log_fields(),
            )

    def check_timeout(self, now: float) -> None:
        """The runner's sweep: waiting on a stage past the request timeout is answered 504 (the engine's
        own answer is bounded by the POST's timeout)."""
        if not self.done:
            self.stage_timed_out(now, self.director.settings.request_timeout)

    def abandon(self) -> None:
        """The line's batch ended (cancelled, expired) or the router stops: the request goes, unanswered."""
        if self.done:
            return
        task = self.task
        if task is not None and not task.done():
            task.cancel()
        self._end("client_closed", RELEASED)

    # ---- the engine's answer ----------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        ctx = self.ctx
        headers = {"content-type": "application/json", "x-request-id": ctx.request_id.decode("latin-1")}
        key = self.director.settings.engine_auth
        engine = self.engine
        if engine is not None and engine.head_lines:  # an external provider: its own key, not the engines'
            key = None
            for name, value in header_fields(engine.head_lines):
                headers[name.decode("latin-1")] = value.decode("latin-1")
        if key:
            headers["authorization"] = key.decode("latin-1")
        for name, value in header_fields(ctx.upstream_headers):  # a pre-request plugin's header lines
            headers[name.decode("latin-1")] = value.decode("latin-1")
        return headers

    async def _post(self) -> None:
        engine = self.engine
        assert engine is not None
        ctx = self.ctx
        timeout = aiohttp.ClientTimeout(total=self.director.settings.request_timeout)
        try:
            async with self.listener.session.post(
                engine.url + ctx.path, data=ctx.body, headers=self._headers(), timeout=timeout
            ) as response:
                self.first_token()  # the answer's head: the prompt is prefilled
                body = await response.content.read(MAX_ANSWER_BYTES + 1)
                status = response.status
            if len(body) > MAX_ANSWER_BYTES:
                status, body = (
                    502,
                    error_body(
                        502, "The engine's answer passed the batch line limit.", code="answer_too_large"
                    ),
                )
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            status, body = (
                502,
                error_body(
                    502, f"The engine did not answer: {type(exc).__name__}: {exc}", code="upstream_error"
                ),
            )
        except Exception:  # a fault of the router's: this line fails, nothing else does
            log.exception("batch line %s: sending it failed", ctx.request_id.decode("latin-1"))
            status, body = 500, send_failed()
        self._answered(status, body)

    def _answered(self, status: int, body: bytes) -> None:
        if self.done:
            return
        self.answer = body
        self._end(str(status), FAILURE if status >= 500 else SUCCESS, body[-ANSWER_END:])
