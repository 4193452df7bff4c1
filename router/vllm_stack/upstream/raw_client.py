"""A small keep-alive HTTP/1.1 client on asyncio protocols and httptools, made for proxying.

Why not aiohttp/httpx: the proxy sends a body it already holds, with headers it already has as
bytes, and streams back raw bytes; a general client spends most of the router's CPU on request and
response objects, header multidicts, cookie and redirect machinery it never needs (see
benchmarks/results/router.md). This client writes the request in one ``transport.write`` and
hands back body bytes as the parser produces them, coalescing what arrived together.

Correctness points:
- a pooled connection the engine closed while idle fails before any response byte: the request is
  re-sent once on a fresh connection (it never reached the engine), so such a race is not mistaken
  for a dead engine;
- a response is returned to the pool only when read to its end with keep-alive; any other end
  (client gone, error, timeout) closes the connection, which is how the engine learns to abort;
- reading pauses when more than ``HIGH_WATER`` bytes are buffered (slow client), so memory is bounded.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httptools

from vllm_stack.upstream.base import UpstreamBroken, UpstreamConnectError, UpstreamTimeout

HIGH_WATER = 1 << 20
MAX_IDLE_PER_HOST = 512


class _Conn(asyncio.Protocol):
    """One TCP connection to an engine, carrying one exchange at a time."""

    __slots__ = (
        "pool",
        "transport",
        "parser",
        "status",
        "headers",
        "body",
        "buffered",
        "paused",
        "headers_done",
        "complete",
        "error",
        "got_bytes",
        "keep_alive",
        "closed",
        "waiter",
    )

    def __init__(self, pool: _HostPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.waiter: asyncio.Future[None] | None = None
        self.reset()

    def reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.headers_done = False
        self.complete = False
        self.error: BaseException | None = None
        self.got_bytes = False
        self.keep_alive = True

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = exc
            self.keep_alive = False
            self.transport.close()  # type: ignore[union-attr]
        if self.buffered > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()  # once per read, however many parser events it produced

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self.error = exc or ConnectionResetError("connection closed by the engine")
            self._wake()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, idle_timeout: float) -> None:
        """Wait for the next parser event, or raise :class:`UpstreamTimeout`."""
        loop = self.pool.loop
        waiter = self.waiter = loop.create_future()
        timer = loop.call_later(idle_timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamTimeout("no answer from the engine within the read timeout"))


class _RawResponse:
    __slots__ = ("_conn", "_timeout", "_done", "status", "headers")

    def __init__(self, conn: _Conn, timeout: float) -> None:
        self._conn = conn
        self._timeout = timeout
        self._done = False
        self.status = conn.status
        self.headers = conn.headers

    def _take(self) -> bytes:
        conn = self._conn
        body = conn.body
        data = body.popleft() if len(body) == 1 else b"".join(body)
        body.clear()
        conn.buffered = 0
        if conn.paused:
            conn.paused = False
            conn.transport.resume_reading()  # type: ignore[union-attr]
        return data

    async def _more(self) -> None:
        """Wait for the next bytes; a broken or silent connection is closed and raises UpstreamBroken."""
        conn = self._conn
        if conn.error is not None:
            self.close()
            raise UpstreamBroken(f"{type(conn.error).__name__}: {conn.error}")
        try:
            await conn.wait(self._timeout)
        except UpstreamTimeout as exc:
            self.close()
            raise UpstreamBroken(str(exc)) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            if conn.body:
                data = self._take()
                if conn.complete:
                    self._release()  # before yielding: the consumer may stop at the last chunk
                yield data
                continue
            if conn.complete:
                self._release()
                return
            await self._more()

    async def read(self) -> bytes:
        conn = self._conn
        while not conn.complete:
            await self._more()
        data = self._take() if conn.body else b""
        self._release()
        return data

    @property
    def complete(self) -> bool:
        """The whole body was received: the chunk just yielded was the last one."""
        return self._done and self._conn.complete

    def _release(self) -> None:
        if not self._done:
            self._done = True
            self._conn.pool.release(self._conn)

    def close(self) -> None:
        if not self._done:
            self._done = True
            conn = self._conn
            conn.keep_alive = False
            if conn.transport is not None:
                conn.transport.close()


class _HostPool:
    """Idle keep-alive connections to one engine (LIFO, so the warmest connection is reused)."""

    def __init__(self, host: str, port: int, connect_timeout: float) -> None:
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.loop = asyncio.get_running_loop()
        self.idle: list[_Conn] = []

    async def acquire(self) -> tuple[_Conn, bool]:
        idle = self.idle
        while idle:
            conn = idle.pop()
            if not conn.closed and not conn.transport.is_closing():  # type: ignore[union-attr]
                conn.reset()
                return conn, True
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Conn(self), self.host, self.port), self.connect_timeout
            )
        except TimeoutError:
            raise UpstreamConnectError(f"connect to {self.host}:{self.port} timed out") from None
        except OSError as exc:
            raise UpstreamConnectError(f"connect to {self.host}:{self.port} failed: {exc}") from None
        return conn, False

    def release(self, conn: _Conn) -> None:
        if conn.keep_alive and conn.complete and not conn.closed and len(self.idle) < MAX_IDLE_PER_HOST:
            self.idle.append(conn)
        elif conn.transport is not None:
            conn.transport.close()

    def close(self) -> None:
        for conn in self.idle:
            if conn.transport is not None:
                conn.transport.close()
        self.idle.clear()


class RawTransport:
    name = "raw"

    def __init__(self, connect_timeout: float = 5.0) -> None:
        self._connect_timeout = connect_timeout
        self._pools: dict[
            str, tuple[_HostPool, bytes, bytes]
        ] = {}  # base URL -> (pool, host header, path prefix)

    def _pool(self, base: str) -> tuple[_HostPool, bytes, bytes]:
        entry = self._pools.get(base)
        if entry is None:
            parts = urlsplit(base)
            if parts.scheme != "http":
                raise UpstreamConnectError(f"the raw client speaks plain http only, not {parts.scheme}")
            port = parts.port or 80
            pool = _HostPool(parts.hostname or "localhost", port, self._connect_timeout)
            entry = (pool, f"{parts.hostname}:{port}".encode(), parts.path.rstrip("/").encode())
            if len(self._pools) > 4096:  # engines come and go; keep the map bounded
                for old, _, _ in self._pools.values():
                    old.close()
                self._pools.clear()
            self._pools[base] = entry
        return entry

    async def send(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes, read_timeout: float
    ) -> _RawResponse:
        # ``url`` is "http://host:port" + raw path; split at the first "/" after the authority.
        cut = url.find("/", url.find("//") + 2)
        base, path = (url, "/") if cut == -1 else (url[:cut], url[cut:])
        pool, host, prefix = self._pool(base)
        parts = [method.encode(), b" ", prefix, path.encode("latin-1"), b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
        for k, v in headers:
            parts += (k, b": ", v, b"\r\n")
        parts += (b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body)
        request = b"".join(parts)
        for attempt in (0, 1):
            conn, reused = await pool.acquire()
            conn.transport.write(request)  # type: ignore[union-attr]
            try:
                while not conn.headers_done:
                    if conn.error is not None:
                        break
                    await conn.wait(read_timeout)
            except UpstreamTimeout:
                conn.keep_alive = False
                conn.transport.close()  # type: ignore[union-attr]
                raise
            except BaseException:
                conn.transport.close()  # type: ignore[union-attr]  # cancelled: the engine must abort
                raise
            if conn.headers_done:
                return _RawResponse(conn, read_timeout)
            conn.transport.close()  # type: ignore[union-attr]
            if reused and not conn.got_bytes and attempt == 0:
                continue  # the engine closed an idle connection as we reused it: resend on a fresh one
            raise UpstreamConnectError(f"{type(conn.error).__name__}: {conn.error}")
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        for pool, _, _ in self._pools.values():
            pool.close()
        self._pools.clear()
