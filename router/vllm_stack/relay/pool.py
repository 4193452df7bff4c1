"""Keep-alive HTTP/1.1 connections to the engines, one pool per engine URL.

An :class:`UpstreamConnection` parses the engine's response with httptools only to find where the
head ends and where the message ends; the body bytes are handed to the exchange as they were read,
framing included (``on_head`` once, then ``on_read`` per socket read, to the relay leg), so whatever arrived together
leaves together in one write and no Python code runs per chunk. The parser has no body callback on
purpose: it would cost a call per streamed token. A connection goes back to its pool only when its
response was read to the end with keep-alive; any other end (client gone, error, timeout) closes
it, which is how an engine learns to abort the request. Nor does one whose engine sent more bytes
after the answer's framing ended (:attr:`UpstreamConnection.overrun`): those bytes are not the
answer's, and the exchange forwards only what is (see the relay leg). CR and LF bytes after an answer
are such bytes too, though the parser skips them without a word (as HTTP allows between messages):
the relay leg finds them in the answer's last read, and here they are found before the next answer's
head, and an idle connection that receives any byte is closed.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from typing import Protocol
from urllib.parse import urlsplit

import httptools

MAX_IDLE_PER_ENGINE = 512
MAX_HEAD_BYTES = 256 * 1024  # an engine's response head still incomplete after this many bytes is refused
MAX_POOLS = 4096  # engines come and go (Kubernetes); the map of pools stays bounded


class UpstreamConnectError(Exception):
    """The request could not be sent to the engine (connect refused, timed out, TLS failure)."""


class Exchange(Protocol):
    """The callbacks an upstream connection drives (see :class:`vllm_stack.relay.leg.Leg`)."""

    def on_head(self, status: int, head: bytes) -> None: ...

    def on_read(self, data: bytes, complete: bool) -> None: ...

    def upstream_failed(self, conn: UpstreamConnection, error: BaseException) -> None: ...


class PooledExchange:
    """One request sent on one of a pool's connections: a pooled one at once, else a new one once it
    is connected (the relay leg, the prefill leg of disaggregated serving). A subclass sets the slots
    below in its ``__init__`` and implements ``_send`` and ``connect_failed``, besides the
    :class:`Exchange` callbacks; what is here is the connection's life, the same for every exchange."""

    __slots__ = ("pool", "up", "reused", "resent", "connecting", "done")

    pool: EnginePool
    up: UpstreamConnection | None
    reused: bool  # the request went on a pooled connection (which the engine may have just closed)
    resent: bool
    connecting: asyncio.Task[UpstreamConnection] | None
    done: bool

    def _send(self, up: UpstreamConnection, reused: bool) -> None:
        raise NotImplementedError

    def connect_failed(self, error: BaseException) -> None:
        """No connection could be made (``done`` is already set): report it to the owner."""
        raise NotImplementedError

    def _connect(self) -> None:
        task = self.connecting = asyncio.get_running_loop().create_task(self.pool.connect())
        task.add_done_callback(self._connected)

    def _connected(self, task: asyncio.Task[UpstreamConnection]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if self.connecting is not task or self.done:  # the exchange was abandoned meanwhile
            if exc is None:
                self.pool.put(task.result())
            return
        self.connecting = None
        if exc is None:
            self._send(task.result(), reused=False)
            return
        self.done = True
        self.connect_failed(exc)

    def resend_if_stale(self, up: UpstreamConnection) -> bool:
        """An idle connection the engine closed just as it was reused: the request never reached the
        engine, so it is sent again on a fresh connection, once, without penalty. True when it was."""
        if self.reused and not up.got_bytes and not self.resent:
            self.resent = True
            self._connect()
            return True
        return False

    def abort(self) -> None:
        """Abandon the exchange: the engine sees its connection close and aborts the request."""
        self.done = True
        if self.connecting is not None:
            self.connecting.cancel()
            self.connecting = None
        up = self.up
        self.up = None
        if up is not None:
            up.abort()


class UpstreamConnection(asyncio.Protocol):
    """One TCP (or TLS) connection to an engine, carrying one exchange at a time."""

    __slots__ = (
        "pool",
        "transport",
        "parser",
        "exchange",
        "keep_alive",
        "complete",
        "got_bytes",
        "closed",
        "head",
        "head_done",
        "interim",
        "overrun",
    )

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.keep_alive = True
        self.complete = False
        self.got_bytes = False
        self.closed = False
        self.head = b""  # the response head read so far (until the head is complete)
        self.head_done = False
        self.interim = False  # the head being parsed is an interim (1xx) one, skipped
        # bytes followed the end of the answer in its last read: the exchange forwards only the
        # answer's part, and the connection is closed, never pooled
        self.overrun = False

    def send(self, exchange: Exchange, request: bytes) -> None:
        self.exchange = exchange
        self.complete = False
        self.got_bytes = False
        self.head = b""
        self.head_done = False
        self.overrun = False
        self.transport.write(request)

    # ---- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # bytes on an idle connection: the engine is confused, drop it
            self.abort()
            return
        if self.head_done:  # the body, read by read (once per token when streaming)
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserError as exc:
                if not self.complete:
                    self._fail(exchange, exc)
                    return
                self._overran()  # the answer ended; what followed it is not HTTP
            if self.exchange is exchange:
                exchange.on_read(data, self.complete)
            return
        if not self.got_bytes:
            if data[0] in b"\r\n":  # the end of the previous answer's bytes, read only now: dropped,
                data = data.lstrip(b"\r\n")  # and the connection closed after this answer
                self.keep_alive = False
                if not data:
                    return
            self.got_bytes = True
        self.head += data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if not self.complete:
                self._fail(exchange, exc)
                return
            self._overran()
        if self.exchange is not exchange:  # the exchange let go of this response (a retry)
            return
        if not self.head_done:  # more head to come, but not without end
            if len(self.head) > MAX_HEAD_BYTES:
                self._fail(exchange, httptools.HttpParserError("response head too large"))
            return
        data = self.head  # what followed the head in the same read (see on_headers_complete)
        self.head = b""
        exchange.on_read(data, self.complete)

    def _fail(self, exchange: Exchange, error: BaseException) -> None:
        if self.exchange is exchange:
            self.exchange = None
            self.abort()
            exchange.upstream_failed(self, error)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.parser = None  # type: ignore[assignment]  # it holds this protocol: no cycle left behind
        self.pool.discard(self)
        exchange = self.exchange
        if exchange is not None and not self.complete:
            self.exchange = None
            exchange.upstream_failed(self, exc or ConnectionResetError("connection closed by the engine"))

    def _overran(self) -> None:
        self.overrun = True
        self.keep_alive = False

    # ---- httptools callbacks (no per-header one: the exchange reads the raw head) -------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # another message after the answer, in the same read
            self._overran()

    def on_headers_complete(self) -> None:
        if self.complete:  # the head of what followed the answer: not the exchange's
            return
        status = self.parser.get_status_code()
        if status == 101:  # the router never offers an upgrade to an engine
            raise httptools.HttpParserError("unexpected 101 Switching Protocols")
        received = self.head
        end = received.find(b"\r\n\r\n")
        if end < 0:  # a head with bare LF line ends: not something this relay forwards
            raise httptools.HttpParserError("response head without CRLF line ends")
        if status < 200:
            # An interim answer (100 Continue unasked, 102, 103): skipped, the final one follows
            # (RFC 9110 15.2). httptools ends it as a message and parses the next head.
            self.interim = True
            self.head = received[end + 4 :]
            return
        self.head_done = True
        self.head = received[end + 4 :]  # body bytes read together with the head
        self.keep_alive = self.keep_alive and self.parser.should_keep_alive()  # (once False, for good)
        if self.exchange is not None:
            self.exchange.on_head(status, received[: end + 2])

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.complete = True

    # ---- ending ----------------------------------------------------------------------------------------
    def release(self) -> None:
        """The exchange is over: back to the pool if the response ended cleanly, else closed."""
        self.exchange = None
        if self.keep_alive and self.complete and not self.closed:
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Close now; an engine sees the request's connection close and aborts the request."""
        self.exchange = None
        self.keep_alive = False
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()


class EnginePool:
    """Idle connections to one engine, most recently used first (the warmest socket is reused)."""

    __slots__ = ("host", "port", "ssl", "connect_timeout", "idle", "host_header", "path_prefix")

    def __init__(self, base_url: str, connect_timeout: float, ssl_context: ssl.SSLContext | None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https"):
            raise UpstreamConnectError(f"unsupported engine URL scheme {parts.scheme!r}")
        self.host = parts.hostname or "localhost"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl_context if parts.scheme == "https" else None
        self.connect_timeout = connect_timeout
        self.idle: list[UpstreamConnection] = []
        self.host_header = f"{self.host}:{self.port}".encode()
        self.path_prefix = parts.path.rstrip("/").encode()

    def take(self) -> UpstreamConnection | None:
        idle = self.idle
        while idle:
            conn = idle.pop()
            if not conn.closed and not conn.transport.is_closing():
                return conn
        return None

    async def connect(self) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: UpstreamConnection(self),
                    self.host,
                    self.port,
                    ssl=self.ssl,
                    server_hostname=self.host if self.ssl is not None else None,
                ),
                self.connect_timeout,
            )
        except TimeoutError:
            raise UpstreamConnectError(f"connect to {self.host}:{self.port} timed out") from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamConnectError(f"connect to {self.host}:{self.port} failed: {exc}") from None
        return conn

    def put(self, conn: UpstreamConnection) -> None:
        if len(self.idle) < MAX_IDLE_PER_ENGINE:
            self.idle.append(conn)
        else:
            conn.abort()

    def discard(self, conn: UpstreamConnection) -> None:
        try:
            self.idle.remove(conn)
        except ValueError:
            pass

    def close(self) -> None:
        for conn in list(self.idle):
            conn.abort()
        self.idle.clear()


