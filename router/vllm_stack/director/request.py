"""One proxied request: the director's stages (:mod:`.stages`), then relay legs to the engine.

admit -> prepare -> schedule -> pre-request -> relay leg; on a failure before anything reached the
client, schedule again (the engines tried are excluded) and run another leg, up to ``retries`` more.
For a model with prefill engines, the first scheduling is preceded by the prefill stage
(:mod:`.prefill_stage`): a prefill leg elsewhere, whose hand-over the decode leg carries.
When scheduling finds every engine saturated (or a configured model has none ready), the request
waits in its model's queue (:mod:`.queue`) and is scheduled again from there; a sheddable one is
answered 429 instead. A client that leaves during any stage ends the request: the awaitable the stage
is waiting on is cancelled, the leg's connection is closed (the engine aborts the request), and the
engine's books are settled.

Breaker accounting lives here, not in the relay (a leg only reports how its exchange ended):
- ``connect_error``: the engine could not be reached; it is ejected until healthy again;
- ``upstream_broken``: it began an answer and broke it; the breaker counts a failure;
- ``upstream_closed``: it took the request and closed without a byte of answer. That is what one
  poison request does on every engine, so it counts against the request, not the engine: no
  ejection, no breaker failure (an engine that really died refuses the next connect);
- a 5xx answer counts a failure, a 429 does not; a complete answer below 500 a success.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import TYPE_CHECKING, Any

import orjson

from vllm_stack.director.continuation import PATHS as CONTINUABLE_PATHS
from vllm_stack.director.continuation import Continuation
from vllm_stack.director.eviction import DROPPED_REASON, EVICTED
from vllm_stack.director.prefill_stage import PrefillStage
from vllm_stack.director.stages import DirectedRequest, route_header
from vllm_stack.engines.booking import FAILURE, RELEASED, SUCCESS
from vllm_stack.engines.engine import Engine
from vllm_stack.engines.external import ENGINE_PREFIX
from vllm_stack.errors import RouterError, sse_error_event
from vllm_stack.relay.continued_leg import ContinuedLeg, end_client_stream
from vllm_stack.relay.headers import HOP_BY_HOP
from vllm_stack.relay.leg import KEEP_LIMIT, Leg
from vllm_stack.relay.transcript import NotContinuable
from vllm_stack.scheduling.framework import RequestContext
from vllm_stack.server.http1 import HttpConnection, HttpRequest

if TYPE_CHECKING:
    from vllm_stack.director.director import Director
    from vllm_stack.director.endpoint_picker import PickAnswer

__all__ = ["ProxiedRequest", "route_header"]

log = logging.getLogger(__name__)

#: Seconds a kept stream may stay silent once its engine is no longer a candidate (it left discovery, or
#: was found unhealthy) before it is continued elsewhere: vLLM stopped with SIGTERM leaves its streams
#: open and silent until its process exits (a pod's grace period later).
STALLED_AFTER = 2.0


class Pick(enum.Enum):
    """Gateway mode: where the request stands with the endpoint picker (:meth:`ProxiedRequest._ask_picker`)."""

    UNASKED = "unasked"  # the next attempt asks it (or, after its refusal, nothing is asked again)
    ASKING = "asking"  # its answer is awaited
    PICKED = "picked"  # it named engines (``ProxiedRequest.picked``): a retry takes its fallbacks
    LOCAL = "local"  # it failed and fails open: every attempt is scheduled here


class ProxiedRequest(DirectedRequest):
    """The state of one proxied request; the client connection's handler while it runs."""

    __slots__ = (
        "conn",
        "request",
        "tail",
        "provider_tail",
        "leg",
        "pick",
        "picked",
        "disagg_pending",
        "pd",
        "evictable",
        "continuing",
    )

    def __init__(
        self,
        director: Director,
        conn: HttpConnection,
        request: HttpRequest,
        ctx: RequestContext,
        tail: bytes,
        provider_tail: bytes | None = None,
    ) -> None:
        DirectedRequest.__init__(self, director, ctx, 1 + director.settings.retries)
        self.conn = conn
        self.request = request
        self.tail = tail  # request headers, framing and body as sent upstream (same for every leg)
        # a model an external provider serves: what a provider's leg sends instead (no engine key, the
        # provider's own model id for an alias); ``tail`` is then a local engine's (None: no provider)
        self.provider_tail = provider_tail
        self.leg: Leg | None = None
        self.pick = Pick.UNASKED  # gateway mode only
        self.picked: PickAnswer | None = None  # the endpoint picker's answer, told the request's end
        # Disaggregated prefill (.disagg): decided at the first scheduling, for models with prefill engines
        disagg = director.settings.disagg
        self.disagg_pending = disagg is not None and ctx.path in disagg.paths
        self.pd: PrefillStage | None = None  # while its prefill stage runs
        self.evictable = False  # tracked by the director's evictor (sheddable, eviction on)
        self.continuing: Continuation | None = None  # its stream broke and goes on elsewhere (.continuation)
        # Constructing the request starts it (as asyncio's tasks start): one call less per request.
        conn.handler = self
        tracer = director.tracer
        if tracer is not None:
            ctx.trace = tracer.begin(
                request.method,
                ctx.path,
                request.headers,
                ctx.arrived,
                ctx.model,
                ctx.request_id,
                ctx.priority,
            )
            ctx.keep_answer_end = True  # the usage (token counts) of the answer, for the server span
        self._begin()

    def _attempt(self) -> None:
        """An attempt of the relayed kind: in gateway mode the endpoint picker decides it; the first one
        of a request with a prefill stage runs that stage; otherwise (and after them) the director's."""
        if self.attempts_left > 0:
            if self.director.endpoint_picker is not None and self._ask_picker():
                return
            if self.disagg_pending:
                self.disagg_pending = False
                if PrefillStage.begin(self):
                    return
        DirectedRequest._attempt(self)

    # ---- gateway mode (.endpoint_picker) --------------------------------------------------------------
    def _ask_picker(self) -> bool:
        """True when the endpoint picker decides this attempt (it was asked, or its fallback was
        taken), False to schedule here."""
        pick = self.pick
        if pick is Pick.LOCAL:
            return False
        picker = self.director.endpoint_picker
        assert picker is not None
        ctx = self.ctx
        if pick is Pick.UNASKED:  # the first attempt: ask
            self.pick = Pick.ASKING
            ctx.keep_answer_end = True  # the usage, for the picker's view of the answer's end
            request = self.request
            authority = next((v for k, v in request.headers if k == b"host"), b"")
            subset = [
                e.address for e in self.director.registry.candidates(ctx.pool or ctx.model) if e.routable()
            ]
            future = self.waiting = asyncio.ensure_future(
                picker.ask(
                    request.method,
                    request.target,
                    authority,
                    request.headers,
                    ctx.request_id,
                    ctx.body,
                    subset,
                )
            )
            future.add_done_callback(self._picked)
            return True
        # a retry: the picker's fallbacks, in its order
        picked = self.picked
        if pick is Pick.PICKED and picked is not None and self._start_listed(picked.endpoints):
            return True
        self._fail(self.last_error or RouterError(502, "No engine answered.", code="upstream_error"))
        return True

    def _picked(self, future: asyncio.Future[Any]) -> None:
        from vllm_stack.director.endpoint_picker import IMMEDIATE, PICKED

        picker = self.director.endpoint_picker
        assert picker is not None
        if future is not self.waiting or self.done:  # the client left
            if not future.cancelled() and future.exception() is None:
                picker.abandon(future.result())
            return
        self.waiting = None
        answer = future.result()  # (ask never raises)
        ctx = self.ctx
        if answer.kind == IMMEDIATE:
            self.pick = Pick.UNASKED
            self._fail(_picker_refusal(answer.status, answer.body, answer.headers))
            return
        if answer.kind == PICKED:
            self.pick, self.picked = Pick.PICKED, answer
            if answer.body and answer.body != ctx.body:
                self._rebody(answer.body)
            ctx.profile, ctx.reason = "endpoint-picker", "picked"
            if self._start_listed(answer.endpoints):
                return
            self.picked = None
            picker.abandon(answer)
            outcome = "unknown_endpoint"
            log.warning(
                "the endpoint picker named no engine of this router (%s; %s)", answer.endpoints, ctx.log_ref()
            )
        else:
            outcome = answer.outcome
        picker.failed(outcome)
        if picker.fail_open:
            self.pick = Pick.LOCAL
            self._attempt()
        else:
            self.pick = Pick.UNASKED
            self._fail(
                RouterError(
                    503,
                    "The endpoint picker gave no engine; try again shortly.",
                    code="endpoint_picker_unavailable",
                    headers=[(b"retry-after", b"1")],
                )
            )

    def _start_listed(self, endpoints: list[str]) -> bool:
        """Start an attempt on the first usable engine of ``endpoints`` (taken off the list)."""
        registry = self.director.registry
        ctx = self.ctx
        while endpoints:
            engine = registry.candidate_at(ctx.pool or ctx.model, endpoints.pop(0))
            if (
                engine is not None
                and engine.name not in ctx.excluded
                and engine.routable()
                and engine.breaker.available()
            ):
                if self.director.settings.debug_headers:
                    self._note_route(engine)
                self._start(engine)
                return True
        return False

    def _rebody(self, body: bytes) -> None:
        """The picker changed the body (e.g. the model's name): the legs send its version."""
        ctx = self.ctx
        head = self.tail[: len(self.tail) - len(ctx.body)]
        head = head[: head.rfind(b"content-length: ")]
        framing = b"content-length: %d\r\n\r\n" % len(body)
        self.tail = head + framing + body
        ctx.body = body
        if self.provider_tail is not None:  # the picker's body for a provider's leg too, without the key
            key = self.director.settings.engine_auth
            line = b"authorization: " + key + b"\r\n" if key else b""
            self.provider_tail = (
                (head[: -len(line)] if line and head.endswith(line) else head) + framing + body
            )

    # ---- disaggregated prefill (.prefill_stage) -------------------------------------------------------
    def resume_after_prefill(self, engine: Engine | None) -> None:
        """The prefill stage is over (done, skipped or failed): decode on ``engine`` (the one the KV
        was sent to, when it can still take the request), else schedule as for any request."""
        self.pd = None
        if engine is not None and engine.routable() and engine.breaker.available():
            ctx = self.ctx
            ctx.profile, ctx.reason = "prefill", "disaggregated"
            if self.director.settings.debug_headers:
                self._note_route(engine)
            self._start(engine)
        else:
            self._attempt()

    def schedule_decode(self) -> Engine | None:
        """The decode engine, chosen before the prefill leg (lmcache: the prefill request names it)."""
        return self._schedule().engine

    def start_decode(self, engine: Engine) -> None:
        """Decode-only on the engine :meth:`schedule_decode` chose (the decider said no prefill leg)."""
        if self.director.settings.debug_headers:
            self._note_route(engine)
        self._start(engine)

    def _send(self) -> None:
        engine = self.engine
        assert engine is not None
        director = self.director
        pool = director.pools.get(engine.url)
        request = self.request
        line = b"%s %s%s HTTP/1.1\r\nhost: %s\r\n%s" % (
            request.method.encode(),
            pool.path_prefix,
            request.target,
            pool.host_header,
            engine.head_lines,  # an external provider's key (b"" for an engine of the stack)
        )
        ctx = self.ctx
        trace = ctx.trace
        if trace is not None:  # the leg's span, sent as its traceparent (the engine's spans join it)
            line += trace.leg_begin("upstream", engine.name, pool.host_header.decode("latin-1"))
        tail = self.tail
        if self.provider_tail is not None and engine.name.startswith(ENGINE_PREFIX):
            tail = self.provider_tail  # a provider's leg: its key (head_lines), never the engines'
        continuing = self.continuing
        if continuing is None:
            leg = self.leg = Leg(
                self, self.conn, request, pool, director.metrics, line + ctx.upstream_headers + tail
            )
        else:
            leg = self.leg = self._continued_leg(continuing, pool, line + ctx.upstream_headers + tail)
        if ctx.keep_answer_end:
            leg.answer_end = b""  # before any read: none is handled before this returns
        if ctx.priority < 0 and director.settings.eviction_after is not None:
            self.evictable = True
            director.evictor.track(ctx.pool or ctx.model, self)

    # ---- what the leg reports ----------------------------------------------------------------------------
    def retry_on_status(self, leg: Leg, status: int) -> bool:
        """A 429/5xx before anything was forwarded: retry on another engine when one is left. A 404
        for a registered adapter the router believed loaded there: the engine lost it (a restart,
        another router replica's unload), so it is forgotten there and the request scheduled again,
        which loads it; any other 404 is the answer."""
        if self.attempts_left <= 0:
            return False
        engine = self.engine
        assert engine is not None
        if status == 404:
            adapter = self.ctx.adapter
            if adapter is None or adapter.name not in engine.models:
                return False
            self.director.registry.forget_adapter(engine, adapter.name)
            leg.abort()
            self.leg = None
            self._settle(RELEASED)
            if self.ctx.trace is not None:
                self.ctx.trace.leg_end(status, "adapter_missing")
            self.director.metrics.retry(self.ctx.model, "adapter_missing")
            self._attempt()
            return True
        self.ctx.exclude(engine.name)
        if not self._other_candidate():
            return False
        leg.abort()
        self.leg = None
        self._settle(FAILURE if status >= 500 else RELEASED)
        if self.ctx.trace is not None:
            self.ctx.trace.leg_end(status, f"retried after {status}")
        self.director.metrics.retry(self.ctx.model, str(status))
        self._attempt()
        return True

    def leg_failed(self, leg: Leg, message: str, reason: str) -> None:
        """Nothing reached the client: count the failure as ``reason`` says and try another engine."""
        engine = self.engine
        assert engine is not None
        self.leg = None
        if reason == "connect_error":
            self.director.registry.eject(engine, reason)  # before the queue is kicked by the release
            self.last_error = RouterError(502, message, code="upstream_unreachable")
        elif reason == "upstream_closed":
            self.last_error = RouterError(502, message, code="upstream_closed")
        else:
            self.last_error = RouterError(502, message, code="upstream_broken")
        self._settle(RELEASED if reason == "upstream_closed" else FAILURE)
        if self.ctx.trace is not None:
            self.ctx.trace.leg_end(0, reason)
        self.ctx.exclude(engine.name)
        self.status = "upstream_error"
        if self.attempts_left > 0:
            self.director.metrics.retry(self.ctx.model, reason)
        self._attempt()

    def leg_complete(self, leg: Leg) -> None:
        status = leg.status
        ctx = self.ctx
        ctx.ttft = leg.ttft
        if self.continuing is not None:
            self._continued_stream_complete()
        if ctx.trace is not None:
            ctx.trace.leg_end(status, stream=leg.sse)
        self._end(str(status), FAILURE if status >= 500 else SUCCESS, leg.answer_end)

    def leg_broken(self, leg: Leg, error: BaseException | str) -> None:
        ctx = self.ctx
        ctx.ttft = leg.ttft
        if ctx.trace is not None:
            ctx.trace.leg_end(leg.status, f"broken: {error}", stream=leg.sse)
        self._end("upstream_error", FAILURE)

    # ---- a stream that survives its engine (.continuation) ------------------------------------------------
    def keeps_stream(self) -> bool:
        return (
            self.director.settings.stream_continuation
            and self.attempts_left > 0
            and self.ctx.path in CONTINUABLE_PATHS
        )

    def continue_stream(self, leg: Leg, error: BaseException | str) -> bool:
        """The engine broke the stream after it began: send the request, with the text streamed so far
        as the start of the answer, to another engine of the model (another attempt, from the retry
        budget), and relay the rest into the client's stream. False (the stream is broken off with an
        error event, as before) when that cannot be done faithfully."""
        if self.done or not self.director.settings.stream_continuation:
            return False
        ctx = self.ctx
        metrics = self.director.metrics
        engine = self.engine
        assert engine is not None
        continuing = self.continuing
        why = None
        if self.attempts_left <= 0:
            why = "no_attempt_left"
        elif leg.kept is None or sum(map(len, leg.kept)) > KEEP_LIMIT:
            why = "too_long"
        elif not leg.at_event_boundary():
            why = "partial_event"
        elif continuing is None:
            try:
                continuing = Continuation.begin(
                    ctx.path,
                    ctx.body,
                    b"".join(leg.kept),
                    leg.chunked and leg.dechunker is None,
                    leg.keep_alive,
                )
            except NotContinuable as exc:
                why = str(exc)
            else:
                continuing.ttft = leg.ttft
        if why is None:
            assert continuing is not None
            if continuing.transcript.finished:
                why = "answer_finished"
            else:
                ctx.exclude(engine.name)
                if not self._other_candidate():
                    why = "no_engine"
        if why is not None:
            metrics.stream_continuations.labels(ctx.model_label, why).inc()
            return False
        assert continuing is not None
        log.warning(
            "engine %s broke a stream after %d events (%s); continuing it on another engine (%s)",
            engine.name,
            continuing.transcript.tokens,
            error,
            ctx.log_ref(),
        )
        self.continuing = continuing
        continuing.broke_at = time.perf_counter()
        leg.abort()
        self.leg = None
        self._settle(FAILURE)
        if ctx.trace is not None:
            ctx.trace.leg_end(leg.status, f"broken, continued: {error}", stream=True)
        metrics.stream_continuations.labels(ctx.model_label, "continued").inc()
        metrics.retry(ctx.model, "stream_continued")
        self._rebody(continuing.body())
        self._attempt()
        return True

    def _continued_leg(self, continuing: Continuation, pool: Any, upstream_request: bytes) -> ContinuedLeg:  # noqa: ANN401
        """The leg of a continuation: its events rewritten into the client's stream."""
        metrics = self.director.metrics
        broke_at = continuing.broke_at

        def first_event(now: float) -> None:
            metrics.stream_continuation_seconds.observe(now - broke_at)

        leg = ContinuedLeg(
            self,
            self.conn,
            self.request,
            pool,
            metrics,
            upstream_request,
            continuing.transcript,
            continuing.client_chunked,
            continuing.keep_alive,
            broke_at,
            first_event,
        )
        leg.ttft = continuing.ttft
        return leg

    def continuation_refused(self, leg: Leg, message: str) -> None:
        ctx = self.ctx
        ctx.ttft = leg.ttft
        if ctx.trace is not None:
            ctx.trace.leg_end(leg.status, "continuation refused", stream=True)
        self.director.metrics.stream_continuations.labels(ctx.model_label, "refused").inc()
        log.warning("%s (%s)", message, ctx.log_ref())
        self._end("upstream_error", RELEASED)

    def _continued_stream_complete(self) -> None:
        self.director.metrics.stream_continuations.labels(self.ctx.model_label, "completed").inc()

    def _end_continued_stream(self, error: RouterError) -> None:
        """The continuation could not be sent (no engine took it in time, a hook refused it): the
        client's stream, open since the first engine's answer, ends with the router's error."""
        continuing = self.continuing
        assert continuing is not None
        self.leg = None
        event = sse_error_event(
            error.message, error.code or "upstream_error", error.error_type or "server_error"
        )
        if end_client_stream(self.conn, event, continuing.client_chunked):
            self.conn.finish(continuing.keep_alive)

    # ---- the client side (HttpConnection's Handler) -----------------------------------------------------
    def client_lost(self) -> None:
        if self.done:
            return
        if self.pd is not None:
            self.pd.cancel()  # the prefill engine sees the connection close and aborts the request
            self.pd = None
        leg = self.leg
        if leg is not None:
            self.leg = None
            self.ctx.ttft = leg.ttft
            leg.abort()  # the engine sees the connection close and aborts the request
        self._end("client_closed", RELEASED)

    def pause(self) -> None:
        if self.leg is not None:
            self.leg.pause()

    def resume(self) -> None:
        if self.leg is not None:
            self.leg.resume()

    def check_timeout(self, now: float) -> None:
        """Called by the server's sweep (``now`` from time.perf_counter): an engine silent for
        ``request_timeout``, or a stage waiting that long, fails the request.

        A sweep over the busy connections instead of a timer per request: arming and cancelling a
        timer for every request costs more than the whole check once a second.
        """
        if self.done:
            return
        if self.ctx.priority > 0:
            after = self.director.settings.eviction_after
            if after is not None:
                self._evict_for(now, after)
                if self.done:
                    return
        timeout = self.director.settings.request_timeout
        if self.pd is not None:
            self.pd.check_timeout(now, timeout)
            return
        leg = self.leg
        if leg is None:  # in the queue, or waiting on a stage's awaitable
            self.stage_timed_out(now, timeout)
            return
        silent = leg.silent_for(now)
        if silent < timeout:
            if silent >= STALLED_AFTER and leg.kept is not None and not self.engine.routable():  # type: ignore[union-attr]
                # its engine left, or was found unhealthy, and the stream stopped (a stopped vLLM's
                # stream waits on a dead engine core): continued elsewhere, or left to the timeout
                self.continue_stream(leg, f"engine {self.engine_name()} left and its stream stalled")
            return
        if leg.committed:
            leg.break_midway(f"engine {self.engine_name()} went silent", "read timeout")
            return
        leg.abort()
        self.leg = None
        if self.ctx.trace is not None:
            self.ctx.trace.leg_end(0, "upstream_timeout")
        self._fail(
            RouterError(
                504,
                f"Engine {self.engine_name()} did not answer within {timeout:g}s.",
                code="upstream_timeout",
            ),
            FAILURE,
        )

    # ---- eviction (.eviction) ----------------------------------------------------------------------------
    def _evict_for(self, now: float, after: float) -> None:
        """A critical request: while it waits for its first token (a stream whose first event has not
        come, or in the router's queue), sheddable work on its engine (any, from the queue) may be
        evicted for it. A non-streamed answer shows nothing until it is whole, so running and waiting
        cannot be told apart: it does not count as waiting."""
        leg = self.leg
        if leg is not None:
            if leg.ttft is not None or not (leg.sse or (leg.status == 0 and _streamed(self.ctx.body))):
                return
            engine = self.engine
        elif self.queue_seq:
            engine = None
        else:
            return
        ctx = self.ctx
        self.director.evictor.for_waiting(ctx.pool or ctx.model, engine, now - ctx.arrived, after)

    def eviction_engine(self) -> Engine | None:
        """The engine its answer is relayed from (eviction's view); None when no leg is open."""
        return self.engine if self.leg is not None else None

    def answer_begun(self) -> bool:
        """Its first streamed event (its first token) arrived: it holds a running slot."""
        leg = self.leg
        return leg is not None and leg.ttft is not None

    def evict(self, message: str) -> bool:
        """Abort it on its engine (the leg's connection closes: the engine aborts the request and frees
        its slot) and tell its client: 503 ``evicted`` with ``x-llm-d-request-dropped-reason: evicted``
        when nothing was forwarded yet, else an error event that ends the stream. The engine's breaker
        is not told: the engine did nothing wrong."""
        leg = self.leg
        if leg is None or self.done:
            return False
        ctx = self.ctx
        ctx.ttft = leg.ttft
        if ctx.trace is not None:
            ctx.trace.leg_end(leg.status, "evicted", stream=leg.sse)
        if leg.committed:
            leg.end_stream(sse_error_event(message, EVICTED, "server_error"))
            self._end(EVICTED, RELEASED)  # the leg stays set: _answer finishes the connection as it was left
            return True
        leg.abort()
        self.leg = None
        self._fail(
            RouterError(
                503,
                message,
                code=EVICTED,
                headers=[(b"retry-after", b"1"), (DROPPED_REASON, EVICTED.encode())],
            )
        )
        return True

    # ---- the end (DirectedRequest._end) --------------------------------------------------------------------
    def _answer(self, error: RouterError | None) -> None:
        if self.evictable:
            self.evictable = False
            self.director.evictor.forget(self.ctx.pool or self.ctx.model, self)
        if error is not None:
            if self.continuing is not None:  # the client's stream is open: it ends with the error
                self._end_continued_stream(error)
                return
            self.conn.send_error(error, self.ctx.request_id, self.request.keep_alive)
            return
        leg = self.leg
        if leg is not None:  # its answer went out (whole, or ended as HTTP allows): the connection goes on
            self.leg = None  # the leg points back here: no cycle left behind
            self.conn.finish(leg.keep_alive)

    def _accounted(self, engine_name: str, duration: float, answer_end: bytes | None) -> None:
        director = self.director
        trace = self.ctx.trace
        if trace is not None:
            trace.end(self.status, answer_end)
        pick = self.picked
        if pick is not None:  # gateway mode: the picker sees the end
            picker = director.endpoint_picker
            assert picker is not None
            if self.status.isdigit():
                engine = self.engine
                served = engine.address if engine is not None else ""
                picker.finish(pick, int(self.status), b"", answer_end or b"", served)
            else:
                picker.abandon(pick)
        if director.settings.access_log:
            request = self.request
            log.info(
                "%s %s -> %s %s %.1f ms%s",
                request.method,
                request.path,
                self.status,
                engine_name,
                duration * 1e3,
                f" trace_id={trace.trace_id}" if trace is not None and trace.trace_id else "",
                extra=self.ctx.log_fields(),
            )


