"""The floor under any router on uvicorn: a raw ASGI app that reads the request and answers the same
8-token SSE stream from memory, with no upstream. The router's CPU per request minus this app's is
what routing, proxying and metrics cost on top of the ASGI server itself."""

from __future__ import annotations

import sys

import uvicorn

_CHUNK = (
    b'data: {"id":"chatcmpl-stub","object":"chat.completion.chunk","created":1700000000,"model":"stub-model",'
    b'"choices":[{"index":0,"delta":{"content":"t0 "},"finish_reason":null}]}\n\n'
)
BODY = _CHUNK * 8 + b"data: [DONE]\n\n"
HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"x-request-id", b"0" * 32)]


async def app(scope, receive, send):  # noqa: ANN001, ANN201 - minimal ASGI callable
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": BODY})


if __name__ == "__main__":
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http="httptools",
        lifespan="off",
        log_level="warning",
        access_log=False,
        server_header=False,
        date_header=False,
        proxy_headers=False,
    )
