"""A minimal OpenAI/vLLM-compatible engine for router tests and the router benchmark.

It is a stand-in where a real engine cannot do what a test needs (fail on demand, stall, break a
stream mid-way, answer thousands of requests per second so the router is the bottleneck); behaviour
tests that need real generation use the real vLLM engines of the test bed.

Run standalone: ``python tests/fakes/stub_engine.py --port 9001 --model stub-model``.
In-process: ``async with serve(StubEngine(...)) as url: ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass
class StubBehaviour:
    """Knobs a test turns; read on every request."""

    fail_statuses: list[int] = field(default_factory=list)  # answer the next requests with these statuses
    delay_s: float = 0.0  # before the response starts
    token_delay_s: float = 0.0  # between streamed chunks
    break_after_chunks: int | None = None  # close the connection after this many streamed chunks
    # End a stream after this many chunks with ``give_up_event`` and [DONE], as vLLM does when its engine
    # core dies (an error event, code 500) or it aborts the request as it shuts down (finish_reason abort)
    give_up_after_chunks: int | None = None
    give_up_event: dict[str, Any] | None = None
    give_up_delay_s: float = 0.5  # before that event (vLLM: about 1.5 s after its engine core died)
    tokens: int = 8  # streamed chunks when max_tokens is absent
    lora_load_delay_s: float = 0.0  # before a LoRA load answers
    lora_load_status: int = 200  # a load's answer (400 with vLLM's words when not 200)
    # What a non-streamed answer to a request with kv_transfer_params carries as its own (a prefill
    # engine's connector hand-over); None: the field is left out
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class SeenRequest:
    method: str
    path: str
    query: bytes
    headers: dict[str, str]
    body: bytes
    header_list: list[tuple[str, str]] = field(default_factory=list)  # as sent, repeats included


async def receive_body(receive: Any) -> bytes | None:
    """The whole ASGI request body, or None when the client left first."""
    body = b""
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            return body


class StubEngine:
    """Raw ASGI app. ``name`` shows up in every answer (``x-stub-engine`` header) so tests see routing."""

    def __init__(
        self,
        name: str = "stub",
        models: list[str] | None = None,
        behaviour: StubBehaviour | None = None,
        max_model_len: int = 2048,
        max_loras: int | None = None,
        strict_models: bool = False,
    ) -> None:
        self.name = name
        self.behaviour = behaviour or StubBehaviour()
        self.max_model_len = max_model_len
        self.strict_models = strict_models  # answer 404 for a model it does not serve, as vLLM does
        self.max_loras = max_loras  # publish vllm:lora_requests_info with this max_lora (None: no LoRA)
        self.lora_loads: list[str] = []  # every load asked for, in order
        self.running_by_model: collections.Counter[str] = collections.Counter()
        self.cards: dict[str, dict[str, Any]] = {}
        for m in models or ["stub-model"]:
            self.add_model(m)
        self.running = 0
        self.waiting = 0
        self.kv_cache_usage = 0.0  # published as vllm:kv_cache_usage_perc
        self.aborted = 0
        self.completed = 0
        self.seen: collections.deque[SeenRequest] = collections.deque(maxlen=256)
        self.healthy = True
        self._name_header = (b"x-stub-engine", name.encode())

    def add_model(self, model: str, parent: str | None = None) -> None:
        self.cards[model] = {
            "id": model,
            "object": "model",
            "created": 1700000000,
            "owned_by": "vllm",
            "root": model if parent is None else f"/adapters/{model}",
            "parent": parent,
            "max_model_len": self.max_model_len,
            "permission": [],
        }

    # ---- ASGI -----------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        if scope["method"] == "GET":
            if path == "/v1/models":
                if not self.healthy:
                    return await self._json(send, 503, {"error": "unhealthy"})
                return await self._json(send, 200, {"object": "list", "data": list(self.cards.values())})
            if path == "/health":
                return await self._json(send, 200 if self.healthy else 503, {})
            if path == "/metrics":
                return await self._metrics(send)
            return await self._json(send, 404, {"error": "not found"})
        body = await receive_body(receive)
        if body is None:
            return
        header_list = [(k.decode(), v.decode("latin-1")) for k, v in scope["headers"]]
        headers = dict(header_list)
        self.seen.append(
            SeenRequest(scope["method"], path, scope.get("query_string", b""), headers, body, header_list)
        )
        b = self.behaviour
        if b.fail_statuses:
            status = b.fail_statuses.pop(0)
            return await self._error(send, status, f"stub {self.name} fails with {status}", "stub")
        if path == "/v1/load_lora_adapter":
            doc = orjson.loads(body)
            self.lora_loads.append(doc["lora_name"])
            if b.lora_load_delay_s:
                await asyncio.sleep(b.lora_load_delay_s)
            if b.lora_load_status != 200:
                return await self._error(send, b.lora_load_status, "No adapter found", "NotFoundError")
            if doc["lora_name"] in self.cards:
                message = f"The lora adapter '{doc['lora_name']}' has already been loaded."
                return await self._error(send, 400, message, "InvalidUserInput")
            self.add_model(doc["lora_name"], parent=next(iter(self.cards)))
            self.cards[doc["lora_name"]]["root"] = doc.get("lora_path")
            return await self._text(
                send, 200, f"Success: LoRA adapter '{doc['lora_name']}' added successfully."
            )
        if path == "/v1/unload_lora_adapter":
            doc = orjson.loads(body)
            self.cards.pop(doc["lora_name"], None)
            return await self._text(
                send, 200, f"Success: LoRA adapter '{doc['lora_name']}' removed successfully."
            )
        doc: dict[str, Any] = {}
        if headers.get("content-type", "").startswith("application/json"):
            try:
                doc = orjson.loads(body) if body else {}
            except orjson.JSONDecodeError:
                return await self._error(send, 400, "bad json", "BadRequestError")
        model = str(doc.get("model", ""))
        if self.strict_models and model not in self.cards:
            return await self._error(
                send, 404, f"The model `{model}` does not exist.", "NotFoundError", "model"
            )
        self.running += 1
        self.running_by_model[model] += 1
        try:
            if b.delay_s:
                await asyncio.sleep(b.delay_s)
            if doc.get("stream"):
                await self._stream(scope, receive, send, doc)
            else:
                await self._complete(send, path, doc, headers)
        finally:
            self.running -= 1
            self.running_by_model[model] -= 1
            if not self.running_by_model[model]:
                del self.running_by_model[model]

    async def _complete(self, send: Any, path: str, doc: dict[str, Any], headers: dict[str, str]) -> None:
        model = doc.get("model", "")
        n = int(doc.get("max_tokens") or self.behaviour.tokens)
        if path == "/v1/chat/completions":
            payload: dict[str, Any] = {
                "id": "chatcmpl-stub",
                "object": "chat.completion",
                "created": 1700000000,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "tok " * n},
                        "finish_reason": "length",
                    }
                ],
                "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
            }
        elif path == "/v1/completions":
            payload = {
                "id": "cmpl-stub",
                "object": "text_completion",
                "created": 1700000000,
                "model": model,
                "choices": [{"index": 0, "text": "tok " * n, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
            }
        elif path == "/v1/embeddings":
            payload = {
                "object": "list",
                "model": model,
                "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
                "usage": {"prompt_tokens": 3, "total_tokens": 3},
            }
        else:
            payload = {"stub": self.name, "path": path, "model": model}
        payload["engine"] = self.name
        if "kv_transfer_params" in doc and self.behaviour.kv_transfer_params is not None:
            payload["kv_transfer_params"] = self.behaviour.kv_transfer_params
        self.completed += 1
        await self._json(send, 200, payload)

    async def _stream(self, scope: dict[str, Any], receive: Any, send: Any, doc: dict[str, Any]) -> None:
        model = doc.get("model", "")
        n = int(doc.get("max_tokens") or self.behaviour.tokens)
        b = self.behaviour
        completions = scope["path"].endswith("/v1/completions")
        answer_id = f"{'cmpl' if completions else 'chatcmpl'}-stub-{self.name}"  # which engine answered
        gone = asyncio.Event()

        async def watch() -> None:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                gone.set()

        watcher = asyncio.ensure_future(watch())
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"), self._name_header],
                }
            )
            for i in range(n):
                if gone.is_set():
                    self.aborted += 1
                    return
                if b.break_after_chunks is not None and i >= b.break_after_chunks:
                    raise ConnectionAbortedError("stub breaks the stream on purpose")
                if b.give_up_after_chunks is not None and i >= b.give_up_after_chunks:
                    await asyncio.sleep(b.give_up_delay_s)
                    event = b"data: " + orjson.dumps(b.give_up_event) + b"\n\n"
                    await send({"type": "http.response.body", "body": event, "more_body": True})
                    await send(
                        {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}
                    )
                    return
                chunk = {
                    "id": answer_id,
                    "object": "chat.completion.chunk",
                    "created": 1700000000,
                    "model": model,
                    "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
                }
                if completions:  # vLLM's completions events: the text on the choice, no delta
                    chunk["object"] = "text_completion"
                    chunk["choices"] = [{"index": 0, "text": f"t{i} ", "finish_reason": None}]
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + orjson.dumps(chunk) + b"\n\n",
                        "more_body": True,
                    }
                )
                if b.token_delay_s:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(gone.wait(), b.token_delay_s)
            if gone.is_set():
                self.aborted += 1
                return
            if (doc.get("stream_options") or {}).get("include_usage"):  # vLLM's last chunk: usage only
                usage = {
                    "id": answer_id,
                    "object": "chat.completion.chunk",
                    "created": 1700000000,
                    "model": model,
                    "choices": [],
                    "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
                }
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + orjson.dumps(usage) + b"\n\n",
                        "more_body": True,
                    }
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            self.completed += 1
        finally:
            watcher.cancel()

    async def _metrics(self, send: Any) -> None:
        lines = []
        for name, value in (
            ("vllm:num_requests_running", self.running),
            ("vllm:num_requests_waiting", self.waiting),
            ("vllm:kv_cache_usage_perc", self.kv_cache_usage),
        ):
            lines.append(f"# TYPE {name} gauge")
            for model, card in self.cards.items():
                if card["parent"] is None:
                    lines.append(f'{name}{{engine="0",model_name="{model}"}} {float(value)}')
        if self.max_loras is not None:  # as vLLM: the latest label set has the largest value
            running = ",".join(m for m in self.running_by_model if self.cards.get(m, {}).get("parent"))
            lines.append("# TYPE vllm:lora_requests_info gauge")
            lines.append(
                f'vllm:lora_requests_info{{max_lora="{self.max_loras}",running_lora_adapters="",'
                f'waiting_lora_adapters=""}} {time.time() - 100:.3f}'
            )
            lines.append(
                f'vllm:lora_requests_info{{max_lora="{self.max_loras}",running_lora_adapters="{running}",'
                f'waiting_lora_adapters=""}} {time.time():.3f}'
            )
        await self._raw(send, 200, ("\n".join(lines) + "\n").encode(), b"text/plain; version=0.0.4")

    async def _error(self, send: Any, status: int, message: str, kind: str, param: str | None = None) -> None:
        """An error in vLLM's shape (OpenAI's, with the status as its code)."""
        payload = {"error": {"message": message, "type": kind, "param": param, "code": status}}
        await self._json(send, status, payload)

    async def _json(self, send: Any, status: int, payload: Any) -> None:
        await self._raw(send, status, orjson.dumps(payload), b"application/json")

    async def _text(self, send: Any, status: int, text: str) -> None:
        await self._raw(send, status, text.encode(), b"text/plain; charset=utf-8")

    async def _raw(self, send: Any, status: int, body: bytes, ctype: bytes) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", ctype),
                    (b"content-length", str(len(body)).encode()),
                    self._name_header,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serve(
    app: Any, host: str = "127.0.0.1", port: int = 0, tls: tuple[str, str] | None = None
) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn in the running loop; yields its base URL; stops on exit.

    ``tls``: (certificate file, key file) to serve https.
    """
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        lifespan="on",
        log_level="warning",
        access_log=False,
        server_header=False,
        proxy_headers=False,
        date_header=False,
        loop="none",
        http="httptools",
        ssl_certfile=tls[0] if tls else None,
        ssl_keyfile=tls[1] if tls else None,
    )
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.ensure_future(server.serve())
    deadline = time.monotonic() + 10
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError("server exited during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError("server did not start")
        await asyncio.sleep(0.005)
    sock = server.servers[0].sockets[0]
    bound_port = sock.getsockname()[1]
    try:
        yield f"{'https' if tls else 'http'}://{host}:{bound_port}"
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(task, 5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9001)
    p.add_argument("--model", default="stub-model")
    p.add_argument("--name", default="stub")
    p.add_argument("--tokens", type=int, default=8)
    args = p.parse_args()
    import uvicorn

    app = StubEngine(args.name, [args.model], StubBehaviour(tokens=args.tokens))
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        server_header=False,
        proxy_headers=False,
        date_header=False,
    )


if __name__ == "__main__":
    main()
