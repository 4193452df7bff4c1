"""CPU cost of the router's own request handling, with the network taken out.

Drives the router's ASGI callable in-process with an in-memory upstream (a fake transport that
answers the benchmark's 8-token stream at once) and in-memory receive/send: what remains is parsing,
model lookup, scheduling, header handling, forwarding logic and metrics. Printed as us/request.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "router"))

from vllm_stack.app import build_router  # noqa: E402
from vllm_stack.discovery.base import EndpointInfo  # noqa: E402

_CHUNK = (
    b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"t0 "}}]}\n\n'
)


class _Response:
    status = 200
    headers = [
        (b"content-type", b"text/event-stream; charset=utf-8"),
        (b"date", b"Mon, 30 Nov 2026 00:00:00 GMT"),
    ]
    complete = True

    async def chunks(self) -> AsyncIterator[bytes]:
        yield _CHUNK * 8 + b"data: [DONE]\n\n"

    async def read(self) -> bytes:
        return _CHUNK

    def close(self) -> None:
        pass


class _Transport:
    name = "memory"

    async def send(self, method, url, headers, body, read_timeout):  # noqa: ANN001, ANN201
        return _Response()

    async def aclose(self) -> None:
        pass


async def measure(body: bytes, n: int = 20000, parser: str = "msgspec") -> float:
    router = build_router(
        {"static_backends": "http://127.0.0.1:1", "static_models": "stub-model", "json_parser": parser},
        environ={},
    )
    await router.start()
    try:
        router.proxy.transport = _Transport()  # type: ignore[union-attr]
        await router.registry.apply_snapshot([EndpointInfo("127.0.0.1:1", "http://127.0.0.1:1")])
        engine = router.registry.engines()[0]
        router.registry.record_check(engine, ok=True)
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "headers": [
                (b"host", b"router"),
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"accept", b"*/*"),
                (b"user-agent", b"bench"),
            ],
        }
        message = {"type": "http.request", "body": body, "more_body": False}

        async def receive() -> dict:
            return message

        async def send(_: dict) -> None:
            return None

        for _ in range(2000):
            await router(scope, receive, send)
        gc.freeze()
        gc.set_threshold(20_000, 20, 100)  # as router_cli does
        started = time.process_time()
        for _ in range(n):
            await router(scope, receive, send)
        return (time.process_time() - started) / n * 1e6
    finally:
        await router.stop()


def handler_cost(body: bytes, parser: str = "msgspec") -> float:
    import uvloop

    return uvloop.run(measure(body, parser=parser))


if __name__ == "__main__":
    from run import BODY

    print(f"{handler_cost(BODY):.1f} us/request")
