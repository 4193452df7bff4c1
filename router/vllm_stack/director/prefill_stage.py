"""One request's prefill stage in disaggregated serving: decide, run the prefill leg, hand over.

:meth:`PrefillStage.begin` runs at a request's first scheduling, for a model with prefill engines and
a body that is a JSON object without ``kv_transfer_params`` of its own. Its decisions are
scheduling's, in llm-d's order (:mod:`vllm_stack.scheduling.disaggregation`): the decode engine
first where the prefill request must name it (``lmcache``), then the decider, and only when it says
so the ``prefill`` profile's pick. A request served decode-only never ran that pick, so nothing was
claimed or booked on the prefill pool for it. A prefill engine picked, the stage books it
(in-flight count, prefill tokens, breaker) and sends the prefill leg
(:class:`~.disagg.PrefillExchange`). How it ends:

- ``vllm`` protocol: the prefill answer's ``kv_transfer_params`` go into the decode request, which
  the strategy's own profile schedules (the decode engine pulls the KV from the prefill engine);
- ``lmcache`` protocol: the decode engine is chosen first (the prefill request's ``disagg_spec``
  names its LMCache receiver), and once the prefill engine answered and its LMCache notified the
  router (:mod:`.pd_notify`; at most ``notify_timeout`` later) the client's own request goes there;
- a prefill leg that fails (no answer, a non-200, not JSON, silent past the request timeout) is
  settled on the prefill engine's breaker and the request is served decode-only; nothing reached
  the client, so this is never visible to it but in the latency;
- a client that leaves ends the prefill leg (its connection is closed: the engine aborts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from vllm_stack.director import disagg
from vllm_stack.engines.booking import FAILURE, RELEASED, SUCCESS, EngineBooking
from vllm_stack.engines.engine import Engine
from vllm_stack.request_id import new_request_id

if TYPE_CHECKING:
    from vllm_stack.director.director import Director
    from vllm_stack.scheduling.framework import RequestContext
    from vllm_stack.server.http1 import HttpRequest

log = logging.getLogger(__name__)


class DisaggregatedRequest(Protocol):
    """What the prefill stage reads of its request (:class:`~.request.ProxiedRequest`, which imports
    this module: named here by what is read, so the import runs one way)."""

    director: Director
    ctx: RequestContext
    request: HttpRequest  # the client's request line (method, target) for the prefill leg's
    tail: bytes  # headers, framing and body as sent upstream; the vllm hand-over rewrites its body

    pd: PrefillStage | None  # the stage while it runs

    def resume_after_prefill(self, engine: Engine | None) -> None:
        """The stage is over: decode on ``engine`` (lmcache: where the KV was sent), or schedule."""
        ...

    def schedule_decode(self) -> Engine | None:
        """Schedule the request as any (its decode engine), noting the decision; None: no engine now."""
        ...

    def start_decode(self, engine: Engine) -> None:
        """Serve the request whole (decode-only) on ``engine``, which :meth:`schedule_decode` chose."""
        ...


class PrefillStage:
    """The prefill leg of one request and what it booked (see the module docstring)."""

    __slots__ = (
        "owner",
        "settings",
        "request",
        "engine",
        "tokens",
        "booking",
        "exchange",
        "decode",
        "req_id",
        "timer",
    )

    def __init__(
        self,
        owner: DisaggregatedRequest,
        settings: disagg.DisaggSettings,
        request: dict[str, Any],
        engine: Engine,
        tokens: int,
        decode: Engine | None,
    ) -> None:
        self.owner = owner
        self.settings = settings
        self.request = request  # the client's body, parsed once for both legs
        self.engine = engine  # the prefill engine
        self.tokens = tokens  # the prompt tokens it is expected to prefill
        self.booking: EngineBooking | None = None  # what the prefill leg holds on it while it runs
        self.exchange: disagg.PrefillExchange | None = None
        self.decode = decode  # lmcache: the decode engine the KV is sent to
        self.req_id = ""  # lmcache: the disagg_spec's id, which its notification carries
        self.timer: asyncio.TimerHandle | None = None  # lmcache: the wait for the notification

    @classmethod
    def begin(cls, owner: DisaggregatedRequest) -> bool:
        """Run the stage's decisions (decode, decider, prefill: see the module docstring); True when the
        request is under way (its prefill leg sent, ``owner.pd`` set; or, lmcache, served decode-only
        on the decode engine already chosen), False to schedule it as any request."""
        director = owner.director
        ctx = owner.ctx
        settings = director.settings.disagg
        candidates = director.registry.prefill_candidates(ctx.pool or ctx.model)
        if settings is None or not candidates:
            return False
        metrics = director.metrics
        label = ctx.model_label
        disaggregation = director.scheduler.disaggregation
        if disaggregation is None:  # a scheduling configuration of the user's without a prefill profile
            metrics.disagg(label, "no_prefill_profile")
            return False
        request = disagg.parse_body(ctx.body)
        if request is None or "kv_transfer_params" in request:
            metrics.disagg(label, "client_params" if request is not None else "not_json")
            return False
        decode = None
        if settings.protocol == "lmcache":  # the prefill request names the decode engine: it comes first
            if director.pd_notifications is None:
                metrics.disagg(label, "no_notifications")
                return False
            decode = owner.schedule_decode()
            if decode is None:  # none has room: the request waits for one as any request does
                metrics.disagg(label, "no_decode_engine")
                return False
        decode_tokens, ctx.prefill_tokens = ctx.prefill_tokens, 0
        trace = ctx.trace
        if trace is not None:
            trace.schedule_begin()
        pick = disaggregation.prefill_step(ctx, candidates)
        result = pick.result
        engine = result.engine if result is not None else None
        if trace is not None:
            if result is not None:
                trace.schedule_end(
                    result.profile, result.reason, engine and engine.name, ctx.predicted_cached
                )
            else:
                trace.schedule_end(disaggregation.prefill.name, pick.outcome, None, None)
        tokens, ctx.prefill_tokens = ctx.prefill_tokens, decode_tokens
        if engine is None:
            metrics.disagg(label, pick.outcome or "no_prefill_engine")
            if decode is not None:
                owner.start_decode(decode)
                return True
            return False
        stage = owner.pd = cls(owner, settings, request, engine, tokens, decode)
        stage._send()
        return True

    def _send(self) -> None:
        owner = self.owner
        director = owner.director
        ctx = owner.ctx
        engine = self.engine
        if self.decode is not None:
            self.req_id = new_request_id().decode()
            receiver = urlsplit(self.decode.url).hostname or ""
            params = disagg.lmcache_prefill_params(
                self.req_id, receiver, self.settings.receiver_init_port, self.settings.receiver_alloc_port
            )
        else:
            params = engine.kind.handover.prefill_request_params()
        pool = director.pools.get(engine.url)
        request = owner.request
        line = b"%s %s%s HTTP/1.1\r\nhost: %s\r\n" % (
            request.method.encode(),
            pool.path_prefix,
            request.target,
            pool.host_header,
        )
        body = disagg.prefill_body(self.request, params)
        self.booking = EngineBooking(engine, director.metrics.in_flight_child(engine.name), self.tokens)
        if ctx.trace is not None:  # the prefill leg's span, sent as its traceparent
            line += ctx.trace.leg_begin("prefill", engine.name, pool.host_header.decode("latin-1"))
        upstream = line + ctx.upstream_headers + disagg.with_body(owner.tail, ctx.body, body)
        self.exchange = disagg.PrefillExchange(self, pool, upstream)

    def _settle(self, outcome: str, status: int = 0, error: str = "") -> disagg.PrefillExchange:
        """The prefill leg is over: the prefill engine's books released, its breaker told ``outcome``,
        its span (tracing on) ended with the answer's ``status`` or the ``error``."""
        exchange = self.exchange
        assert exchange is not None and self.booking is not None
        self.exchange = None
        self.booking.settle(outcome)
        self.booking = None
        trace = self.owner.ctx.trace
        if trace is not None:
            trace.leg_end(status, error)
        metrics = self.owner.director.metrics
        metrics.observe_prefill(self.owner.ctx.model_label, time.perf_counter() - exchange.started)
        return exchange

    # ---- what the prefill leg reports (disagg.PrefillOwner) ------------------------------------------
    def prefill_answered(self, exchange: disagg.PrefillExchange, status: int, answer: bytes) -> None:
        if exchange is not self.exchange:
            return
        self._settle(FAILURE if status >= 500 else SUCCESS, status)
        engine = self.engine
        is_object, params = disagg.answer_params(answer) if status == 200 else (False, None)
        metrics = self.owner.director.metrics
        if not is_object:
            log.warning(
                "prefill engine %s answered %d; serving decode-only (%s)",
                engine.name,
                status,
                self.owner.ctx.log_ref(),
            )
            metrics.disagg(self.owner.ctx.model_label, "prefill_failed")
            self.owner.resume_after_prefill(None)
            return
        metrics.disagg(self.owner.ctx.model_label, "disaggregated")
        if self.decode is not None:  # lmcache: the KV goes to that engine; decode once it is there
            notifications = self.owner.director.pd_notifications
            assert notifications is not None
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(self.settings.notify_timeout, self._kv_late)
            notifications.expect(self.req_id, 1, self._kv_ready)
            return
        owner = self.owner
        body = disagg.decode_body(self.request, owner.ctx.body, params)
        if body is not owner.ctx.body:
            owner.tail = disagg.with_body(owner.tail, owner.ctx.body, body)
        owner.resume_after_prefill(None)

    def prefill_failed(self, exchange: disagg.PrefillExchange, message: str, reason: str) -> None:
        if exchange is not self.exchange:
            return
        director = self.owner.director
        if reason == "connect_error":
            director.registry.eject(self.engine, reason)
        self._settle(RELEASED if reason == "upstream_closed" else FAILURE, error=reason)
        log.warning("%s; serving decode-only (%s)", message, self.owner.ctx.log_ref())
        director.metrics.disagg(self.owner.ctx.model_label, "prefill_failed")
        self.owner.resume_after_prefill(None)

    # ---- lmcache: the notification ------------------------------------------------------------------
    def _kv_ready(self) -> None:
        if self.timer is None:  # it came after the wait ended (timed out, client gone)
            return
        self.timer.cancel()
        self.timer = None
        self.owner.resume_after_prefill(self.decode)

    def _kv_late(self) -> None:
        """No notification in time: decode anyway (LMCache recomputes what did not arrive)."""
        self.timer = None
        notifications = self.owner.director.pd_notifications
        if notifications is not None:
            notifications.forget(self.req_id)
        log.warning(
            "no PD notification for %s within %gs; decoding anyway", self.req_id, self.settings.notify_timeout
        )
        self.owner.director.metrics.disagg(self.owner.ctx.model_label, "notify_timeout")
        self.owner.resume_after_prefill(self.decode)

    # ---- the client side ------------------------------------------------------------------------------
    def cancel(self) -> None:
        """The client left: the prefill leg ends (its connection closes), the wait too."""
        exchange = self.exchange
        if exchange is not None:
            exchange.abort()
            self._settle(RELEASED, error="client_closed")
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
            notifications = self.owner.director.pd_notifications
            if notifications is not None:
                notifications.forget(self.req_id)

    def check_timeout(self, now: float, timeout: float) -> None:
        """The server's sweep: a prefill engine silent for the request timeout fails its leg."""
        exchange = self.exchange
        if exchange is not None and exchange.silent_for(now) >= timeout:
            exchange.abort()
            self.prefill_failed(exchange, f"The prefill engine was silent for {timeout:g}s", "timeout")
