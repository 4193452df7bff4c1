"""A raw-socket fake engine for wire-level tests: it answers what the router's health checks and
scrapes ask (``GET /v1/models``, ``GET /metrics``) like an idle vLLM engine, and hands every other
request to the test, which writes whatever bytes it likes (malformed heads, early closes, floods).

Used where a real vLLM engine (or the ASGI stub on uvicorn) cannot be made to misbehave on purpose.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

MODELS = b'{"object":"list","data":[{"id":"stub-model","object":"model","root":"stub-model","parent":null}]}'
METRICS = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"

#: Called with the request head and body; writes its answer itself. Returns False to close the
#: connection afterwards (without answering, if it wrote nothing).
Answer = Callable[[bytes, bytes, asyncio.StreamWriter], Awaitable[bool]]


def _ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
        len(body),
        body,
    )


@contextlib.asynccontextmanager
async def raw_engine(answer: Answer) -> AsyncIterator[str]:
    """Serve on an ephemeral loopback port; yields the engine's base URL."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET "):
                    writer.write(_ok(METRICS if b" /metrics " in head else MODELS))
                    continue
                lowered = head.lower()
                length = (
                    int(lowered.split(b"content-length: ")[1].split(b"\r\n")[0])
                    if b"content-length: " in lowered
                    else 0
                )
                body = await reader.readexactly(length)
                if not await answer(head, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
