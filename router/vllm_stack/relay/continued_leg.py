"""The leg that continues a broken stream on another engine, into the client's stream already open.

Unlike :class:`~vllm_stack.relay.leg.Leg`, which forwards the engine's bytes as they come, this leg
reads the engine's events and rewrites each (:meth:`StreamTranscript.rewrite`) before it writes it in the
client's framing: the client's head went out with the first engine's answer, so the engine's head is
never forwarded, nor its role event. Only a broken stream runs this path, so its cost does not matter
beside the plain relay's.

How it ends:
- the engine's answer ends: the client's chunked body ends with a trailer field,
  ``x-vllm-stack-continued: <continuations>`` (a close-delimited one, with the connection);
- a retryable status before any event: the owner may try another engine (as for any leg);
- another status, or an answer that is not a stream: the client's stream ends with an error event
  carrying the engine's words (:meth:`LegOwner.continuation_refused`);
- the engine breaks too: the owner may continue again (the transcript has every event forwarded).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httptools
import orjson

from vllm_stack.errors import sse_error_event
from vllm_stack.metrics import RouterMetrics
from vllm_stack.relay.leg import (
    _CHUNK_END,
    ANSWER_END_BYTES,
    BUFFER_LIMIT,
    RETRYABLE_STATUS,
    Leg,
    LegOwner,
)
from vllm_stack.relay.pool import EnginePool
from vllm_stack.relay.sse import GAVE_UP_MARKER, Dechunker, engine_gave_up, sse_payloads
from vllm_stack.relay.transcript import NotContinuable, StreamTranscript
from vllm_stack.server.http1 import HttpConnection, HttpRequest

CONTINUED_TRAILER = b"x-vllm-stack-continued"


def end_client_stream(conn: HttpConnection, event: bytes, chunked: bool) -> bool:
    """Write ``event`` as the last of the client's open stream, in its framing: a last chunk, or the bytes
    and then the connection's close. True when the connection stays open (chunked)."""
    if conn.closed:
        return False
    if chunked:
        conn.transport.write(b"%x\r\n%b\r\n%b" % (len(event), event, _CHUNK_END))
        return True
    conn.transport.write(event)
    conn.close()
    return False


