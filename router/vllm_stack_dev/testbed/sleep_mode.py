"""A stand-in for vLLM's sleep mode, wrapped around any engine app (an ASGI stub engine).

Why a stand-in: vLLM 0.32's CPU build cannot sleep. ``--enable-sleep-mode`` is refused at start
(``ModelConfig``: "Sleep mode is not supported on current platform.", since
``Platform.is_sleep_mode_available()`` is true for CUDA, ROCm and XPU only), and its CPU worker's
``sleep``/``wake_up`` only log "not supported". So the router's side of sleeping engines is tested
against this wrapper, which answers vLLM's endpoints as ``vllm/entrypoints/serve/dev/sleep/api_router.py``
defines them (served by vLLM with ``VLLM_SERVER_DEV_MODE=1``):

- ``POST /sleep?level=N&mode=M``: ``level`` 0..2 (default 1), else 422; ``{"status": "sleeping", "level": N}``.
- ``POST /wake_up?tags=T&tags=U``: ``{"status": "awake" | "sleeping", "tags": [...] | null}`` (awake once
  the tags woken cover what sleeps: ``weights`` and ``kv_cache``).
- ``GET /is_sleeping``: ``{"is_sleeping": bool}``.
- ``/metrics`` gains vLLM's gauge ``vllm:engine_sleep_state{sleep_state=awake|weights_offloaded|discard_all}``.

While asleep a generation request waits (vLLM pauses its scheduler: requests are accepted, not run)
until the engine wakes; ``held`` counts them.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qsl

import orjson

Asgi = Any  # an ASGI application: (scope, receive, send) -> awaitable
SLEEP_TAGS = frozenset({"weights", "kv_cache"})


class SleepModeEngine:
    """``inner`` (an engine's ASGI app) with vLLM's sleep endpoints and sleep state in front of it."""

    def __init__(self, inner: Asgi, model_name: str = "stub-model") -> None:
        self.inner = inner
        self.model_name = model_name
        self.level = 0  # 0 awake; else the level it sleeps at
        self.asleep_tags: set[str] = set()
        self.calls: list[
            tuple[str, str, list[tuple[str, str]]]
        ] = []  # (method, path, query) of each sleep call
        self.held = 0  # generation requests waiting for a wake-up
        self._awake = asyncio.Event()
        self._awake.set()

    @property
    def sleeping(self) -> bool:
        return bool(self.asleep_tags)

    def sleep_now(self, level: int = 1) -> None:
        """Fall asleep as ``POST /sleep?level=`` would (a test's direct call: asleep behind the router's back)."""
        self.level = level
        self.asleep_tags = set(SLEEP_TAGS)
        self._awake.clear()

    def wake_now(self, tags: list[str] | None = None) -> None:
        for tag in tags or SLEEP_TAGS:
            self.asleep_tags.discard(tag)
        if not self.asleep_tags:
            self.level = 0
            self._awake.set()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:  # noqa: ANN401
        if scope["type"] != "http":
            await self.inner(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        query = parse_qsl(scope.get("query_string", b"").decode(), keep_blank_values=True)
        if path in ("/sleep", "/wake_up", "/is_sleeping"):
            self.calls.append((method, path, query))
            await self._sleep_api(path, method, query, send)
            return
        if path == "/metrics":
            await self._metrics(scope, receive, send)
            return
        if method == "POST" and path.startswith("/v1/") and not self._awake.is_set():
            self.held += 1
            try:
                await self._awake.wait()
            finally:
                self.held -= 1
        await self.inner(scope, receive, send)

    async def _sleep_api(self, path: str, method: str, query: list[tuple[str, str]], send: Any) -> None:  # noqa: ANN401
        wanted = "GET" if path == "/is_sleeping" else "POST"
        if method != wanted:
            await _json(send, 405, {"detail": "Method Not Allowed"})
            return
        if path == "/is_sleeping":
            await _json(send, 200, {"is_sleeping": self.sleeping})
            return
        if path == "/sleep":
            raw = next((v for k, v in query if k == "level"), "1")
            if not raw.isdigit() or not 0 <= int(raw) <= 2:  # FastAPI's Query(ge=0, le=2)
                await _json(send, 422, {"detail": [{"loc": ["query", "level"], "msg": "invalid level"}]})
                return
            self.sleep_now(int(raw))
            await _json(send, 200, {"status": "sleeping", "level": int(raw)})
            return
        tags = [v for k, v in query if k == "tags"] or None
        self.wake_now(tags)
        await _json(send, 200, {"status": "sleeping" if self.sleeping else "awake", "tags": tags})

    async def _metrics(self, scope: dict[str, Any], receive: Any, send: Any) -> None:  # noqa: ANN401
        """The inner engine's exposition with vLLM's sleep gauge appended."""
        parts: list[bytes] = []
        start: dict[str, Any] = {}

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            else:
                parts.append(message.get("body", b""))

        await self.inner(scope, receive, capture)
        states = {
            "awake": 0 if self.sleeping else 1,
            "weights_offloaded": 1 if self.sleeping and self.level == 1 else 0,
            "discard_all": 1 if self.sleeping and self.level == 2 else 0,
        }
        extra = "".join(
            f'vllm:engine_sleep_state{{engine="0",model_name="{self.model_name}",sleep_state="{s}"}} {v}.0\n'
            for s, v in states.items()
        )
        body = b"".join(parts) + extra.encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": start.get("status", 200), "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _json(send: Any, status: int, doc: Any) -> None:  # noqa: ANN401
    body = orjson.dumps(doc)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
