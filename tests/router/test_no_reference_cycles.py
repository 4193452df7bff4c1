"""No request leaves reference cycles behind in the router.

Why: the router runs with a large gen-0 threshold (router_cli.py), so cyclic garbage lives until a
rare full collection; a cycle through a connection or a frame keeps its buffers (a refused body's
chunk, a parser) alive meanwhile, and under load RSS climbs in a sawtooth. Each kind of request is
sent through a router in this process with ``gc.DEBUG_SAVEALL``; this test calls ``gc.collect()``
only to find cycles (the RSS tests in test_memory_bounds.py never do). Objects of the test's own
clients and stub engines are not counted. Found this way and fixed: the _Reject traceback of a 413 or
431 held its parsing frame, and a closed upstream connection and its httptools parser held each other.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from tests.fakes.stub_engine import StubBehaviour, StubEngine
from tests.router.helpers import running_router, stubs, wait_for

OK = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}],"max_tokens":3}'
STREAM = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}],"max_tokens":50,"stream":true}'
FOREIGN = ("httpx", "httpcore", "uvicorn", "h11", "starlette", "tests.")


def _post(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        + extra
        + b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
    )


async def _raw(url: str, data: bytes, leave_early: bool = False) -> None:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    try:
        await asyncio.wait_for(reader.read(200 if leave_early else 1 << 20), 2)
    except (TimeoutError, ConnectionError):
        pass
    writer.transport.abort()


KINDS: dict[str, Callable[[str], Awaitable[None]]] = {
    "plain": lambda url: _raw(url, _post(OK, b"Connection: close\r\n")),
    "bad_json": lambda url: _raw(url, _post(b"{bad", b"Connection: close\r\n")),
    "declared_too_large": lambda url: _raw(url, _post(b"x" * 20000)),
    "chunked_too_large": lambda url: _raw(
        url,
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"%x\r\n%b\r\n" % (20000, b"x" * 20000),
    ),
    "header_too_large": lambda url: _raw(
        url, b"GET /health HTTP/1.1\r\nHost: r\r\nX: " + b"a" * 70000 + b"\r\n\r\n"
    ),
    "left_mid_stream": lambda url: _raw(url, _post(STREAM), leave_early=True),
    "pipelined_then_left": lambda url: _raw(url, _post(OK) * 5 + _post(STREAM)),
}


async def _cyclic_garbage_after(kind: str) -> list[object]:
    engine = StubEngine("s", ["stub-model"], StubBehaviour(token_delay_s=0.01))
    async with stubs(engine) as urls, running_router(urls, max_body_bytes=10000) as (url, router):
        for _ in range(3):
            await _raw(url, _post(OK, b"Connection: close\r\n"))  # pools and caches warm
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(20):
                await KINDS[kind](url)
            # Every request over (an aborted stream too), so that its objects are garbage or gone.
            await wait_for(
                lambda: engine.running == 0 and all(e.in_flight == 0 for e in router.registry.engines()),
                what="every request over",
            )
            gc.collect()
            ours = [o for o in gc.garbage if not type(o).__module__.startswith(FOREIGN)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    return ours


@pytest.mark.parametrize("kind", list(KINDS))
def test_requests_leave_no_cyclic_garbage(kind: str) -> None:
    """On uvloop, as the router runs (asyncio's own selector transports keep cycles of their own)."""
    ours = uvloop.run(_cyclic_garbage_after(kind))
    names = sorted({type(o).__name__ for o in ours})
    assert not ours, f"{kind}: {len(ours)} objects in reference cycles: {names[:12]}"
