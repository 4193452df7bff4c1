"""A lean HTTP/1.1 keep-alive load generator (asyncio protocol + httptools), so it is not the bottleneck.

Each of ``concurrency`` connections sends the same request back to back and records the time from
writing the request to the end of the response (the whole SSE stream for streamed requests).
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
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.done is not None and not self.done.done():
            self.done.set_result(self.status)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost"))


def build_request(host: str, port: int, path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def run_load(
    host: str, port: int, request: bytes, concurrency: int, total: int
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

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns))
    wall = time.perf_counter() - started
    for c in conns:
        c.transport.close()  # type: ignore[union-attr]
    return latencies, wall, errors
