"""An engine's streamed answer read as events: chunked framing taken off, ``data:`` payloads, and the
events by which an engine says it gave up on a stream.

The relay forwards a stream's bytes as they come (:mod:`vllm_stack.relay.leg`); these helpers read them
only where a stream is continued on another engine or its framing must change, never per token.
"""

from __future__ import annotations

from typing import Any

import httptools
import orjson

DONE = b"[DONE]"
#: What an event of an engine that gave up on a stream holds, as JSON writes it: an ``error`` key (an
#: escaped quote inside a string never reads so). A cheap search comes first; :func:`engine_gave_up`
#: reads the event itself.
GAVE_UP_MARKER = b'"error":'


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

    def parts(self) -> list[bytes]:
        """The body bytes parsed before a feed that failed (what followed them was not a chunk)."""
        return self._parts


def dechunked(raw: bytes) -> bytes:
    """The body bytes of ``raw``, a chunked body as far as it went (an unfinished one too)."""
    dechunker = Dechunker()
    try:
        return dechunker.feed(raw)
    except httptools.HttpParserError:
        return b"".join(dechunker.parts())  # bytes past the last chunk: what came before them


def sse_payloads(body: bytes) -> tuple[list[bytes], bytes]:
    """The ``data:`` payloads of the whole SSE events in ``body`` and the bytes of an unfinished last
    event (vLLM writes one ``data:`` line per event; comments and other fields are skipped)."""
    *events, rest = body.replace(b"\r\n", b"\n").split(b"\n\n")
    payloads = []
    for event in events:
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                payloads.append(line[5:].strip())
    return payloads, rest


def engine_gave_up(payload: bytes) -> str | None:
    """Why the engine ended its stream with this event, where it gave up rather than finished: an error
    event of a server error (vLLM's engine core died: ``EngineDeadError``, code 500; a SIGTERM in a
    container ends a vLLM 0.32 stream so). None for any other event, and for an error of the request
    itself (a code below 500), which another engine would answer the same. (A choice finished ``abort``
    is an answer's end like another: it looks like every token event, and telling it apart would cost
    every one.)"""
    try:
        event: Any = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(event, dict):
        return None
    error = event.get("error")
    if error is None:
        return None
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, int) and code < 500:
        return None
    message = error.get("message") if isinstance(error, dict) else error
    return f"its error event: {str(message)[:200]}"
