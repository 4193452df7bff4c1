"""One proxied request, from the routing decision to the last byte, driven by socket callbacks.

No task and no coroutine on the common path: the client connection dispatches the parsed request,
the exchange picks an engine and writes the request on a pooled connection, and the upstream
connection's parser callbacks drive everything after (see :mod:`vllm_stack.relay.pool`). Each
upstream socket read ends in one :meth:`Exchange.on_read`, one write to the client.

Invariants (issue 3):
- bytes pass through unchanged (no decompression, no re-encoding); hop-by-hop headers are dropped
  both ways; ``X-Request-Id`` is generated when absent, sent upstream and returned;
- a retry happens only while nothing reached the client: on a failed connection, a response that
  broke before it was forwarded, or a 429/5xx status, on another engine; never after that;
- a non-streamed answer is held until complete (up to ``BUFFER_LIMIT``) so that a break in it is
  still retryable; a stream (SSE) is forwarded as it arrives, and a break ends it with an SSE error
  event, never a silent cut;
- a client that leaves closes the engine connection (the engine aborts the request); a client that
  reads slowly pauses reading from the engine, so memory stays bounded.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import TYPE_CHECKING

import httptools

from vllm_stack.api.errors import RouterError, sse_error_event
from vllm_stack.discovery.engine import Engine
from vllm_stack.metrics import _HistogramChild, _Value
from vllm_stack.relay.headers import HOP_BY_HOP, connection_listed
from vllm_stack.relay.pool import EnginePool, UpstreamConnectError, UpstreamConnection
from vllm_stack.scheduling.framework import RequestContext
from vllm_stack.server.http1 import HttpConnection, HttpRequest, status_line

if TYPE_CHECKING:
    from vllm_stack.app import Router

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
BUFFER_LIMIT = 1 << 20  # bytes of a non-streamed answer held back (and still retryable)
_NO_BODY_STATUS = frozenset({204, 304})
_HOP_BY_HOP_BUT_FRAMING = HOP_BY_HOP - {b"transfer-encoding"}
#: Any hop-by-hop header but the framing, in a lower-cased head (whose lines start after a CRLF).
_HOP_BY_HOP_HEADER = re.compile(
    rb"\r\n(?:" + b"|".join(re.escape(h) for h in sorted(_HOP_BY_HOP_BUT_FRAMING)) + rb")[ \t]*:"
)
_SSE = re.compile(rb"\r\ncontent-type:[ \t]*text/event-stream")
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[^\r]*chunked[ \t]*\r\n")


def _without_hop_by_hop(status: int, head: bytes, drop: frozenset[bytes]) -> bytes:
    """The head with a fresh HTTP/1.1 status line, minus the ``drop`` headers and those that its
    ``Connection`` header names (RFC 9110 7.6.1). The slow path: engines rarely send any."""
    lines = head.split(b"\r\n")[1:]
    fields = [(line.partition(b":")[0].strip().lower(), line) for line in lines if line]
    listed = connection_listed([(name, line.partition(b":")[2]) for name, line in fields])
    kept = [status_line(status)]
    kept += [line + b"\r\n" for name, line in fields if name not in drop and name not in listed]
    return b"".join(kept)


_CHUNK_END = b"0\r\n\r\n"
_NO_HISTOGRAM = _HistogramChild(())


class _BodyParts:
    """The parser callback of :class:`Dechunker`: an object apart, so the parser holds no cycle."""

    __slots__ = ("parts",)

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)


class Dechunker:
    """Chunked to plain body bytes, for the rare HTTP/1.0 client of an engine that answers chunked."""

    def __init__(self) -> None:
        sink = _BodyParts()
        self._parts = sink.parts
        self._parser = httptools.HttpResponseParser(sink)
        self._parser.feed_data(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")

    def feed(self, data: bytes) -> bytes:
        self._parser.feed_data(data)
        out = b"".join(self._parts)
        self._parts.clear()
        return out


class Exchange:
    """The state of one proxied request. Created and started by :func:`vllm_stack.api.proxied.handle`."""

    __slots__ = (
        "router",
        "conn",
        "request",
        "ctx",
        "request_id",
        "started",
        "model_label",
        "tail",
        "attempts_left",
        "timeout",
        "engine",
        "pool",
        "up",
        "gauge",
        "in_attempt",
        "reused",
        "resent",
        "connecting",
        "last_error",
        "status",
        "committed",
        "done",
        "keep_alive",
        "chunked",
        "sse",
        "close_delimited",
        "dechunker",
        "out",
        "held",
        "held_size",
        "head",
        "last_data",
        "itl",
        "last_event",
        "last_activity",
    )

    def __init__(
        self,
        router: Router,
        conn: HttpConnection,
        request: HttpRequest,
        ctx: RequestContext,
        request_id: bytes,
        tail: bytes,
        started: float,
    ) -> None:
        self.router = router
        self.conn = conn
        self.request = request
        self.ctx = ctx
        self.request_id = request_id
        self.started = started
        self.model_label = ctx.model
        self.tail = tail  # request headers, framing and body as sent upstream (same for every attempt)
        settings = router.proxy_settings
        self.attempts_left = 1 + settings.retries
        self.timeout = settings.request_timeout
        self.engine: Engine | None = None
        self.pool: EnginePool | None = None
        self.up: UpstreamConnection | None = None
        self.gauge: _Value | None = None
        self.in_attempt = False
        self.reused = False
        self.resent = False
        self.connecting: asyncio.Task[UpstreamConnection] | None = None
        self.last_error: RouterError | None = None
        self.status = "none"  # the outcome label of the request counter
        self.committed = False  # the answer is being forwarded: no retry, no error JSON any more
        self.done = False
        self.keep_alive = request.keep_alive
        self.chunked = False  # the engine's (and so our) body framing
        self.close_delimited = False
        self.dechunker: Dechunker | None = None
        self.sse = False
        self.out: list[bytes] = []
        self.held: list[bytes] = []
        self.held_size = 0
        self.head = b""
        self.last_data: bytes | None = None  # the last body bytes forwarded (where a stream may be ended)
        self.itl: _HistogramChild = _NO_HISTOGRAM  # the model's ITL child, once a stream is committed
        self.last_event = 0.0
        self.last_activity = time.perf_counter()

    # ---- attempts -------------------------------------------------------------------------------------
    def start(self) -> None:
        self.conn.handler = self
        self._attempt()

    def _attempt(self) -> None:
        if self.attempts_left <= 0:
            self._fail(self.last_error or RouterError(502, "No engine answered.", code="upstream_error"))
            return
        self.attempts_left -= 1
        router = self.router
        ctx = self.ctx
        candidates = router.registry.candidates(ctx.model)
        engine = router.scheduler.pick(ctx, candidates) if candidates else None
        if engine is None:
            self._fail(
                self.last_error
                or RouterError(
                    503,
                    f"No healthy engine is available for model '{ctx.model}'.",
                    code="no_healthy_engine",
                    headers=[(b"retry-after", b"1")],
                )
            )
            return
        self.engine = engine
        engine.breaker.acquire()
        engine.in_flight += 1
        gauge = self.gauge = router.metrics.in_flight_child(engine.name)
        gauge.inc()
        self.in_attempt = True
        pool = self.pool = router.pools.get(engine.url)
        up = pool.take()
        if up is None:
            self._connect(pool)
        else:
            self._send(up, reused=True)

    def _connect(self, pool: EnginePool) -> None:
        task = self.connecting = asyncio.get_running_loop().create_task(pool.connect())
        task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[UpstreamConnection]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if self.connecting is not task or self.done:  # the client left meanwhile
            if exc is None and self.pool is not None:
                self.pool.put(task.result())
            return
        self.connecting = None
        if exc is None:
            self._send(task.result(), reused=False)
            return
        if not isinstance(exc, UpstreamConnectError):
            log.error("connecting to %s failed unexpectedly", self._engine_name(), exc_info=exc)
        self._attempt_failed(f"Could not reach engine {self._engine_name()}: {exc}", "connect_error")

    def _send(self, up: UpstreamConnection, reused: bool) -> None:
        self.up = up
        self.reused = reused
        if self.conn.writing_paused:  # the client is still behind on an earlier answer: wait for it
            up.transport.pause_reading()
        pool = self.pool
        assert pool is not None
        request = self.request
        line = b"%s %s%s HTTP/1.1\r\nhost: %s\r\n" % (
            request.method.encode(),
            pool.path_prefix,
            request.target,
            pool.host_header,
        )
        up.send(self, line + self.tail)

    def _end_attempt(self) -> None:
        if self.in_attempt:
            self.in_attempt = False
            engine = self.engine
            assert engine is not None and self.gauge is not None
            engine.in_flight -= 1
            self.gauge.dec()

    def _attempt_failed(self, message: str, reason: str) -> None:
        """Nothing reached the client: try another engine, counting the failure as ``reason`` says.

        ``connect_error``: the engine could not be reached; it is ejected until healthy again.
        ``upstream_broken``: it began an answer and broke it; the breaker counts a failure.
        ``upstream_closed``: it took the request and closed without a byte of answer. That is what
        one poison request does on every engine, so it counts against the request, not the engine:
        no ejection, no breaker failure (an engine that really died refuses the next connect).
        """
        engine = self.engine
        assert engine is not None
        if reason == "connect_error":
            engine.breaker.failure()
            self.router.registry.eject(engine, reason)
            self.last_error = RouterError(502, message, code="upstream_unreachable")
        elif reason == "upstream_closed":
            engine.breaker.release()
            self.last_error = RouterError(502, message, code="upstream_closed")
        else:
            engine.breaker.failure()
            self.last_error = RouterError(502, message, code="upstream_broken")
        self.ctx.excluded.add(engine.name)
        self.status = "upstream_error"
        self._end_attempt()
        self._reset_response()
        if self.attempts_left > 0:
            self.router.metrics.retry(self.ctx.model, reason)
        self._attempt()

    def _other_candidate(self) -> bool:
        excluded = self.ctx.excluded
        return any(
            e.name not in excluded and e.breaker.available()
            for e in self.router.registry.candidates(self.ctx.model)
        )

    def _reset_response(self) -> None:
        self.out.clear()
        self.held.clear()
        self.held_size = 0
        self.head = b""
        self.sse = False
        self.chunked = False
        self.close_delimited = False
        self.dechunker = None

    # ---- upstream callbacks ------------------------------------------------------------------------------
    def on_head(self, status: int, head: bytes) -> None:
        """The engine answered: retry elsewhere (429/5xx while allowed) or prepare the client head."""
        engine = self.engine
        assert engine is not None
        if status in RETRYABLE_STATUS and self.attempts_left > 0:
            self.ctx.excluded.add(engine.name)
            if self._other_candidate():
                if status >= 500:
                    engine.breaker.failure()
                else:
                    engine.breaker.release()
                up = self.up
                self.up = None
                if up is not None:
                    up.abort()
                self._end_attempt()
                self.router.metrics.retry(self.ctx.model, str(status))
                self._attempt()
                return
        self.status = str(status)
        # The engine's head is forwarded as it is (one search instead of a loop over the headers)
        # unless it carries hop-by-hop headers or must be changed for an HTTP/1.0 client.
        lowered = head.lower()
        self.sse = _SSE.search(lowered) is not None
        self.chunked = _CHUNKED.search(lowered) is not None
        framed = self.chunked or status in _NO_BODY_STATUS or b"\r\ncontent-length:" in lowered
        if self.chunked and self.request.http_10:  # HTTP/1.0 cannot take chunks: plain body, then close
            self.dechunker = Dechunker()
            head = _without_hop_by_hop(status, head, HOP_BY_HOP)
        elif _HOP_BY_HOP_HEADER.search(lowered) is not None or not head.startswith(b"HTTP/1.1 "):
            head = _without_hop_by_hop(status, head, _HOP_BY_HOP_BUT_FRAMING)
        extra = []
        if b"\r\nx-request-id:" not in lowered:
            extra += (b"x-request-id: ", self.request_id, b"\r\n")
        if not framed or self.dechunker is not None:  # the body ends when the connection closes
            self.close_delimited = True
            self.keep_alive = False
        if not self.keep_alive or self.conn.server.draining:
            self.keep_alive = False
            extra.append(b"connection: close\r\n")
        extra.append(b"\r\n")
        self.head = head + b"".join(extra)
        if self.sse:
            self._commit()

    def _commit(self) -> None:
        """From here the answer is forwarded as it arrives; no retry and no error JSON any more."""
        self.committed = True
        if self.sse:
            self.itl = self.router.metrics.itl_child(self.model_label)
        self.out.append(self.head)
        if self.held:
            self.out += self.held
            self.held.clear()

    def on_read(self, data: bytes, complete: bool) -> None:
        """One upstream socket read (body bytes, framing included): forwarded in one write.

        This runs once per streamed token, so it is kept short: no lookups beyond the exchange.
        """
        now = time.perf_counter()
        self.last_activity = now
        if data:
            if self.dechunker is not None:
                data = self.dechunker.feed(data)
            if self.committed:
                self.out.append(data)
                self.last_data = data
                if self.sse:
                    events = data.count(b"\n\n")  # an SSE event ends with a blank line
                    if events:
                        self._observe_tokens(now, events)
            else:
                self.held.append(data)
                self.held_size += len(data)
                if self.held_size > BUFFER_LIMIT:
                    self._commit()
                    self.last_data = data
        if complete and not self.committed:
            self._commit()
        out = self.out
        if out:
            if not self.conn.closed:
                if len(out) == 1:
                    self.conn.transport.write(out[0])
                else:
                    self.conn.transport.writelines(out)
            out.clear()
        if complete:
            self._complete()

    def _observe_tokens(self, now: float, events: int) -> None:
        """TTFT at the first streamed event; an ITL sample per event (events read together: gap 0)."""
        if self.last_event:
            self.itl.observe(now - self.last_event)
        else:
            self.router.metrics.observe_ttft(self.model_label, now - self.started)
        if events > 1:
            self.itl.observe_zeros(events - 1)
        self.last_event = now

    def _complete(self) -> None:
        if self.done:
            return
        self.done = True
        up = self.up
        self.up = None
        if up is not None:
            up.release()
        engine = self.engine
        assert engine is not None
        if self.status[0] == "5":
            engine.breaker.failure()
        else:
            engine.breaker.success()
        self._end_attempt()
        self.conn.finish(self.keep_alive)
        self._account()

    def upstream_failed(self, up: UpstreamConnection, error: BaseException) -> None:
        if self.done or up is not self.up:
            return
        self.up = None
        if self.close_delimited and up.head_done and isinstance(error, ConnectionError | type(None)):
            self.on_read(b"", True)  # a close-delimited body ends with the connection
            return
        if not self.committed:
            if self.reused and not up.got_bytes and not self.resent:
                # An idle connection the engine closed just as it was reused: the request never
                # reached the engine, so it is sent again on a fresh connection, without penalty.
                self.resent = True
                assert self.pool is not None
                self._connect(self.pool)
                return
            name = self._engine_name()
            if up.got_bytes:
                self._attempt_failed(f"Engine {name} broke the response: {error}", "upstream_broken")
            else:
                self._attempt_failed(
                    f"Engine {name} closed the connection without answering: {error}", "upstream_closed"
                )
            return
        self._broken_midway(f"engine {self._engine_name()} failed mid-stream", error)

    def _broken_midway(self, message: str, error: BaseException | str) -> None:
        """The answer was being forwarded: end an SSE stream with an error event, else cut the connection."""
        engine = self.engine
        assert engine is not None
        engine.breaker.failure()
        self.status = "upstream_error"
        log.warning("upstream %s broke mid-response: %s", engine.name, error)
        self.done = True
        self._end_attempt()
        conn = self.conn
        # An event can be appended only where the engine's framing left off cleanly: after a whole
        # chunk that ended an SSE event (vLLM writes one event per chunk), or right after the head.
        at_boundary = self.last_data is None or self.last_data.endswith(b"\n\n\r\n")
        if self.sse and self.chunked and self.dechunker is None and at_boundary and not conn.closed:
            event = sse_error_event(message)
            conn.transport.write(b"%x\r\n%b\r\n%b" % (len(event), event, _CHUNK_END))
            conn.finish(self.keep_alive)
        elif self.sse and self.close_delimited and not conn.closed:
            conn.transport.write(sse_error_event(message))
            conn.close()
            conn.finish(False)
        else:  # a body cut short: closing is the only honest signal left in HTTP/1.1
            conn.close()
            conn.finish(False)
        self._account()

    # ---- the client side ---------------------------------------------------------------------------------
    def client_lost(self) -> None:
        if self.done:
            return
        self.done = True
        self.status = "client_closed"
        if self.connecting is not None:
            self.connecting.cancel()
            self.connecting = None
        up = self.up
        self.up = None
        if up is not None:
            up.abort()  # the engine sees the connection close and aborts the request
        if self.in_attempt and self.engine is not None:
            self.engine.breaker.release()
        self._end_attempt()
        self._account()

    def pause(self) -> None:
        if self.up is not None and not self.up.closed:
            self.up.transport.pause_reading()

    def resume(self) -> None:
        if self.up is not None and not self.up.closed:
            self.up.transport.resume_reading()

    # ---- endings ---------------------------------------------------------------------------------------
    def check_timeout(self, now: float) -> None:
        """Called by the server's sweep (``now`` from time.perf_counter): an engine silent for
        ``request_timeout`` fails the request.

        A sweep over the busy connections instead of a timer per request: arming and cancelling a
        timer for every request costs more than the whole check once a second.
        """
        if self.done or now - self.last_activity < self.timeout:
            return
        up = self.up
        self.up = None
        if up is not None:
            up.abort()
        if self.connecting is not None:
            self.connecting.cancel()
            self.connecting = None
        if self.committed:
            self._broken_midway(f"engine {self._engine_name()} went silent", "read timeout")
            return
        if self.engine is not None and self.in_attempt:
            self.engine.breaker.failure()
        self._end_attempt()
        self._fail(
            RouterError(
                504,
                f"Engine {self._engine_name()} did not answer within {self.timeout:g}s.",
                code="upstream_timeout",
            )
        )

    def _fail(self, error: RouterError) -> None:
        """Answer with an error of the router's own (only while nothing was forwarded)."""
        if self.done:
            return
        self.done = True
        self.status = str(error.status)
        self.conn.send_error(error, self.request_id, self.keep_alive)
        self._account()

    def _engine_name(self) -> str:
        return self.engine.name if self.engine is not None else "none"

    def _account(self) -> None:
        router = self.router
        duration = time.perf_counter() - self.started
        router.metrics.observe_request(self.model_label, self._engine_name(), self.status, duration)
        if router.config.access_log:
            request = self.request
            log.info(
                "%s %s -> %s %s %.1f ms",
                request.method,
                request.path,
                self.status,
                self._engine_name(),
                duration * 1e3,
            )
