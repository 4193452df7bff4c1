"""A lean HTTP/1.1 keep-alive load generator (asyncio protocol + httptools), so it is not the bottleneck.

Each of ``concurrency`` connections sends the same request back to back and records the time from
writing the request to the end of the response (the whole SSE stream for streamed requests).
A malformed response fails the run with the bytes that broke it; so does no response completing for
``stall_s`` seconds (checked by one watchdog, not a timer per request).
"""

from __future__ import annotations

import asyncio
import time

import httptools


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.done: asyncio.Future[int] | None = None
        self.status = 0
        self.error: Exception | None = None  # the first failure, reported to every later request
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.fail(ConnectionError(f"malformed response ({exc}); received {data[:300]!r}"))
            self.transport.close()  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.done is not None and not self.done.done():
            self.done.set_result(self.status)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(ConnectionError("connection lost"))

    def fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        if self.done is not None and not self.done.done():
            self.done.set_exception(self.error)


def build_request(host: str, port: int, path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def run_load(
    host: str, port: int, request: bytes, concurrency: int, total: int, stall_s: float = 10.0
) -> tuple[list[float], float, int]:
    """Send ``total`` requests over ``concurrency`` connections; returns (latencies s, wall s, errors)."""
    loop = asyncio.get_running_loop()
    conns = []
    for _ in range(concurrency):
        _, proto = await loop.create_connection(_Conn, host, port)
        conns.append(proto)
    latencies: list[float] = []
    errors = 0
    remaining = total

    async def worker(conn: _Conn) -> None:
        nonlocal remaining, errors
        perf = time.perf_counter
        while remaining > 0:
            remaining -= 1
            conn.done = loop.create_future()
            t0 = perf()
            conn.transport.write(request)  # type: ignore[union-attr]
            status = await conn.done
            latencies.append(perf() - t0)
            if status != 200:
                errors += 1

    async def watchdog() -> None:
        seen = -1
        while True:
            await asyncio.sleep(stall_s)
            if len(latencies) == seen:
                for c in conns:
                    c.fail(TimeoutError(f"no response completed in {stall_s:.0f} s"))
            seen = len(latencies)

    started = time.perf_counter()
    watch = asyncio.ensure_future(watchdog())
    workers = [asyncio.ensure_future(worker(c)) for c in conns]
    try:
        await asyncio.gather(*workers)
        wall = time.perf_counter() - started
    finally:
        watch.cancel()
        for c in conns:
            c.transport.close()  # type: ignore[union-attr]
        await asyncio.gather(*workers, return_exceptions=True)  # after a failure: the others end too
    return latencies, wall, errors