def _streamed(body: bytes) -> bool:
    """Whether the request asked for a streamed answer (read only for a critical request that waits)."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and doc.get("stream") is True


#: Headers of a picker's ImmediateResponse the router writes itself: the hop-by-hop ones (as for an
#: engine's answer), the body's length and type, its date and server; every other header it set reaches
#: the client, as Envoy passes them on.
_PICKER_HEADERS_NOT_PASSED = HOP_BY_HOP | {b"content-length", b"content-type", b"date", b"server"}


def _picker_refusal(status: int, body: bytes, headers: list[tuple[str, str]]) -> RouterError:
    """The endpoint picker's ImmediateResponse as the client's error: its status, its message (an
    OpenAI-style body's, or the body's text, as the upstream picker writes ``inference error: ...``), and
    the headers it set, e.g. ``retry-after`` or llm-d's ``x-llm-d-request-dropped-reason`` (why its flow
    control refused the request), which a client behind Envoy would see too."""
    message, code = "", "endpoint_picker_refused"
    try:
        error = orjson.loads(body)["error"]
        message, code = str(error["message"]), str(error.get("code") or code)
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()
    kept = [
        (name, v.encode("latin-1"))
        for k, v in headers
        if not k.startswith(":") and (name := k.encode("latin-1")) not in _PICKER_HEADERS_NOT_PASSED
    ]
    return RouterError(
        status if 400 <= status <= 599 else 502, message or f"Refused ({status}).", code=code, headers=kept
    )
