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
import time
from typing import TYPE_CHECKING, Protocol

import aiohttp

from vllm_stack.director.stages import DirectedRequest
from vllm_stack.engines.booking import FAILURE, RELEASED, SUCCESS
from vllm_stack.errors import RouterError, error_body
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

    __slots__ = ("listener", "line", "task")

    def __init__(
        self, director: Director, ctx: RequestContext, listener: LineListener, line: ClaimedLine
    ) -> None:
        DirectedRequest.__init__(self, director, ctx, 1)
        self.listener = listener
        self.line = line
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run the director's stages (the caller has registered the request: it may end before this
        returns, refused)."""
        self._begin()

    # ---- DirectedRequest ---------------------------------------------------------------------------------------
    def _send(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._post())

    def _fail(self, error: RouterError) -> None:
        if self.done:
            return
        self.done = True
        self.status = str(error.status)
        self._account(None)
        self.listener.line_ended(self, error.status, error.body(), True)

    def check_timeout(self, now: float) -> None:
        """The runner's sweep: waiting on a stage past the request timeout is answered 504 (the engine's
        own answer is bounded by the POST's timeout)."""
        if not self.done:
            self.stage_timed_out(now, self.director.settings.request_timeout)

    def abandon(self) -> None:
        """The line's batch ended (cancelled, expired) or the router stops: the request goes, unanswered."""
        if self.done:
            return
        self.done = True
        self.status = "client_closed"
        self._leave_stages()
        task = self.task
        if task is not None and not task.done():
            task.cancel()
        self._settle(RELEASED)
        self._account(None)

    # ---- the engine's answer ----------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        ctx = self.ctx
        headers = {"content-type": "application/json", "x-request-id": ctx.request_id.decode("latin-1")}
        key = self.director.settings.engine_auth
        if key:
            headers["authorization"] = key.decode("latin-1")
        for line in ctx.upstream_headers.split(b"\r\n"):  # a pre-request plugin's header lines
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.strip().decode("latin-1")] = value.strip().decode("latin-1")
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
        self.done = True
        self.status = str(status)
        self._settle(FAILURE if status >= 500 else SUCCESS)
        self._account(body[-ANSWER_END:])
        self.listener.line_ended(self, status, body, False)

    def _account(self, answer_end: bytes | None) -> None:
        director = self.director
        ctx = self.ctx
        duration = ctx.duration = time.perf_counter() - ctx.arrived
        director.metrics.observe_request(ctx.model_label, self.engine_name(), self.status, duration)
        if director.settings.access_log:
            log.info(
                "batch line %s -> %s %s %.1f ms", ctx.path, self.status, self.engine_name(), duration * 1e3
            )
        if answer_end is not None and director.hooks.response_complete:
            self._run_completion_hooks(duration, answer_end)
