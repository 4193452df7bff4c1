"""A stand-in for a vLLM engine's OpenAI server, small enough to run from the router image (Python's standard
library only): the node tests mount this file into a Pod from a ConfigMap (tests/node/stub_engine.py).

It answers what the router asks of an engine (``/v1/models``, ``/health``, ``/metrics``) and what a client
sends through it (``POST /v1/chat/completions`` and ``/v1/completions``), plain and streamed as vLLM does:
HTTP/1.1 with keep-alive, a streamed answer as Server-Sent Events in chunked transfer encoding (a role
chunk, ``max_tokens`` content chunks ``STUB_CHUNK_INTERVAL`` seconds apart, a chunk with
``finish_reason: "length"``, a usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``);
a plain answer after the same time. A streamed answer thus lasts ``max_tokens * STUB_CHUNK_INTERVAL``
seconds, long enough for a test to delete the Pod, or the router's Pod, while it is under way.

SIGTERM ends the process at once, cutting what is in flight: what vLLM 0.32 does by default
(``--shutdown-timeout 0``: in-flight requests are aborted), so that only the Pod's preStop wait keeps a
stream whole. Every answer names the Pod (``x-stub-engine`` and the ids) so a test can tell which engine
served it.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import sys
import time

MODEL = os.environ.get("STUB_MODEL", "stub-model")
INTERVAL = float(os.environ.get("STUB_CHUNK_INTERVAL", "0.1"))
PORT = int(os.environ.get("STUB_PORT", "8000"))
POD = socket.gethostname()
MAX_TOKENS = 200  # a request asking for more is refused (400): bounded time per request
CARD = {"id": MODEL, "object": "model", "created": 0, "owned_by": "vllm", "root": MODEL, "parent": None,
        "max_model_len": 2048}  # fmt: skip


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn serves vLLM

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [CARD]})
        elif self.path == "/health":
            self._send(200, b"", "text/plain")
        elif self.path == "/metrics":
            self._send(200, b"", "text/plain; version=0.0.4")
        else:
            self._json(
                404, {"error": {"message": f"{self.path} not found", "type": "NotFoundError", "code": 404}}
            )

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            tokens = int(body.get("max_tokens") or 16)
        except (ValueError, TypeError):
            self._json(400, {"error": {"message": "bad body", "type": "BadRequestError", "code": 400}})
            return
        if self.path not in ("/v1/chat/completions", "/v1/completions") or not 0 < tokens <= MAX_TOKENS:
            self._json(400, {"error": {"message": f"{self.path}, max_tokens {tokens}", "type": "BadRequestError",
                                       "code": 400}})  # fmt: skip
            return
        chat = self.path == "/v1/chat/completions"
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{POD}-{time.monotonic_ns()}"
        if body.get("stream"):
            self._stream(ident, chat, tokens, bool((body.get("stream_options") or {}).get("include_usage")))
            return
        time.sleep(tokens * INTERVAL)
        text = " ".join(f"w{i}" for i in range(tokens))
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                  if chat else {"index": 0, "text": text, "finish_reason": "length"})  # fmt: skip
        self._json(200, {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": 0,
                         "model": MODEL, "choices": [choice], "usage": _usage(tokens)})  # fmt: skip

    def _stream(self, ident: str, chat: bool, tokens: int, usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-stub-engine", POD)
        self.end_headers()
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict], **more: object) -> None:
            data = json.dumps({"id": ident, "object": kind, "created": 0, "model": MODEL, "choices": choices,
                               **more})  # fmt: skip
            self._chunk(f"data: {data}\n\n".encode())

        def piece(text: str | None, finish: str | None = None, role: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text or "", "finish_reason": finish}
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "finish_reason": finish}

        if chat:
            event([piece(None, role=True)])
        for i in range(tokens):
            time.sleep(INTERVAL)
            event([piece(f" w{i}")])
        event([piece(None, "length")])
        if usage:
            event([], usage=_usage(tokens))
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _json(self, status: int, doc: object) -> None:
        self._send(status, json.dumps(doc).encode(), "application/json")

    def _send(self, status: int, body: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("x-stub-engine", POD)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": 8, "completion_tokens": tokens, "total_tokens": 8 + tokens}


def main() -> None:
    # PID 1 in its container: without a handler SIGTERM would be ignored (the kernel drops default-action
    # signals to a namespace's init) and the Pod would wait out its whole grace period.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    server = http.server.ThreadingHTTPServer(("0.0.0.0", PORT), Handler)
    server.daemon_threads = True
    print(
        f"stub engine {POD} serving {MODEL} on :{PORT}, a chunk every {INTERVAL}s",
        file=sys.stderr,
        flush=True,
    )
    server.serve_forever()


if __name__ == "__main__":
    main()