class EnginePools:
    """The pools of one router, keyed by engine base URL."""

    def __init__(
        self,
        connect_timeout: float,
        ssl_context: ssl.SSLContext | None = None,
        tls_by_url: Mapping[str, ssl.SSLContext] | None = None,
    ) -> None:
        """``tls_by_url``: base URLs verified against a context of their own (external providers with
        a private CA); every other https engine gets ``ssl_context``, else the system's CAs."""
        self._connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._tls_by_url = dict(tls_by_url or {})
        self._pools: dict[str, EnginePool] = {}

    def get(self, base_url: str) -> EnginePool:
        pool = self._pools.get(base_url)
        if pool is None:
            if len(self._pools) >= MAX_POOLS:
                self.close()
            https = base_url.startswith("https:")
            tls = (self._tls_by_url.get(base_url) or self._tls()) if https else None
            pool = self._pools[base_url] = EnginePool(base_url, self._connect_timeout, tls)
        return pool

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:  # built on first use: loading the CA bundle takes milliseconds
            self._ssl = ssl.create_default_context()
        return self._ssl

    def set_connect_timeout(self, seconds: float) -> None:
        """A reload's connect timeout: for every connection opened from now on, in every pool."""
        self._connect_timeout = seconds
        for pool in self._pools.values():
            pool.connect_timeout = seconds

    def idle_connections(self, base_url: str) -> int:
        pool = self._pools.get(base_url)
        return len(pool.idle) if pool is not None else 0

    def forget(self, base_url: str) -> None:
        """An engine left: close its idle connections."""
        pool = self._pools.pop(base_url, None)
        if pool is not None:
            pool.close()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
