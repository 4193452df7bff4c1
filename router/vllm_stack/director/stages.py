"""The director's stages for one request, whatever carries its bytes: admit, prepare, schedule (or wait
in the model's queue), pre-request, then the kind's :meth:`DirectedRequest._send`.

Three kinds of request run these stages: the router's own (:class:`~.request.ProxiedRequest`, which
relays the request to the engine over a leg), the endpoint picker's (:mod:`vllm_stack.epp`, which names
the engine to a gateway that relays it) and a batch line (:mod:`vllm_stack.batch`, one POST to the
engine). All hold what the attempt books on its engine (:class:`~vllm_stack.engines.booking.EngineBooking`),
released by :meth:`DirectedRequest._settle`, and all read the same
:class:`~vllm_stack.scheduling.framework.RequestContext`.

Where a request is (``[relayed]``: that kind's own state, on :class:`~.request.ProxiedRequest`)::

    state            marked by                           left by
    ---------------  ----------------------------------  ----------------------------------------------
    admit, prepare   ``waiting`` while a hook's          the awaitable's result: the next stage; a
                     awaitable is awaited                refusal or a plugin's fault: _fail
    schedule         (within _attempt, synchronous)      an engine: _start; none: queued, or _fail
    [relayed] ask    ``pick`` ASKING, ``waiting``        the picker's answer: its engine (_start), the
                                                         director's scheduling (fail-open), or _fail
    [relayed] pre-   ``pd`` (the prefill stage)          resume_after_prefill: decode on the engine
      fill                                               the KV went to (_start), or _attempt
    queued           ``queue_seq`` (not 0)               the queue's try_dispatch (_start, or _fail);
                                                         displaced (429) or timed out (503): _fail
    pre-request      ``engine``, ``booking``;            _send, once every hook ran; a refusal or a
                     ``waiting`` while a hook awaits     plugin's fault: _fail
    sent             the kind's: [relayed] ``leg``;      what the kind hears of the answer: _end;
                     the gateway's stream; a batch       [relayed] a retry before anything was
                     line's ``task``                     forwarded: _settle, then _attempt again
    done             ``done``                            (final)

Every way a request finishes goes through :meth:`DirectedRequest._end` once (a timeout at any stage
too: the sweep's check_timeout answers through _fail)::

    ending                      called from                               status           outcome
    --------------------------  ----------------------------------------  ---------------  ----------
    the engine's answer, whole  leg_complete, answered, _answered         its status       success
                                                                                           (failure
                                                                                           from 500)
    the answer broke midway     [relayed] leg_broken                      upstream_error   failure
    the client left             client_lost, lost, abandon                client_closed    released
                                                                          (answer_timeout:
                                                                          the gateway's
                                                                          silence)
    the router's own answer     _fail: any kind, any stage                its status       released
                                                                                           (an engine
                                                                                           silent:
                                                                                           failure)

``_end`` takes the request out of any stage, settles its attempt's booking with ``outcome``, tells
whoever waits through the kind's ``_answer`` (the client's connection, the gateway's stream, the batch
runner), then counts it once: the request counter, the kind's ``_accounted`` (access log; [relayed]
the trace's end and the endpoint picker's view), the response-complete hooks.

A stage hook (a plugin's ``admit``, ``prepare``, ``pre_request``) is synchronous unless it returns an
awaitable; only then does the request wait, on that awaitable, and resume in its done-callback. The
common path (no hook, or synchronous ones) runs start to :meth:`_send` in one call. A request that ends
during any stage (its client left) cancels the awaitable the stage is waiting on.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm_stack.engines.booking import RELEASED, EngineBooking
from vllm_stack.engines.engine import Engine
from vllm_stack.errors import RouterError
from vllm_stack.relay.headers import header_fields
from vllm_stack.scheduling.config import Hooks
from vllm_stack.scheduling.framework import Completion, Reason, Refusal, RequestContext, SchedulingResult

if TYPE_CHECKING:
    from vllm_stack.director.director import Director
    from vllm_stack.tenants.shares import ModelShares

log = logging.getLogger(__name__)

_ADMIT, _PREPARE, _PRE_REQUEST = 0, 1, 2
_STAGE_NAMES = ("admission", "prepare", "pre-request")


def route_header(profile: str, reason: str, engine: str, note: str = "") -> bytes:
    """The x-vllm-stack-route value: what decided and where the request went. Engine names and a
    picker's note come from discovery and from other services, so anything but printable ASCII is
    replaced (nothing they hold can end the header line)."""
    value = f"profile={profile}; reason={reason}; engine={engine}" + (f"; {note}" if note else "")
    return "".join(c if " " <= c <= "~" else "?" for c in value).encode()


class DirectedRequest:
    """One request going through the director's stages; subclasses say how it is sent and answered."""

    __slots__ = (
        "director",
        "ctx",
        "attempts_left",
        "engine",
        "booking",
        "last_error",
        "status",
        "done",
        "waiting",
        "queue_seq",
        "queued_at",
        "route",
        "share",
    )

    def __init__(self, director: Director, ctx: RequestContext, attempts: int) -> None:
        self.director = director
        self.ctx = ctx  # request_id, model_label and arrived are set by the caller
        self.attempts_left = attempts
        self.engine: Engine | None = None  # the engine of the current (or last) attempt
        self.booking: EngineBooking | None = None  # what the current attempt holds on it
        self.last_error: RouterError | None = None
        self.status = "none"  # the outcome label of the request counter
        self.done = False
        self.waiting: asyncio.Future[Any] | None = None  # the awaitable a stage hook returned
        self.queue_seq = 0  # its entry in the model's queue while it waits there (director.queue)
        self.queued_at = 0.0
        self.route: bytes | None = None  # the x-vllm-stack-route value (debug_headers on)
        self.share: ModelShares | None = None  # its model's entry in the tenants' counts while counted

    #: Whether the response-complete hooks run for a request no engine answered (refused, client gone).
    #: A batch line's do not: it is sent again later, and its hooks run for the send that is answered.
    COMPLETES_UNANSWERED: ClassVar[bool] = True

    # ---- what a kind provides ----------------------------------------------------------------------------
    def _send(self) -> None:
        """The engine is picked (``self.engine``, booked) and every pre-request hook ran: send it there."""
        raise NotImplementedError

    def _answer(self, error: RouterError | None) -> None:
        """The request ended (:meth:`_end`; its booking is settled): tell whoever waits for it. ``error``
        is the router's own answer (nothing was forwarded); None when the engine's answer went out, or
        nobody is left to tell."""
        raise NotImplementedError

    def _accounted(self, engine_name: str, duration: float, answer_end: bytes | None) -> None:
        """The kind's own part of the request's accounting, after the request counter and before the
        response-complete hooks (its access-log line; the relayed kind's trace and endpoint picker)."""
        raise NotImplementedError

    # ---- the end -----------------------------------------------------------------------------------------
    def _fail(self, error: RouterError, outcome: str = RELEASED) -> None:
        """Answer with an error of the router's own (only while nothing was forwarded); an attempt's
        booking still open is settled as ``outcome``. A rate-limited tenant's ``x-ratelimit-*`` headers,
        which its admission put on the answer (vllm_stack.director.rate_gate), come with it: every answer
        of a limited tenant carries them, a refusal by the queue too."""
        extra = self.ctx.response_headers
        if extra and not self.done:
            error.headers = [*error.headers, *header_fields(extra)]
        self._end(str(error.status), outcome, None, error)

    def _end(
        self, status: str, outcome: str, answer_end: bytes | None = None, error: RouterError | None = None
    ) -> None:
        """The one way a request finishes, whatever its kind and however it ends (the table above),
        once: out of any stage it is in, its attempt's booking settled as ``outcome`` (engines.booking),
        whoever waits told (:meth:`_answer`), then its accounting: the request counter under
        ``status``, the kind's part (:meth:`_accounted`), the response-complete hooks with the
        answer's last bytes (``answer_end``, when kept)."""
        if self.done:
            return
        self.done = True
        self.status = status
        if self.queue_seq or self.waiting is not None:  # it ended in a stage: its client left
            self._leave_stages()
        self._settle(outcome)
        self._answer(error)
        director = self.director
        ctx = self.ctx
        duration = ctx.duration = time.perf_counter() - ctx.arrived
        engine = self.engine
        engine_name = engine.name if engine is not None else "none"
        director.metrics.observe_request(ctx.model_label, engine_name, status, duration)
        self._accounted(engine_name, duration, answer_end)
        if director.hooks.response_complete and (answer_end is not None or self.COMPLETES_UNANSWERED):
            self._run_completion_hooks(duration, answer_end)

    def _run_completion_hooks(self, duration: float, answer_end: bytes | None) -> None:
        """The response-complete hooks (prefill release, usage, request tracker), once per request; the
        answer is already out, so a failing hook is logged and the others still run."""
        ctx = self.ctx
        completion = Completion(self.engine, self.status, duration, ctx.ttft, answer_end)
        for fn in self.director.hooks.response_complete:
            try:
                fn(ctx, completion)
            except Exception:  # noqa: BLE001 - the answer is already out; log and go on
                log.exception("response-complete hook %r failed (%s)", fn, ctx.log_ref())

    # ---- stages ------------------------------------------------------------------------------------------
    def _begin(self) -> None:
        """Run the stages from admission on (the caller has set up ``ctx``, tracing included)."""
        hooks = self.director.hooks
        if hooks.admission or hooks.prepare:
            trace = self.ctx.trace
            if trace is not None and hooks.admission:
                trace.stage_begin("admission")
            self._run_hooks(hooks, _ADMIT, 0)
        else:
            self._attempt()

    def stage_timed_out(self, now: float, timeout: float) -> bool:
        """The parts of a timeout sweep common to every kind: a request waiting in the queue past the
        queue timeout, or on a stage's awaitable past ``timeout``, is answered. True when the request is
        in one of those places (the caller then has nothing of its own to check)."""
        settings = self.director.settings
        if self.queue_seq:
            if now - self.queued_at >= settings.queue_timeout:
                director = self.director
                model = self.ctx.pool or self.ctx.model
                director.queue.remove(model, self, "timeout")
                self._fail(director.queue_timed_out(self.ctx.model, model, settings.queue_timeout))
            return True
        if self.waiting is not None:
            if now - self.ctx.arrived >= timeout:
                waiting, self.waiting = self.waiting, None
                waiting.cancel()
                self._fail(
                    RouterError(
                        504, f"The request was not routed within {timeout:g}s.", code="routing_timeout"
                    )
                )
            return True
        return False

    def _leave_stages(self) -> None:
        """The request ended while in a stage (its client left): out of the queue, the stage's
        awaitable cancelled."""
        if self.queue_seq:
            self.director.queue.remove(self.ctx.pool or self.ctx.model, self, "client_closed")
        waiting = self.waiting
        if waiting is not None:
            self.waiting = None
            waiting.cancel()  # whatever the stage started ends with the request

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
        model's queue when every engine is saturated or none is ready yet. (A kind may decide an
        attempt elsewhere first and call this for the rest: the relayed kind's endpoint picker and
        prefill stage.)"""
        if self.attempts_left <= 0:
            self._fail(self.last_error or RouterError(502, "No engine answered.", code="upstream_error"))
            return
        director = self.director
        ctx = self.ctx
        queue = director.queue
        if queue.length and not ctx.excluded and queue.ahead(ctx.pool or ctx.model, ctx.priority):
            # requests of at least its priority wait already: it goes behind them (sheddable: shed), and
            # with the tenant headroom kept the queue tries at once: those waiting may be held back from
            # room this one's tenant may take (RequestQueue.dispatch)
            self._wait_or_fail(Reason.ALL_SATURATED)
            if self.queue_seq and director.settings.tenant_headroom:
                queue.kick(ctx.pool or ctx.model)
            return
        result = self._schedule()
        engine = result.engine
        if engine is None:
            self._wait_or_fail(result.reason)
            return
        if director.settings.debug_headers:
            self._note_route(engine)
        self._start(engine)

    def _schedule(self) -> SchedulingResult:
        """The director's scheduling of the request, the decision noted in its context (and trace)."""
        ctx = self.ctx
        ctx.prefill_tokens = 0  # a picker that estimates it sets it again (a retry may use another)
        trace = ctx.trace
        if trace is not None:
            trace.schedule_begin()
        result = self.director.schedule(ctx)
        ctx.profile = result.profile
        ctx.reason = result.reason
        if trace is not None:
            engine = result.engine
            trace.schedule_end(result.profile, result.reason, engine and engine.name, ctx.predicted_cached)
        return result

    def _note_route(self, engine: Engine) -> None:
        """What the answer's x-vllm-stack-route will say (debug_headers on): the decision in the context."""
        ctx = self.ctx
        self.route = route_header(ctx.profile, ctx.reason, engine.name, ctx.route_note)

    def _may_wait(self, reason: str) -> bool:
        """Whether the request waits in its model's queue for ``reason`` (not a sheddable one when
        the engines are saturated; one for a configured model that has no ready engine, or whose
        engines all sleep and one is being woken)."""
        settings = self.director.settings
        if not settings.queue_enabled or self.director.queue.max_per_model <= 0:
            return False
        if reason == Reason.ALL_SATURATED:
            return self.ctx.priority >= 0
        if reason != Reason.NO_CANDIDATE:
            return False
        model = self.ctx.pool or self.ctx.model
        # its engines all sleep: one is woken (as KEDA wakes a model from zero), or it is refused at once
        # (waking off: a configured model's queue would only time out, 60 s later)
        if self.director.registry.sleeping(model):
            return self.director.wake_for(model)
        return model in settings.served_models

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

    @property
    def tenant(self) -> str:
        """Who sent it (:mod:`vllm_stack.tenants.identity`): its turn in its band of the queue."""
        return self.ctx.tenant

    @property
    def held_back(self) -> bool:
        """Its last scheduling kept the tenant headroom from it (its tenant is past its share)."""
        return self.ctx.held_back

    def try_dispatch(self) -> str | None:
        """The queue's try (it is the head of its model's queue): an engine now, or None to stay."""
        director = self.director
        ctx = self.ctx
        ctx.prefill_tokens = 0
        result = director.schedule(ctx)
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
        shares = director.shares
        if shares.tracking:  # (the tenant headroom is on and a second tenant was seen)
            self.share = shares.started(ctx.pool or ctx.model, ctx.tenant)
        hooks = director.hooks
        if hooks.pre_request:
            ctx.upstream_headers = b""
            self._run_hooks(hooks, _PRE_REQUEST, 0)
        else:
            self._send()

    def _settle(self, outcome: str) -> None:
        """The current attempt is over: its engine's books released, its breaker told ``outcome``
        (engines.booking), and a request waiting for that engine's model given a try. The one way
        out of an attempt (a retry's, and the request's at its end); nothing happens when none is open."""
        booking = self.booking
        if booking is not None:
            self.booking = None
            booking.settle(outcome)
            share = self.share
            if share is not None:
                self.share = None
                self.director.shares.finished(share, self.ctx.tenant)
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

    def _refused(self, refusal: Refusal) -> None:
        if self.ctx.trace is not None:
            self.ctx.trace.stage_end(str(refusal.reason))
        error = self.director.error_for(refusal.reason, self.ctx.model, refusal.message)
        if refusal.headers:
            error.headers.extend(refusal.headers)
        self._fail(error)

    def _plugin_failed(self) -> None:
        self._fail(RouterError(500, "A routing plugin failed; see the router's log.", code="plugin_error"))

    def engine_name(self) -> str:
        """The engine of the current (or last) attempt, "none" before one was picked."""
        return self.engine.name if self.engine is not None else "none"
