"""A minimal OpenAI-compatible stub engine built for throughput, so the router is the bottleneck.

Why it exists: the ASGI stub in ``tests/fakes/stub_engine.py`` is for behaviour tests (failure knobs,
stalls, broken streams, LoRA loading, request capture) and runs on uvicorn; at about 2,200 requests/s
on one core it is slower than the router it is meant to feed, so a benchmark against it measures the
stub. This one answers the same requests on bare asyncio protocols (uvloop + httptools, orjson for
the request body) with every constant byte precomputed: for a streamed 8-token chat completion about
30 us of user CPU and 75 us of system CPU (mostly the one write per token), about 9,000 requests/s
on a core of its own (measured on the two-core development machine).

What it answers (HTTP/1.1, keep-alive, pipelined requests answered in order):

- ``GET /health``: 200 ``{}``;
- ``GET /v1/models``: one vLLM-shaped model card;
- ``GET /metrics``: Prometheus text with the gauges the router scrapes (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``), all 0: requests are answered at once;
- ``POST /v1/chat/completions`` and ``POST /v1/completions``: ``max_tokens`` tokens (default
  ``--tokens``); with ``"stream": true`` a chunked ``text/event-stream`` with one OpenAI chunk event
  per token, each event in its own ``transport.write`` as vLLM sends them (so the router sees separate
  segments), then ``data: [DONE]`` and the terminating chunk (one write); otherwise one JSON
  completion;
- anything else: 404 JSON.

``--token-gap-ms X`` (default 0) spaces a stream's writes as an engine generating tokens does: the
head goes out at once, each token's event X ms after the previous write, and ``data: [DONE]`` with
the terminating chunk right after the last token's event (its own write). The writes are driven by a
chain of ``loop.call_later`` callbacks on the connection (no task per request); requests pipelined
behind a stream are answered in order once it ends; the chain stops if the client closed the
connection. uvloop's timers count whole milliseconds from the loop's cached time, so X is rounded to
whole milliseconds (under 0.5 ms: the next loop iteration) and the gaps come out at least that long.
With 0, the events are written back to back in one go (each still its own ``write``).

Not handled, on purpose: HTTP/1.0 (responses are always HTTP/1.1, chunked when streamed),
``Expect: 100-continue``, and failure injection (use the ASGI stub for that).

Usage: ``python benchmarks/router/fast_stub.py --port 9001 [--tokens 8] [--model stub-model]
[--token-gap-ms 0]``
"""

from __future__ import annotations

import argparse
import asyncio
import collections
from typing import Any

import httptools
import orjson
import uvloop

CREATED = 1700000000
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found"}
_CACHE_LIMIT = 64  # distinct (endpoint, model) event tables kept; cleared when exceeded


