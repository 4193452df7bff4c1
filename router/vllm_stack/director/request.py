"""One proxied request through the director's stages, driven by callbacks, not by a coroutine.

admit -> prepare -> schedule -> pre-request -> relay leg; on a failure before anything reached the
client, schedule again (the engines tried are excluded) and run another leg, up to ``retries`` more.
For a model with prefill engines, the first scheduling is preceded by the prefill stage
(:mod:`.prefill_stage`): a prefill leg elsewhere, whose hand-over the decode leg carries.
When scheduling finds every engine saturated (or a configured model has none ready), the request
waits in its model's queue (:mod:`.queue`) and is scheduled again from there; a sheddable one is
answered 429 instead.

A stage hook (a plugin's ``admit``, ``prepare``, ``pre_request``) is synchronous unless it returns an
awaitable; only then does the request wait, on that awaitable, and resume in its done-callback. The
common path (no hook, or synchronous ones) runs start to upstream write in one call. A client that
leaves during any stage ends the request: the awaitable the stage is waiting on is cancelled, the
leg's connection is closed (the engine aborts the request), and the engine's books are settled.

What an attempt holds on its engine (breaker turn, in-flight count, prefill estimate, gauge) is one
:class:`~vllm_stack.engines.booking.EngineBooking`, released on every way out by :meth:`_settle`.
What the request is (id, model, metric label, arrival, the decision's profile and reason, TTFT) is
its :class:`~vllm_stack.scheduling.framework.RequestContext`, which every stage, plugin and leg reads.

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
import inspect
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

from vllm_stack.director.disagg import DISAGG_PATHS
from vllm_stack.director.prefill_stage import PrefillStage
from vllm_stack.engines.booking import FAILURE, RELEASED, SUCCESS, EngineBooking
from vllm_stack.engines.engine import Engine
from vllm_stack.errors import RouterError
from vllm_stack.relay.leg import Leg
from vllm_stack.scheduling.config import Hooks
from vllm_stack.scheduling.framework import Completion, Reason, Refusal, RequestContext
from vllm_stack.server.http1 import HttpConnection, HttpRequest

if TYPE_CHECKING:
    from vllm_stack.director.director import Director

log = logging.getLogger(__name__)

_ADMIT, _PREPARE, _PRE_REQUEST = 0, 1, 2
_STAGE_NAMES = ("admission", "prepare", "pre-request")


def route_header(profile: str, reason: str, engine: str, note: str = "") -> bytes:
    """The x-vllm-stack-route value: what decided and where the request went. Engine names and a
    picker's note come from discovery and from other services, so anything but printable ASCII is
    replaced (nothing they hold can end the header line)."""
    value = f"profile={profile}; reason={reason}; engine={engine}" + (f"; {note}" if note else "")
    return "".join(c if " " <= c <= "~" else "?" for c in value).encode()


class ProxiedRequest:
    """The state of one proxied request; the client connection's handler while it runs."""

    __slots__ = (
        "director",
        "conn",
        "request",
        "ctx",
        "tail",
        "attempts_left",
        "engine",
        "booking",
        "last_error",
        "status",
        "done",
        "leg",
        "waiting",
        "answer_end",
        "queue_seq",
        "queued_at",
        "disagg_pending",
        "pd",
        "route",
    )

    def __init__(
        self,
        director: Director,
        conn: HttpConnection,
        request: HttpRequest,
        ctx: RequestContext,
        tail: bytes,
    ) -> None:
        self.director = director
        self.conn = conn
        self.request = request
        self.ctx = ctx  # request_id, model_label and arrived are set by the API layer
        self.tail = tail  # request headers, framing and body as sent upstream (same for every leg)
        self.attempts_left = 1 + director.settings.retries
        self.engine: Engine | None = None  # the engine of the current (or last) attempt
        self.booking: EngineBooking | None = None  # what the current attempt holds on it
        self.last_error: RouterError | None = None
        self.status = "none"  # the outcome label of the request counter
        self.done = False
        self.leg: Leg | None = None
        self.waiting: asyncio.Future[Any] | None = None  # the awaitable a stage hook returned
        self.answer_end: bytes | None = None
        self.queue_seq = 0  # its entry in the model's queue while it waits there (director.queue)
        self.queued_at = 0.0
        # Disaggregated prefill (.disagg): decided at the first scheduling, for models with prefill engines
        self.disagg_pending = director.settings.disagg is not None and ctx.path in DISAGG_PATHS
        self.pd: PrefillStage | None = None  # while its prefill stage runs
        self.route: bytes | None = None  # the x-vllm-stack-route value (debug_headers on)
        # Constructing the request starts it (as asyncio's tasks start): one call less per request.
        conn.handler = self
        hooks = director.hooks
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
            if hooks.admission:
                ctx.trace.stage_begin("admission")
        if hooks.admission or hooks.prepare:
            self._run_hooks(hooks, _ADMIT, 0)
        else:
            self._attempt()

    # ---- stages ------------------------------------------------------------------------------------------

    def _run_hooks(self, hooks: Hooks, stage: int, index: int) -> None:
        """Run the hooks of ``stage`` from ``index`` on, then the stages after it. ``hooks`` is the
        set the stage began with: a reload while a hook is awaited does not shift the position."""
        ctx = self.ctx
        while True:
            fns = (
                hooks.admission
                if stage == _ADMIT
                else hooks.prepare
                if stage == _PREPARE
                else hooks.pre_request
            )
            while index < len(fns):
                fn = fns[index]
                index += 1
                try:
                    if stage == _ADMIT:
                        outcome = fn(ctx, self.director.registry.candidates(ctx.pool or ctx.model))
                    elif stage == _PREPARE:
                        outcome = fn(ctx)
                    else:
                        outcome = fn(ctx, self.engine)
                except Exception:  # noqa: BLE001 - a plugin's bug fails its request, not the router
                    log.exception("%s hook %r failed (%s)", _STAGE_NAMES[stage], fn, ctx.log_ref())
                    self._plugin_failed()
                    return
                if outcome is None:
                    continue
                if isinstance(outcome, Refusal):
                    self._refused(outcome)
                    return
                if inspect.isawaitable(outcome):
                    self._wait(outcome, hooks, stage, index)
                    return
                log.error("%s hook %r returned %r (%s)", _STAGE_NAMES[stage], fn, outcome, ctx.log_ref())
                self._plugin_failed()
                return
            if stage == _ADMIT:
                stage, index = _PREPARE, 0
                if ctx.trace is not None:
                    ctx.trace.stage_end()  # admitted
            elif stage == _PREPARE:
                self._attempt()
                return
            else:
                self._send()
                return

    def _wait(self, awaitable: Awaitable[Any], hooks: Hooks, stage: int, index: int) -> None:
        trace = self.ctx.trace
        if trace is not None and stage != _ADMIT:  # admission has its span already
            self._trace_hook(trace, stage, hooks, index - 1)
        future = self.waiting = asyncio.ensure_future(awaitable)
        future.add_done_callback(lambda f: self._resumed(f, hooks, stage, index))

    def _resumed(self, future: asyncio.Future[Any], hooks: Hooks, stage: int, index: int) -> None:
        if future is not self.waiting or self.done:  # the client left (and the future was cancelled)
            return
        self.waiting = None
        if future.cancelled():
            log.error("%s hook's awaitable was cancelled (%s)", _STAGE_NAMES[stage], self.ctx.log_ref())
            self._plugin_failed()
            return
        exc = future.exception()
        if exc is not None:
            log.error("%s hook failed (%s)", _STAGE_NAMES[stage], self.ctx.log_ref(), exc_info=exc)
            self._plugin_failed()
            return
        outcome = future.result()
        if isinstance(outcome, Refusal):
            self._refused(outcome)
            return
        if outcome is not None:
            log.error("%s hook resolved to %r (%s)", _STAGE_NAMES[stage], outcome, self.ctx.log_ref())
            self._plugin_failed()
            return
        trace = self.ctx.trace
        if trace is not None and stage != _ADMIT:  # (a refusal ends the span in _refused, marked)
            trace.stage_end()
        self._run_hooks(hooks, stage, index)

    def _trace_hook(self, trace: Any, stage: int, hooks: Hooks, index: int) -> None:  # noqa: ANN401
        """A span for an awaited prepare-data or pre-request hook (a LoRA adapter load is the
        lora-affinity plugin's awaited pre-request hook: the adapter is named on the span)."""
        fns = hooks.prepare if stage == _PREPARE else hooks.pre_request
        plugin = getattr(getattr(fns[index], "__self__", None), "name", "")
        attributes: dict[str, Any] = {"vllm_stack.plugin": str(plugin)}
        adapter = self.ctx.adapter
        if stage == _PRE_REQUEST and adapter is not None:
            attributes["vllm_stack.adapter"] = adapter.name
            attributes["vllm_stack.engine"] = self.engine_name()
        trace.stage_begin(_STAGE_NAMES[stage].replace("-", "_"), **attributes)

    def _attempt(self) -> None:
        """Schedule (again, after a failure), then pre-request hooks, then a leg; or wait in the
        model's queue when every engine is saturated or none is ready yet."""
        if self.attempts_left <= 0:
            self._fail(self.last_error or RouterError(502, "No engine answered.", code="upstream_error"))
            return
        if self.disagg_pending:
            self.disagg_pending = False
            self.pd = PrefillStage.begin(self)
            if self.pd is not None:
                return
        director = self.director
        ctx = self.ctx
        queue = director.queue
        if queue.length and not ctx.excluded and queue.ahead(ctx.pool or ctx.model, ctx.priority):
            # requests of at least its priority wait already: it goes behind them (sheddable: shed)
            self._wait_or_fail(Reason.ALL_SATURATED)
            return
        ctx.prefill_tokens = 0  # a picker that estimates it sets it again (a retry may use another)
        scheduler = director.scheduler
        schedule = scheduler.critical if ctx.priority > 0 else scheduler.standard
        trace = ctx.trace
        if trace is not None:
            trace.schedule_begin()
        result = schedule(ctx, director.registry.candidates(ctx.pool or ctx.model))
        ctx.profile = result.profile
        ctx.reason = result.reason
        engine = result.engine
        if trace is not None:
            trace.schedule_end(result.profile, result.reason, engine and engine.name, ctx.predicted_cached)
        if engine is None:
            self._wait_or_fail(result.reason)
            return
        if director.settings.debug_headers:
            self._note_route(engine)
        self._start(engine)

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

    def _note_route(self, engine: Engine) -> None:
        """What the answer's x-vllm-stack-route will say (debug_headers on): the decision in the context."""
        ctx = self.ctx
        self.route = route_header(ctx.profile, ctx.reason, engine.name, ctx.route_note)

    def _may_wait(self, reason: str) -> bool:
        """Whether the request waits in its model's queue for ``reason`` (not a sheddable one when
        the engines are saturated; one for a configured model that has no ready engine)."""
        settings = self.director.settings
        if not settings.queue_enabled or self.director.queue.max_per_model <= 0:
            return False
        if reason == Reason.ALL_SATURATED:
            return self.ctx.priority >= 0
        return reason == Reason.NO_CANDIDATE and (self.ctx.pool or self.ctx.model) in settings.served_models

    def _wait_or_fail(self, reason: str) -> None:
        director = self.director
        ctx = self.ctx
        if not self._may_wait(reason):
            self._fail(self.last_error or director.error_for(reason, ctx.model))
        elif not director.queue.add(ctx.pool or ctx.model, self):
            self._fail(director.error_for(Reason.QUEUE_FULL, ctx.model))
        elif ctx.trace is not None:
            ctx.trace.queued()

    @property
    def priority(self) -> int:
        return self.ctx.priority

    def try_dispatch(self) -> str | None:
        """The queue's try (it is the head of its model's queue): an engine now, or None to stay."""
        director = self.director
        ctx = self.ctx
        ctx.prefill_tokens = 0
        scheduler = director.scheduler
        schedule = scheduler.critical if ctx.priority > 0 else scheduler.standard
        result = schedule(ctx, director.registry.candidates(ctx.pool or ctx.model))
        ctx.profile = result.profile
        ctx.reason = result.reason
        if result.engine is not None:
            trace = ctx.trace
            if trace is not None:
                trace.dequeued("dispatched")
                trace.schedule_begin()  # the decision that took it out of the queue
                trace.schedule_end(result.profile, result.reason, result.engine.name, ctx.predicted_cached)
            self.queue_seq = 0
            if director.settings.debug_headers:
                self._note_route(result.engine)
            self._start(result.engine)
            return "dispatched"
        if self._may_wait(result.reason):
            return None
        self.queue_seq = 0
        self._fail(self.last_error or director.error_for(result.reason, ctx.model))
        return "failed"

    def displaced(self) -> None:
        """A full queue made room for a request of higher priority: this one is answered 429."""
        self._fail(self.director.error_for(Reason.QUEUE_FULL, self.ctx.model))

    def _start(self, engine: Engine) -> None:
        self.attempts_left -= 1
        director = self.director
        ctx = self.ctx
        self.engine = engine
        self.booking = EngineBooking(
            engine, director.metrics.in_flight_child(engine.name), ctx.prefill_tokens
        )
        hooks = director.hooks
        if hooks.pre_request:
            ctx.upstream_headers = b""
            self._run_hooks(hooks, _PRE_REQUEST, 0)
        else:
            self._send()

    def _send(self) -> None:
        engine = self.engine
        assert engine is not None
        director = self.director
        pool = director.pools.get(engine.url)
        request = self.request
        line = b"%s %s%s HTTP/1.1\r\nhost: %s\r\n" % (
            request.method.encode(),
            pool.path_prefix,
            request.target,
            pool.host_header,
        )
        ctx = self.ctx
        trace = ctx.trace
        if trace is not None:  # the leg's span, sent as its traceparent (the engine's spans join it)
            line += trace.leg_begin("upstream", engine.name, pool.host_header.decode("latin-1"))
        leg = self.leg = Leg(
            self, self.conn, request, pool, director.metrics, line + ctx.upstream_headers + self.tail
        )
        if ctx.keep_answer_end:
            leg.answer_end = b""  # before any read: none is handled before this returns

    def _settle(self, outcome: str) -> None:
        """The current attempt is over: its engine's books released, its breaker told ``outcome``
        (engines.booking), and a request waiting for that engine's model given a try. The one way
        out of an attempt; nothing happens when none is open."""
        booking = self.booking
        if booking is not None:
            self.booking = None
            booking.settle(outcome)
            queue = self.director.queue
            if queue.length:  # its engine has room for one waiting
                queue.kick(self.ctx.pool or self.ctx.model)

    def first_token(self) -> None:
        """The engine has prefilled the prompt (its first token is out): its prefill estimate is released."""
        booking = self.booking
        if booking is not None and booking.prefill_tokens:  # (a call less for most requests)
            booking.first_token()

    def _other_candidate(self) -> bool:
        excluded = self.ctx.excluded
        return any(
            e.name not in excluded and e.breaker.available()
            for e in self.director.registry.candidates(self.ctx.pool or self.ctx.model)
        )

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
        self.done = True
        self.leg = None  # the leg points back here: no cycle left behind
        status = leg.status
        self.status = str(status)
        ctx = self.ctx
        ctx.ttft = leg.ttft
        self.answer_end = leg.answer_end
        # _settle, inlined: this is every request's way out
        booking = self.booking
        if booking is not None:
            self.booking = None
            booking.settle(FAILURE if status >= 500 else SUCCESS)
            queue = self.director.queue
            if queue.length:  # its engine has room for one waiting
                queue.kick(ctx.pool or ctx.model)
        if ctx.trace is not None:
            ctx.trace.leg_end(status, stream=leg.sse)
        self.conn.finish(leg.keep_alive)
        self._account()

    def leg_broken(self, leg: Leg, error: BaseException | str) -> None:
        self.done = True
        self.leg = None
        self.status = "upstream_error"
        self.ctx.ttft = leg.ttft
        self._settle(FAILURE)
        if self.ctx.trace is not None:
            self.ctx.trace.leg_end(leg.status, f"broken: {error}", stream=leg.sse)
        self.conn.finish(leg.keep_alive)
        self._account()

    # ---- the client side (HttpConnection's Handler) -----------------------------------------------------
    def client_lost(self) -> None:
        if self.done:
            return
        self.done = True
        self.status = "client_closed"
        if self.queue_seq:
            self.director.queue.remove(self.ctx.pool or self.ctx.model, self, "client_closed")
        waiting = self.waiting
        if waiting is not None:
            self.waiting = None
            waiting.cancel()  # whatever the stage started ends with the request
        if self.pd is not None:
            self.pd.cancel()  # the prefill engine sees the connection close and aborts the request
            self.pd = None
        leg = self.leg
        if leg is not None:
            self.leg = None
            self.ctx.ttft = leg.ttft
            leg.abort()  # the engine sees the connection close and aborts the request
        self._settle(RELEASED)
        self._account()

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
        settings = self.director.settings
        timeout = settings.request_timeout
        leg = self.leg
        if self.queue_seq:
            if now - self.queued_at >= settings.queue_timeout:
                self.director.queue.remove(self.ctx.pool or self.ctx.model, self, "timeout")
                self._fail(
                    self.director.error_for(
                        Reason.QUEUE_TIMEOUT,
                        self.ctx.model,
                        f"No engine of model '{self.ctx.model}' had room within {settings.queue_timeout:g}s; "
                        "try again shortly.",
                    )
                )
            return
        if self.pd is not None:
            self.pd.check_timeout(now, timeout)
            return
        if leg is None:
            if self.waiting is not None and now - self.ctx.arrived >= timeout:
                waiting, self.waiting = self.waiting, None
                waiting.cancel()
                self._settle(RELEASED)
                self._fail(
                    RouterError(
                        504, f"The request was not routed within {timeout:g}s.", code="routing_timeout"
                    )
                )
            return
        if leg.silent_for(now) < timeout:
            return
        if leg.committed:
            leg.break_midway(f"engine {self.engine_name()} went silent", "read timeout")
            return
        leg.abort()
        self.leg = None
        self._settle(FAILURE)
        if self.ctx.trace is not None:
            self.ctx.trace.leg_end(0, "upstream_timeout")
        self._fail(
            RouterError(
                504,
                f"Engine {self.engine_name()} did not answer within {timeout:g}s.",
                code="upstream_timeout",
            )
        )

    # ---- endings -----------------------------------------------------------------------------------------
    def _refused(self, refusal: Refusal) -> None:
        self._settle(RELEASED)
        if self.ctx.trace is not None:
            self.ctx.trace.stage_end(str(refusal.reason))
        self._fail(self.director.error_for(refusal.reason, self.ctx.model, refusal.message))

    def _plugin_failed(self) -> None:
        self._settle(RELEASED)
        self._fail(RouterError(500, "A routing plugin failed; see the router's log.", code="plugin_error"))

    def _fail(self, error: RouterError) -> None:
        """Answer with an error of the router's own (only while nothing was forwarded)."""
        if self.done:
            return
        self.done = True
        self.status = str(error.status)
        self.conn.send_error(error, self.ctx.request_id, self.request.keep_alive)
        self._account()

    def engine_name(self) -> str:
        """The engine of the current (or last) attempt, "none" before one was picked."""
        return self.engine.name if self.engine is not None else "none"

    def _account(self) -> None:
        director = self.director
        ctx = self.ctx
        duration = ctx.duration = time.perf_counter() - ctx.arrived
        engine = self.engine
        engine_name = engine.name if engine is not None else "none"
        director.metrics.observe_request(ctx.model_label, engine_name, self.status, duration)
        trace = ctx.trace
        if trace is not None:
            trace.end(self.status, self.answer_end)
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
            )
        hooks = director.hooks.response_complete
        if hooks:
            completion = Completion(self.engine, self.status, duration, ctx.ttft, self.answer_end)
            for fn in hooks:
                try:
                    fn(ctx, completion)
                except Exception:  # noqa: BLE001 - the answer is already out; log and go on
                    log.exception("response-complete hook %r failed (%s)", fn, ctx.log_ref())
