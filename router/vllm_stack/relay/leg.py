"""One relay leg: one upstream HTTP exchange's bytes, from the request write to the last byte.

The director (:mod:`vllm_stack.director`) decides where a request goes, retries and keeps the
breaker's books; a leg only moves bytes and reports how its exchange ended to its
:class:`LegOwner`. No task and no coroutine on the common path: the leg writes the request on a
pooled connection and the upstream connection's parser callbacks drive everything after (see
:mod:`vllm_stack.relay.pool`). Each upstream socket read ends in one :meth:`Leg.on_read`, one write
to the client.

Invariants:
- bytes pass through unchanged (no decompression, no re-encoding); hop-by-hop headers are dropped;
  ``X-Request-Id`` is returned (the director set it upstream);
- nothing reaches the client before the leg *commits*: until then a failure or a retryable status
  is reported to the owner, which may run another leg elsewhere; never after that;
- a non-streamed answer is held until complete (up to ``BUFFER_LIMIT``) so that a break in it is
  still retryable; a stream (SSE) is forwarded as it arrives, and a break ends it with an SSE error
  event, never a silent cut;
- a client that reads slowly pauses reading from the engine, so memory stays bounded;
- bytes an engine sends after its answer's framing ended (a second answer in the same write) never
  reach the client: only the answer's part of that read is forwarded (:meth:`Leg._framed_part`),
  or, where that part cannot be told, the answer is broken off; that upstream connection is closed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, Protocol

import httptools

from vllm_stack.errors import sse_error_event, status_line
from vllm_stack.metrics import RouterMetrics, _HistogramChild
from vllm_stack.relay.headers import HOP_BY_HOP, connection_listed
from vllm_stack.relay.pool import EnginePool, PooledExchange, UpstreamConnectError, UpstreamConnection
from vllm_stack.relay.sse import Dechunker, dechunked, engine_gave_up, sse_payloads
from vllm_stack.server.http1 import HttpConnection, HttpRequest

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
#: Offered to the owner too: an engine that lost a LoRA adapter (restarted, or another router
#: replica unloaded it) answers 404 for it, and the owner may load it again and retry.
NOT_FOUND = 404
BUFFER_LIMIT = 1 << 20  # bytes of a non-streamed answer held back (and still retryable)
ANSWER_END_BYTES = 2048  # kept for a plugin that asked (vLLM's usage object fits, with room)
#: Bytes of a stream kept so that another engine can continue it should its engine break (Leg.kept);
#: a longer stream is not continued (about 4,000 tokens of vLLM's chat events). Its size is added up every
#: 64 reads, not per read (one token each): past the limit by at most 63 reads' bytes, then released.
KEEP_LIMIT = 1 << 20
KEEP_CHECK = 63  # a mask: reads 64, 128, ...
#: Where an engine's give-up event is looked for: an error event (``data: {"error"``) that opens a read of
#: a chunked stream, as vLLM writes it (one event per chunk, sent when its engine core died). Its first
#: key's first letter is byte 12 of the read (a chunk size of 2 hex digits, "\r\n", 'data: {"') or byte
#: 13 (3 digits, byte 12 then a quote); a token event's is the "i" of "id". Two byte reads per token read;
#: searching each read for the event instead costs ~5,500 instructions (two byte searches: callgrind,
#: +17% on a read per token). An error event that shares a read with events before it is not seen.
_KEY_AT, _E, _QUOTE = 12, ord("e"), ord('"')
_NO_BODY_STATUS = frozenset({204, 304})
_HOP_BY_HOP_BUT_FRAMING = HOP_BY_HOP - {b"transfer-encoding"}
#: Any hop-by-hop header but the framing, in a lower-cased head (whose lines start after a CRLF).
_HOP_BY_HOP_HEADER = re.compile(
    rb"\r\n(?:" + b"|".join(re.escape(h) for h in sorted(_HOP_BY_HOP_BUT_FRAMING)) + rb")[ \t]*:"
)
_SSE = re.compile(rb"\r\ncontent-type:[ \t]*text/event-stream")
_CHUNKED = re.compile(rb"\r\ntransfer-encoding:[^\r]*chunked[ \t]*\r\n")
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]+)[ \t]*\r\n")


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
_CR_LF = b"\r\n"  # the bytes the upstream parser skips after an answer without a word (see on_read)
_NO_HISTOGRAM = _HistogramChild(())


class _Ended:
    """Parser callback of :func:`chunked_end`: whether the message ended."""

    __slots__ = ("ended",)

    def __init__(self) -> None:
        self.ended = False

    def on_message_complete(self) -> None:
        self.ended = True


def _ends(body: bytes) -> bool:
    sink = _Ended()
    try:
        httptools.HttpResponseParser(sink).feed_data(_CHUNKED_HEAD + body)
    except httptools.HttpParserError:
        pass  # what follows the end (after ``ended``), or no chunked body at all
    return sink.ended


_CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def chunked_end_before_crlf(prior: bytes, data: bytes) -> int | None:
    """Where in ``data`` a chunked body ends that nothing but CR and LF bytes follow, or None when that
    cannot be told. Such a body ends with its last line (the last chunk's, or a trailer field's) and an
    empty one: one non-CR/LF byte, then exactly CRLF CRLF; what follows that is past the answer.
    ``prior``: the bytes read before ``data`` (their last four can hold part of that CRLF CRLF)."""
    tail = prior[-4:] + data
    run = len(tail) - len(tail.rstrip(_CR_LF))
    past = run - 4
    if run == len(tail) or not 0 <= past <= len(data):
        return None
    return len(data) - past


def chunked_end(body: bytes) -> int | None:
    """Where the chunked body that ``body`` starts with ends (its last chunk and trailer section
    included), or None when it does not end in ``body``.

    Only for the rare read that carried bytes past an answer (the upstream parser does not say where
    a message ended): a binary search over prefixes, each parsed afresh (the end is the shortest
    prefix that is a whole message)."""
    if not _ends(body):
        return None
    low, high = 1, len(body)
    while low < high:
        middle = (low + high) // 2
        if _ends(body[:middle]):
            high = middle
        else:
            low = middle + 1
    return low


class LegRequest(Protocol):
    """What a leg reads of its request's context (the scheduling layer's ``RequestContext``, a peer
    of this layer, so named here by what is read): not copied per leg."""

    request_id: bytes
    model_label: str
    arrived: float  # time.perf_counter() at the request's arrival (TTFT counts from here)
    trace: Any  # with tracing on, its spans; ``trace.trace_id`` marks the TTFT exemplar

    def log_ref(self) -> str:
        """The request in a log line (its id, and its trace id when the trace is kept)."""
        ...


class LegOwner(Protocol):
    """What a leg reports to (the director's request). Each leg ends in exactly one of
    :meth:`leg_complete`, :meth:`leg_failed`, :meth:`leg_broken`, or an abort by the owner."""

    ctx: LegRequest

    def engine_name(self) -> str: ...

    def first_token(self) -> None:
        """The first streamed event arrived: the engine has prefilled the prompt."""
        ...

    def retry_on_status(self, leg: Leg, status: int) -> bool:
        """A retryable status (or a 404) arrived before anything was forwarded: True when the owner
        runs another leg (this one aborts its exchange and reports nothing more)."""
        ...

    def leg_failed(self, leg: Leg, message: str, reason: str) -> None:
        """Nothing reached the client: ``connect_error``, ``upstream_broken`` or ``upstream_closed``."""
        ...

    def leg_complete(self, leg: Leg) -> None:
        """The answer was forwarded whole; the upstream connection is back in its pool."""
        ...

    def leg_broken(self, leg: Leg, error: BaseException | str) -> None:
        """The answer broke after it was committed; the leg ended the client's answer as HTTP allows."""
        ...

    def keeps_stream(self) -> bool:
        """A stream is committed: whether to keep its bytes (:attr:`Leg.kept`) for a continuation."""
        ...

    def continue_stream(self, leg: Leg, error: BaseException | str) -> bool:
        """The engine broke a kept stream: True when the owner continues it on another engine (the leg
        ends and reports nothing more), False to break it off."""
        ...

    def continuation_refused(self, leg: Leg, message: str) -> None:
        """A continuation's engine answered with an error; the leg ended the client's stream with it."""
        ...


class Leg(PooledExchange):
    """One upstream exchange of a proxied request, and its forwarding to the client."""

    __slots__ = (
        "owner",
        "conn",
        "request",
        "metrics",
        "status",
        "committed",
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
        "ttft",
        "last_activity",
        "upstream_request",
        "answer_end",
        "kept",
        "kept_size",
    )

    def __init__(
        self,
        owner: LegOwner,
        conn: HttpConnection,
        request: HttpRequest,
        pool: EnginePool,
        metrics: RouterMetrics,
        upstream_request: bytes,
    ) -> None:
        """Create the leg and send ``upstream_request`` (request line, host and everything after) on
        a pooled connection, or on a new one once connected (no callback reaches the owner before
        this returns)."""
        self.owner = owner
        self.conn = conn
        self.request = request
        self.pool = pool
        self.metrics = metrics
        self.up: UpstreamConnection | None = None
        self.reused = False
        self.resent = False
        self.connecting: asyncio.Task[UpstreamConnection] | None = None
        self.status = 0  # the engine's status, once its head arrived
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
        self.ttft: float | None = None
        self.last_activity = time.perf_counter()
        self.upstream_request = upstream_request
        self.answer_end: bytes | None = None  # b"" when the owner wants the answer's last bytes kept
        # A stream's bytes as forwarded, while another engine could continue it (None: not kept)
        self.kept: list[bytes] | None = None
        self.kept_size = 0
        up = pool.take()
        if up is None:
            self._connect()
            return
        # _send, inlined for the common case (a pooled connection): one call less per request.
        self.up = up
        self.reused = True
        if conn.writing_paused:
            up.transport.pause_reading()
        up.send(self, upstream_request)

    # ---- sending (the connection's life: PooledExchange) --------------------------------------------------
    def connect_failed(self, error: BaseException) -> None:
        if not isinstance(error, UpstreamConnectError):
            log.error(
                "connecting to %s failed unexpectedly (%s)",
                self.owner.engine_name(),
                self.owner.ctx.log_ref(),
                exc_info=error,
            )
        self.owner.leg_failed(
            self, f"Could not reach engine {self.owner.engine_name()}: {error}", "connect_error"
        )

    def _send(self, up: UpstreamConnection, reused: bool) -> None:
        self.up = up
        self.reused = reused
        if self.conn.writing_paused:  # the client is still behind on an earlier answer: wait for it
            up.transport.pause_reading()
        up.send(self, self.upstream_request)

    def silent_for(self, now: float) -> float:
        """Seconds since the engine last sent anything (or since the leg started)."""
        return now - self.last_activity

    # ---- upstream callbacks ------------------------------------------------------------------------------
    def on_head(self, status: int, head: bytes) -> None:
        """The engine answered: offer a retryable status to the owner, else prepare the client head."""
        if (status in RETRYABLE_STATUS or status == NOT_FOUND) and self.owner.retry_on_status(self, status):
            self.abort()
            return
        self.status = status
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
        ctx = self.owner.ctx
        if b"\r\nx-request-id:" not in lowered:
            extra += (b"x-request-id: ", ctx.request_id, b"\r\n")
        if ctx.response_headers:  # e.g. the tenant's x-ratelimit-* (vllm_stack.director.rate_gate)
            extra.append(ctx.response_headers)
        route = self.owner.route
        if route is not None:
            extra += (b"x-vllm-stack-route: ", route, b"\r\n")
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
            self.itl = self.metrics.itl_child(self.owner.ctx.model_label)
            if self.owner.keeps_stream():
                self.kept = []
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
        # The engine sent more than its answer (overrun), or maybe CR or LF bytes after it, which the
        # upstream parser skips without a word: a chunked answer's own last bytes unless it is the
        # usual last chunk, a plain one's only if its body ends so.
        if (
            complete
            and data
            and self.up is not None
            and (self.up.overrun or (not data.endswith(_CHUNK_END) if self.chunked else data[-1] in _CR_LF))
        ):
            data = self._answer_part(data, self.up)
            if data is None:
                return
        if data:
            if self.dechunker is not None:
                data = self.dechunker.feed(data)
            if self.answer_end is not None:
                self.answer_end = (self.answer_end + data)[-ANSWER_END_BYTES:]
            if self.committed:
                kept = self.kept  # a stream another engine could continue
                # An error event opening the read (its first key's letter, after a chunk size of 2 or 3
                # hex digits and "data: {"), where vLLM writes it (a read of its own): see _KEY_AT
                if kept is not None:
                    try:
                        key = data[_KEY_AT]
                    except IndexError:  # a short read: the body's last chunk, a part of an event
                        key = 0
                    if (
                        key == _E or (key == _QUOTE and data[_KEY_AT + 1 : _KEY_AT + 2] == b"e")
                    ) and self._engine_gave_up(data):
                        return  # continued on another engine
                self.out.append(data)
                self.last_data = data
                if self.sse:
                    if kept is not None:  # for a continuation; its size checked every KEEP_CHECK reads
                        kept.append(data)
                        if not len(kept) & KEEP_CHECK:
                            self._bound_kept(kept)
                    events = data.count(b"\n\n")  # an SSE event ends with a blank line
                    if events:
                        self._observe_tokens(now, events)
                else:  # where a plain answer ends, should bytes follow it (see _framed_part)
                    self.held_size += len(data)
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
        if complete and not self.done:  # the answer is whole: the connection goes back to its pool
            self.done = True
            up = self.up
            self.up = None
            if up is not None:
                up.release()
            self.owner.leg_complete(self)

    def _answer_part(self, data: bytes, up: UpstreamConnection) -> bytes | None:
        """Of the read that ended the answer, the answer's own part; whatever followed it is not the
        client's, and the connection that carried it is not pooled (a client such as h11 fails its
        next request on a stray CRLF). None when the leg ended instead: bytes past the answer whose
        place cannot be told. Where only CR and LF may have followed and that cannot be told either,
        the read is forwarded whole, as the engine framed it, and the connection closed after it."""
        part = self._framed_part(data, up.overrun)
        if part is None:
            if up.overrun:
                self._unframed()
                return None
            up.keep_alive = False
            return data
        if len(part) < len(data):
            up.keep_alive = False
        return part

    def _framed_part(self, data: bytes, overrun: bool) -> bytes | None:
        """Of the read that ended the answer, the answer's part: up to its Content-Length (counted
        from the bytes held or forwarded before, but a stream's), or to the end of its last chunk
        (found from the bytes held, or from this read alone once some were forwarded; or, when only
        CR and LF can follow it (not ``overrun``), from its last bytes). None when that cannot be told."""
        if self.status in _NO_BODY_STATUS:
            return b""
        if not self.chunked:
            match = _CONTENT_LENGTH.search(self.head.lower())
            if match is None or (self.committed and self.sse):  # a stream's bytes are not counted
                return None
            rest = int(match.group(1)) - self.held_size
            return data[:rest] if 0 <= rest <= len(data) else None
        if not overrun:
            if self.dechunker is not None:  # (it drops what follows the last chunk itself)
                return None
            end = chunked_end_before_crlf(
                (self.last_data or b"") if self.committed else b"".join(self.held)[-4:], data
            )
            return None if end is None else data[:end]
        prior = b"" if self.committed else b"".join(self.held)
        end = chunked_end(prior + data)
        return data[: end - len(prior)] if end is not None and end >= len(prior) else None

    def _unframed(self) -> None:
        """The engine sent more than its answer and where the answer ends cannot be told."""
        message = f"engine {self.owner.engine_name()} sent bytes past the end of its answer"
        if self.committed:
            self.break_midway(message, message)
            return
        self.abort()
        self.owner.leg_failed(self, message, "upstream_broken")

    def _observe_tokens(self, now: float, events: int) -> None:
        """TTFT at the first streamed event; an ITL sample per event (events read together: gap 0)."""
        if self.last_event:
            self.itl.observe(now - self.last_event)
        else:
            owner = self.owner
            ctx = owner.ctx
            ttft = self.ttft = now - ctx.arrived
            trace = ctx.trace
            if trace is not None and trace.trace_id:
                self.metrics.observe_ttft_traced(ctx.model_label, ttft, trace.trace_id)
            else:
                self.metrics.observe_ttft(ctx.model_label, ttft)
            owner.first_token()
        if events > 1:
            self.itl.observe_zeros(events - 1)
        self.last_event = now

    def upstream_failed(self, up: UpstreamConnection, error: BaseException) -> None:
        if self.done or up is not self.up:
            return
        self.up = None
        if self.close_delimited and up.head_done and isinstance(error, ConnectionError | type(None)):
            self.on_read(b"", True)  # a close-delimited body ends with the connection
            return
        if not self.committed:
            if self.resend_if_stale(up):
                return
            self.done = True
            name = self.owner.engine_name()
            if up.got_bytes:
                self.owner.leg_failed(self, f"Engine {name} broke the response: {error}", "upstream_broken")
            else:
                self.owner.leg_failed(
                    self, f"Engine {name} closed the connection without answering: {error}", "upstream_closed"
                )
            return
        if (self.kept is not None or self.kept_size) and self.owner.continue_stream(self, error):
            return
        self.break_midway(f"engine {self.owner.engine_name()} failed mid-stream", error)

    def _engine_gave_up(self, data: bytes) -> bool:
        """Whether the event that opens this read of a kept stream is the engine giving the stream up (an
        error event of its own: :func:`~vllm_stack.relay.sse.engine_gave_up`), as vLLM's is when its engine
        core dies (also when a container's SIGTERM stops it), and the owner continued the stream on another
        engine as it does a broken one; that event and what follows it are then not forwarded. A read
        that does not open with a whole event (the stream stands mid-event) is not continued: the owner
        checks where the client's stream stands."""
        payloads, _ = sse_payloads(dechunked(data) if self.chunked and self.dechunker is None else data)
        reason = engine_gave_up(payloads[0]) if payloads else None
        return reason is not None and self.owner.continue_stream(
            self, f"engine {self.owner.engine_name()} gave up the stream: {reason}"
        )

    def _bound_kept(self, kept: list[bytes]) -> None:
        """The kept bytes past :data:`KEEP_LIMIT`: let them go (this stream will not be continued)."""
        self.kept_size = sum(map(len, kept))
        if self.kept_size > KEEP_LIMIT:
            self.kept = None

    def at_event_boundary(self) -> bool:
        """Whether the client's stream stands after a whole event (nothing, or the end of one)."""
        last = self.last_data
        if last is None:
            return True
        if self.chunked and self.dechunker is None:
            return last.endswith(b"\n\n\r\n")
        return last.endswith(b"\n\n")

    def break_midway(self, message: str, error: BaseException | str) -> None:
        """The answer was being forwarded and cannot go on: end an SSE stream with an error event,
        else cut the connection (the only honest signal left in HTTP/1.1); then tell the owner."""
        log.warning(
            "upstream %s broke mid-response: %s (%s)",
            self.owner.engine_name(),
            error,
            self.owner.ctx.log_ref(),
        )
        self.end_stream(sse_error_event(message))
        self.owner.leg_broken(self, error)

    def end_stream(self, event: bytes) -> None:
        """Stop the exchange (the engine aborts its request) and end the client's answer with ``event``
        where its framing allows (an SSE stream), else cut the connection. The owner is not told: the
        caller says how the request ended (a break, an eviction)."""
        self.abort()
        conn = self.conn
        # An event can be appended only where the engine's framing left off cleanly: after a whole
        # chunk that ended an SSE event (vLLM writes one event per chunk), or right after the head.
        at_boundary = self.last_data is None or self.last_data.endswith(b"\n\n\r\n")
        if self.sse and self.chunked and self.dechunker is None and at_boundary and not conn.closed:
            conn.transport.write(b"%x\r\n%b\r\n%b" % (len(event), event, _CHUNK_END))
        elif self.sse and self.close_delimited and not conn.closed:
            conn.transport.write(event)
            conn.close()
            self.keep_alive = False
        else:
            conn.close()
            self.keep_alive = False

    # ---- the client's pace ---------------------------------------------------------------------------
    def pause(self) -> None:
        if self.up is not None and not self.up.closed:
            self.up.transport.pause_reading()

    def resume(self) -> None:
        if self.up is not None and not self.up.closed:
            self.up.transport.resume_reading()