class ContinuedLeg(Leg):
    """One continuation of a broken stream on another engine."""

    __slots__ = ("transcript", "client_chunked", "pending", "refused", "on_first_event")

    def __init__(
        self,
        owner: LegOwner,
        conn: HttpConnection,
        request: HttpRequest,
        pool: EnginePool,
        metrics: RouterMetrics,
        upstream_request: bytes,
        transcript: StreamTranscript,
        client_chunked: bool,
        keep_alive: bool,
        last_event: float,
        on_first_event: Callable[[float], None] | None,
    ) -> None:
        self.transcript = transcript
        self.client_chunked = client_chunked
        self.pending = b""  # the engine's bytes of an event not yet whole
        self.refused = False  # the engine answered with something else than a stream: its words are read
        self.on_first_event = on_first_event  # called once, with the time of the first event forwarded
        Leg.__init__(self, owner, conn, request, pool, metrics, upstream_request)
        self.keep_alive = keep_alive and client_chunked
        self.kept = []  # this leg can break and be continued in turn (the transcript holds its events)
        self.last_event = last_event  # the client's last event (the first ITL sample spans the break)

    def on_head(self, status: int, head: bytes) -> None:
        if status in RETRYABLE_STATUS and self.owner.retry_on_status(self, status):
            self.abort()
            return
        self.status = status
        lowered = head.lower()
        self.chunked = b"\r\ntransfer-encoding:" in lowered and b"chunked" in lowered
        if self.chunked:
            self.dechunker = Dechunker()
        self.sse = True  # the client's stream (whatever this engine answers)
        self.committed = True  # nothing of it is retried once its head is read: the client's head went out
        self.close_delimited = not self.chunked and b"\r\ncontent-length:" not in lowered
        self.refused = status != 200 or b"text/event-stream" not in lowered
        self.itl = self.metrics.itl_child(self.owner.ctx.model_label)

    def on_read(self, data: bytes, complete: bool) -> None:
        now = time.perf_counter()
        self.last_activity = now
        if self.dechunker is not None and data:
            try:
                data = self.dechunker.feed(data)
            except httptools.HttpParserError:  # bytes past the answer's last chunk: the answer's part
                data = b"".join(self.dechunker.parts())
                complete = True
                if self.up is not None:
                    self.up.keep_alive = False  # what followed is not ours: the connection is not pooled
        if self.refused:
            if self.held_size < BUFFER_LIMIT:
                self.held.append(data)
                self.held_size += len(data)
            if complete:
                self._refusal()
            return
        out = []
        if data:
            payloads, self.pending = sse_payloads(self.pending + data)
            for payload in payloads:
                if GAVE_UP_MARKER in payload and self._gave_up(payload, out, now):
                    return
                try:
                    rewritten = self.transcript.rewrite(payload)
                except (NotContinuable, orjson.JSONDecodeError) as exc:
                    self.break_midway(
                        f"engine {self.owner.engine_name()} continued the stream with {exc}", str(exc)
                    )
                    return
                if rewritten is not None:
                    out.append(b"data: " + rewritten + b"\n\n")
        if out:
            if self.on_first_event is not None:
                first, self.on_first_event = self.on_first_event, None
                first(now)
            self._observe_tokens(now, len(out))
            self._write(b"".join(out))
        if complete and not self.done:
            self.done = True
            up = self.up
            self.up = None
            if up is not None:
                if up.overrun:
                    up.keep_alive = False
                up.release()
            self._write_end()
            self.owner.leg_complete(self)

    def _gave_up(self, payload: bytes, out: list[bytes], now: float) -> bool:
        """This engine gave up the continuation with ``payload`` (:func:`engine_gave_up`): the events
        before it are written, and the owner may continue again on another engine (True)."""
        reason = engine_gave_up(payload)
        if reason is None:
            return False
        if out:
            self._observe_tokens(now, len(out))
            self._write(b"".join(out))
            out.clear()
        message = f"engine {self.owner.engine_name()} gave up the continued stream: {reason}"
        return self.owner.continue_stream(self, message)

    def _write(self, body: bytes) -> None:
        if self.answer_end is not None:
            self.answer_end = (self.answer_end + body)[-ANSWER_END_BYTES:]
        conn = self.conn
        if conn.closed:
            return
        framed = b"%x\r\n%b\r\n" % (len(body), body) if self.client_chunked else body
        conn.transport.write(framed)
        self.last_data = framed

    def _write_end(self) -> None:
        """The client's body ends: its last chunk with the trailer, or the connection's close."""
        conn = self.conn
        if conn.closed:
            return
        if self.client_chunked:
            count = b"%d" % self.transcript.continued
            conn.transport.write(b"0\r\n" + CONTINUED_TRAILER + b": " + count + b"\r\n\r\n")
        else:
            self.keep_alive = False

    def _refusal(self) -> None:
        """The engine answered the continuation with an error (or not with a stream): the client's stream
        ends with an error event that says so, in the engine's words."""
        self.done = True
        up = self.up
        self.up = None
        if up is not None:
            up.release()
        words = b"".join(self.held)[:500].decode("utf-8", "replace")
        message = f"engine {self.owner.engine_name()} refused to continue the stream ({self.status}): {words}"
        self.end_stream(sse_error_event(message))
        self.owner.continuation_refused(self, message)

    def at_event_boundary(self) -> bool:
        return True  # its writes are whole events

    def end_stream(self, event: bytes) -> None:
        """Stop the exchange and end the client's stream with ``event`` in its framing."""
        self.abort()
        if not end_client_stream(self.conn, event, self.client_chunked):
            self.keep_alive = False
