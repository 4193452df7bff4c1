"""A request body handed to its handler as it arrives, for bodies too large to buffer (batch file uploads:
OpenAI allows 200 MB input files, the router buffers at most ``max_body_bytes`` of a request).

The connection feeds what it reads; the handler takes it with :meth:`BodyStream.read` (through ASGI's
``receive``). At most :data:`WINDOW` bytes wait between the two: past it the connection stops reading the
socket until the handler has taken half of them, so a client that sends faster than the handler writes to
disk is slowed by TCP, and what the router holds per upload is bounded (the window is reserved from the
server's buffer budget for the whole request). A body past its limit, a client silent for the server's
body timeout (``request_body_timeout``, the same as for a buffered body) or a malformed chunk ends the
stream with an error the handler's next read raises.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Protocol

from vllm_stack.errors import RouterError

WINDOW = 1024 * 1024  # bytes read from the socket but not yet taken by the handler, at most (about)
READ_CHUNK = 256 * 1024  # read() joins waiting pieces up to about this many bytes
HANDLER_BYTES = 64 * 1024  # what a handler may keep of its own beside the piece it reads (a form's fields)
#: What a streamed body holds from the server's buffer budget for its whole request: the window, the
#: piece its handler has taken and works on, and the handler's own bytes.
STREAM_HOLD = WINDOW + READ_CHUNK + HANDLER_BYTES


class ReadingTransport(Protocol):
    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class BodyStream:
    """The body of one request, between the connection (:meth:`feed`, :meth:`end`, :meth:`abort`,
    :meth:`lost`) and its handler (:meth:`read`)."""

    __slots__ = (
        "_transport",
        "limit",
        "received",
        "_pieces",
        "_buffered",
        "paused",
        "ended",
        "_error",
        "_lost",
        "_waiter",
        "last_data",
        "idle_timeout",
    )

    def __init__(self, transport: ReadingTransport, limit: int, idle_timeout: float) -> None:
        self._transport = transport
        self.limit = limit
        self.idle_timeout = idle_timeout  # seconds without a byte before the body is answered 408
        self.received = 0
        self._pieces: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self.paused = False  # this stream paused the socket's reading
        self.ended = False  # the body's last byte arrived
        self._error: RouterError | None = None
        self._lost = False
        self._waiter: asyncio.Future[None] | None = None
        self.last_data = time.perf_counter()

    @property
    def finished(self) -> bool:
        """Nothing more will come: the whole body arrived, or the stream ended in an error."""
        return self.ended or self._error is not None or self._lost

    # ---- the connection's side ------------------------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if self._error is not None or self._lost:
            return
        self.received += len(data)
        self.last_data = time.perf_counter()
        if self.received > self.limit:
            self.abort(
                RouterError(
                    413, f"Request body exceeds the limit of {self.limit} bytes.", code="body_too_large"
                )
            )
            return
        self._pieces.append(data)
        self._buffered += len(data)
        if self._buffered >= WINDOW and not self.paused:
            self.paused = True
            self._transport.pause_reading()
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    def abort(self, error: RouterError) -> None:
        """The body cannot be read to its end (too large, malformed, too slow): the handler's next read
        raises ``error``."""
        if self._error is None and not self.ended:
            self._error = error
            self._pieces.clear()
            self._buffered = 0
            self._wake()

    def lost(self) -> None:
        """The client went away."""
        self._lost = True
        self._pieces.clear()
        self._wake()

    def check_idle(self, now: float) -> None:
        if not self.finished and now - self.last_data > self.idle_timeout:
            self.abort(
                RouterError(
                    408, f"No request body byte arrived for {self.idle_timeout:g}s.", code="request_timeout"
                )
            )

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    # ---- the handler's side ---------------------------------------------------------------------------------
    async def read(self) -> bytes | None:
        """The next bytes of the body; ``b""`` at its end; None when the client went away. Raises the
        :class:`RouterError` the stream was aborted with."""
        while True:
            if self._error is not None:
                raise self._error
            if self._pieces:
                return self._take()
            if self._lost:
                return None
            if self.ended:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter

    def _take(self) -> bytes:
        pieces = self._pieces
        data = pieces.popleft()
        if pieces and len(data) < READ_CHUNK:
            parts = [data]
            size = len(data)
            while pieces and size < READ_CHUNK:
                piece = pieces.popleft()
                parts.append(piece)
                size += len(piece)
            data = b"".join(parts)
        self._buffered -= len(data)
        if self.paused and self._buffered <= WINDOW // 2 and not self.ended:
            self.paused = False
            self._transport.resume_reading()
        return data
