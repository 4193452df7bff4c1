"""A stub engine that never answers 5xx, whatever it is sent: the engine side of the fuzz tests.

The fuzz tests count 5xx answers and blame the router for each one that carries its error marker;
with an engine that cannot produce a 5xx, every 5xx seen at all is the router's. The plain
:class:`tests.fakes.stub_engine.StubEngine` is written for well-formed requests (``int(max_tokens)``
on a string raises, a huge ``max_tokens`` allocates gigabytes), so this wrapper normalises the few
fields it interprets and turns any exception before the response started into a 400.
"""

from __future__ import annotations

from typing import Any

import orjson

from tests.fakes.stub_engine import StubEngine, receive_body

MAX_TOKENS = 8  # bounded output whatever the request asks for


def _sanitised(body: bytes) -> bytes:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body  # the stub answers undecodable JSON with its own 400
    if not isinstance(doc, dict):
        return b"{}"
    n = doc.get("max_tokens")
    doc["max_tokens"] = n if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_TOKENS else 4
    doc["stream"] = doc.get("stream") is True
    doc["model"] = doc["model"] if isinstance(doc.get("model"), str) else ""
    return orjson.dumps(doc)


class NeverFailingStub:
    """ASGI wrapper around a :class:`StubEngine`: same answers for sane requests, 400 instead of 5xx."""

    def __init__(self, engine: StubEngine) -> None:
        self.engine = engine
        self.answered_5xx = 0  # stays 0 unless this wrapper has a bug; the tests assert it

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] == "GET":
            return await self.engine(scope, receive, send)
        body = await receive_body(receive)
        if body is None:
            return
        replay = [{"type": "http.request", "body": _sanitised(body), "more_body": False}]

        async def replayed() -> dict[str, Any]:
            return replay.pop() if replay else await receive()

        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if message["status"] >= 500:
                    self.answered_5xx += 1
            await send(message)

        try:
            await self.engine(scope, replayed, tracking_send)
        except Exception as exc:  # noqa: BLE001 - the point of this wrapper
            if started:
                raise
            payload = orjson.dumps(
                {"error": {"message": f"stub rejects: {type(exc).__name__}", "type": "BadRequestError",
                           "param": None, "code": 400}}
            )  # fmt: skip
            await send(
                {
                    "type": "http.response.start",
                    "status": 400,
                    "headers": [
                        (b"content-type", b"application/json"),
                        (b"content-length", b"%d" % len(payload)),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": payload})