def _head(status: int, ctype: bytes, length: int | None, close: bool) -> bytes:
    """Status line and headers; ``length`` None means a chunked body."""
    parts = [
        b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\nx-stub-engine: fast\r\n" % (status, _REASONS[status], ctype)
    ]
    parts.append(b"transfer-encoding: chunked\r\n" if length is None else b"content-length: %d\r\n" % length)
    if close:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def _frame(data: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def _json_response(status: int, payload: Any, close: bool) -> bytes:
    body = orjson.dumps(payload)
    return _head(status, b"application/json", len(body), close) + body


def _error(status: int, message: str, close: bool) -> bytes:
    err = {"message": message, "type": "BadRequestError" if status == 400 else "NotFoundError"}
    return _json_response(status, {"error": {**err, "param": None, "code": status}}, close)


class Stub:
    """Precomputed answers for one served model."""

    def __init__(self, model: str, tokens: int, token_gap_ms: float = 0.0) -> None:
        self.model = model
        self.tokens = tokens
        self.gap = token_gap_ms / 1e3  # seconds between a stream's writes; 0: back to back
        card = {
            "id": model,
            "object": "model",
            "created": CREATED,
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": 2048,
        }
        label = orjson.dumps(model).decode()  # a JSON string is a valid Prometheus label value here
        metrics = "".join(
            f"# TYPE {name} gauge\n{name}{{model_name={label}}} 0.0\n"
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        ).encode()
        self.get: dict[bytes, tuple[bytes, bytes]] = {}  # path -> (keep-alive answer, closing answer)
        for path, status, ctype, body in (
            (b"/health", 200, b"application/json", b"{}"),
            (b"/v1/models", 200, b"application/json", orjson.dumps({"object": "list", "data": [card]})),
            (b"/metrics", 200, b"text/plain; version=0.0.4; charset=utf-8", metrics),
        ):
            self.get[path] = (
                _head(status, ctype, len(body), False) + body,
                _head(status, ctype, len(body), True) + body,
            )
        self.not_found = (_error(404, "not found", False), _error(404, "not found", True))
        sse = b"text/event-stream; charset=utf-8"
        self.stream_head = (_head(200, sse, None, False), _head(200, sse, None, True))
        self.done = _frame(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        self._events: dict[tuple[bool, str, int], list[bytes]] = {}

    def events(self, chat: bool, model: str, n: int) -> list[bytes]:
        """The ``n`` framed SSE events for ``model``, built once per (endpoint, model, n)."""
        key = (chat, model, n)
        table = self._events.get(key)
        if table is None:
            if len(self._events) >= _CACHE_LIMIT:
                self._events.clear()
            table = [self._event(chat, model, i, "length" if i == n - 1 else None) for i in range(n)]
            self._events[key] = table
        return table

    @staticmethod
    def _event(chat: bool, model: str, i: int, finish: str | None) -> bytes:
        text = f"t{i} "
        if chat:
            delta: dict[str, str] = {"content": text}
            if i == 0:
                delta = {"role": "assistant", "content": text}
            chunk = {
                "id": "chatcmpl-stub",
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
        else:
            chunk = {
                "id": "cmpl-stub",
                "object": "text_completion",
                "created": CREATED,
                "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
            }
        return _frame(b"data: " + orjson.dumps(chunk) + b"\n\n")

    def complete(self, chat: bool, model: str, n: int, close: bool) -> bytes:
        text = "".join(f"t{i} " for i in range(n))
        usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
        if chat:
            payload: dict[str, Any] = {
                "id": "chatcmpl-stub",
                "object": "chat.completion",
                "created": CREATED,
                "model": model,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                ],
                "usage": usage,
            }
        else:
            payload = {
                "id": "cmpl-stub",
                "object": "text_completion",
                "created": CREATED,
                "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
                "usage": usage,
            }
        return _json_response(200, payload, close)


_CHAT = b"/v1/chat/completions"
_COMPLETIONS = b"/v1/completions"


_MAX_WAITING = 16  # requests pipelined behind a spaced stream before the socket stops being read


class StubProtocol(asyncio.Protocol):
    """One client connection: requests parsed by httptools and answered in arrival order."""

    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.closing = False
        # A spaced stream under way (stub.gap > 0): its events still to write, driven by call_later.
        self.stream: list[bytes] | None = None
        self.next_event = 0
        self.close_after = False  # the streamed request asked for "connection: close"
        self.timer: asyncio.TimerHandle | None = None
        # Requests pipelined behind that stream, answered when it ends: (method, path, body, close),
        # or None for input that did not parse (answered 400, then the connection closes).
        self.waiting: collections.deque[tuple[bytes, bytes, bytes, bool] | None] = collections.deque()
        self.reading_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # also an upgrade request: not served here
            if self.closing:  # data after a "connection: close" request: ignored
                return
            self.closing = True
            if self.stream is not None:  # answered in turn, after the stream under way
                self.waiting.append(None)
                return
            self.transport.write(_error(400, "bad request", True))  # type: ignore[union-attr]
            self.transport.close()  # type: ignore[union-attr]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:  # the client left mid-stream: stop writing
            self.timer.cancel()
            self.timer = None
        self.stream = None
        self.waiting.clear()

    def pause_writing(self) -> None:  # a client that pipelines but does not read: stop reading too
        self.transport.pause_reading()  # type: ignore[union-attr]

    def resume_writing(self) -> None:
        if not self.reading_paused:
            self.transport.resume_reading()  # type: ignore[union-attr]

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url  # may arrive in pieces

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.closing:  # a request pipelined behind one that closed the connection
            return
        close = not self.parser.should_keep_alive()
        if close:
            self.closing = True
        parts = self.body
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        method, path = self.parser.get_method(), self.url.partition(b"?")[0]
        if self.stream is not None:  # a spaced stream is under way: this one waits its turn
            self.waiting.append((method, path, body, close))
            if len(self.waiting) >= _MAX_WAITING and not self.reading_paused:
                self.reading_paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]
            return
        self.respond(method, path, body, close)

    def respond(self, method: bytes, path: bytes, body: bytes, close: bool) -> None:
        self.answer(method, path, body, close)
        if close and self.stream is None:  # a spaced stream closes the connection when it ends
            self.transport.close()  # type: ignore[union-attr]

    def answer(self, method: bytes, path: bytes, body: bytes, close: bool) -> None:
        stub, write = self.stub, self.transport.write  # type: ignore[union-attr]
        if method == b"POST" and (path == _CHAT or path == _COMPLETIONS):
            try:
                doc = orjson.loads(body)
            except orjson.JSONDecodeError:
                return write(_error(400, "request body is not valid JSON", close))
            if type(doc) is not dict:
                return write(_error(400, "request body must be a JSON object", close))
            model = doc.get("model") or stub.model
            n = doc.get("max_tokens")
            if n is None:
                n = stub.tokens
            elif type(n) is not int or not 1 <= n <= 2048:
                return write(_error(400, "max_tokens must be an integer from 1 to 2048", close))
            if type(model) is not str:
                return write(_error(400, "model must be a string", close))
            chat = path == _CHAT
            if doc.get("stream") is True:
                write(stub.stream_head[close])
                if stub.gap > 0:  # one event per timer callback, stub.gap apart
                    self.stream = stub.events(chat, model, n)
                    self.next_event = 0
                    self.close_after = close
                    self.timer = self.loop.call_later(stub.gap, self._next_event)  # type: ignore[union-attr]
                    return None
                for event in stub.events(chat, model, n):
                    write(event)  # one write per token, as vLLM does
                return write(stub.done)
            return write(stub.complete(chat, model, n, close))
        answers = stub.get.get(path) if method == b"GET" else None
        write((answers or stub.not_found)[close])
        return None

    def _next_event(self) -> None:
        """Timer callback: write the stream's next event; after the last, end it and go on."""
        self.timer = None
        events = self.stream
        transport = self.transport
        if events is None or transport.is_closing():  # type: ignore[union-attr]
            self.stream = None
            return
        i = self.next_event
        transport.write(events[i])  # type: ignore[union-attr]
        i += 1
        if i < len(events):
            self.next_event = i
            self.timer = self.loop.call_later(self.stub.gap, self._next_event)  # type: ignore[union-attr]
            return
        transport.write(self.stub.done)  # type: ignore[union-attr]  # right after the last token
        self.stream = None
        if self.close_after:
            transport.close()  # type: ignore[union-attr]
            return
        waiting = self.waiting
        while waiting and self.stream is None and not transport.is_closing():  # type: ignore[union-attr]
            item = waiting.popleft()
            if item is None:
                transport.write(_error(400, "bad request", True))  # type: ignore[union-attr]
                transport.close()  # type: ignore[union-attr]
                return
            self.respond(*item)
        if self.reading_paused and len(waiting) < _MAX_WAITING:
            self.reading_paused = False
            transport.resume_reading()  # type: ignore[union-attr]


async def serve(host: str, port: int, stub: Stub) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: StubProtocol(stub), host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001)
    p.add_argument("--tokens", type=int, default=8, help="tokens per completion when max_tokens is absent")
    p.add_argument("--model", default="stub-model", help="served model name")
    p.add_argument(
        "--token-gap-ms",
        type=float,
        default=0.0,
        help="milliseconds between a stream's writes (whole ms; 0: all at once, the default)",
    )
    args = p.parse_args()
    if args.token_gap_ms < 0:
        p.error("--token-gap-ms must be 0 or more")
    uvloop.run(serve(args.host, args.port, Stub(args.model, args.tokens, args.token_gap_ms)))


if __name__ == "__main__":
    main()
