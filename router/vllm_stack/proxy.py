"""Forwards one request to an engine: pooled upstream client, streaming, retries, circuit breaking.

Invariants:
- bytes pass through unchanged (no decompression, no re-encoding); hop-by-hop headers are dropped;
- a retry happens only while nothing has reached the client, on a connection failure or a 429/5xx
  answer, on another engine;
- after the response started, an upstream failure ends an SSE stream with an error event;
- a client disconnect cancels the forward, which closes the upstream connection (the engine aborts).

The upstream client is any :class:`~vllm_stack.upstream.Transport` (see ``vllm_stack.upstream``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from vllm_stack.api.errors import RouterError, Send, sse_error_event
from vllm_stack.discovery.engine import Engine
from vllm_stack.discovery.registry import EngineRegistry
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.framework import RequestContext, Scheduler
from vllm_stack.upstream import (
    Transport,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamResponse,
    UpstreamTimeout,
)

log = logging.getLogger(__name__)

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"trailers",
        b"transfer-encoding",
        b"upgrade",
    }
)
#: Request headers the upstream client sets itself (or that must not leak upstream).
_REQUEST_DROP = HOP_BY_HOP | {b"host", b"content-length", b"expect", b"authorization", b"x-api-key"}


def connection_listed(headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names that a `Connection` header declares hop-by-hop (RFC 9110 section 7.6.1).

    Such headers are meant for this hop only and must not be forwarded. Almost every request lists
    nothing beyond keep-alive/close, so the common result is the shared empty set.
    """
    listed: set[bytes] = set()
    for key, value in headers:
        if key.lower() == b"connection":
            listed.update(token.strip().lower() for token in value.split(b","))
    listed -= {b"", b"close", b"keep-alive"}
    return frozenset(listed) if listed else _NOTHING


_NOTHING: frozenset[bytes] = frozenset()


# ---- forwarding ---------------------------------------------------------------------------------
@dataclass(slots=True)
class ProxySettings:
    retries: int = 2
    request_timeout: float = 600.0
    engine_auth: bytes | None = None  # "Bearer <VLLM_API_KEY>" sent to engines


@dataclass(slots=True)
class ForwardState:
    """What the forward did, read by the caller's accounting (also after a cancellation)."""

    engine: Engine | None = None
    status: str = "none"
    started: bool = False  # a byte (the status line) reached the client: no retry, no error JSON
    finished: bool = False  # the last byte was handed to the server: a disconnect now is not an abort


class _BrokenBeforeStart(Exception):
    """The engine's answer broke before the router sent anything to the client."""


_RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class Proxy:
    """Picks an engine, sends, retries while allowed and streams the answer back."""

    def __init__(
        self,
        registry: EngineRegistry,
        scheduler: Callable[[], Scheduler],
        transport: Transport,
        metrics: RouterMetrics,
        settings: Callable[[], ProxySettings],
    ) -> None:
        self._registry = registry
        self._scheduler = scheduler
        self.transport = transport
        self._metrics = metrics
        self._settings = settings

    def upstream_headers(
        self, headers: list[tuple[bytes, bytes]], request_id: bytes, has_request_id: bool
    ) -> list[tuple[bytes, bytes]]:
        """Client headers minus hop-by-hop and credentials, plus the request id and the engines' key."""
        listed = connection_listed(headers)
        drop = _REQUEST_DROP | listed if listed else _REQUEST_DROP
        out = [(k, v) for k, v in headers if k not in drop]
        if not has_request_id:
            out.append((b"x-request-id", request_id))
        key = self._settings().engine_auth
        if key:
            out.append((b"authorization", key))
        return out

    async def forward(
        self,
        send: Send,
        method: str,
        path_qs: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        ctx: RequestContext,
        request_id: bytes,
        has_request_id: bool,
        state: ForwardState,
        started_at: float,
    ) -> None:
        """Forward with retries; raises :class:`RouterError` when nothing was sent to the client."""
        settings = self._settings()
        registry = self._registry
        metrics = self._metrics
        up_headers = self.upstream_headers(headers, request_id, has_request_id)
        attempts = 1 + settings.retries
        last_error: RouterError | None = None
        for attempt in range(attempts):
            candidates = registry.candidates(ctx.model)
            engine = self._scheduler().pick(ctx, candidates) if candidates else None
            if engine is None:
                if last_error is not None:
                    raise last_error
                raise RouterError(
                    503,
                    f"No healthy engine is available for model '{ctx.model}'.",
                    code="no_healthy_engine",
                    headers=[(b"retry-after", b"1")],
                )
            state.engine = engine
            engine.breaker.acquire()
            gauge = metrics.in_flight_child(engine.name)
            engine.in_flight += 1
            gauge.inc()
            try:
                try:
                    resp = await self.transport.send(
                        method, engine.url + path_qs, up_headers, body, settings.request_timeout
                    )
                except UpstreamConnectError as exc:
                    engine.breaker.failure()
                    registry.eject(engine, "connect_error")
                    ctx.excluded.add(engine.name)
                    last_error = RouterError(
                        502, f"Could not reach engine {engine.name}: {exc}", code="upstream_unreachable"
                    )
                    state.status = "upstream_error"
                    if attempt + 1 < attempts:
                        metrics.retry(ctx.model, "connect_error")
                    continue
                except UpstreamTimeout:
                    engine.breaker.failure()
                    state.status = "504"
                    raise RouterError(
                        504,
                        f"Engine {engine.name} did not answer within {settings.request_timeout:g}s.",
                        code="upstream_timeout",
                    ) from None
                status = resp.status
                if status in _RETRYABLE_STATUS and attempt + 1 < attempts:
                    ctx.excluded.add(engine.name)
                    if any(
                        e.name not in ctx.excluded and e.breaker.available()
                        for e in registry.candidates(ctx.model)
                    ):
                        if status >= 500:
                            engine.breaker.failure()
                        else:
                            engine.breaker.release()
                        resp.close()
                        metrics.retry(ctx.model, str(status))
                        continue
                try:
                    await self._respond(send, resp, engine, ctx, request_id, state, started_at)
                except _BrokenBeforeStart as exc:  # nothing reached the client yet: still retryable
                    ctx.excluded.add(engine.name)
                    last_error = RouterError(502, str(exc), code="upstream_broken")
                    state.status = "upstream_error"
                    if attempt + 1 < attempts:
                        metrics.retry(ctx.model, "upstream_broken")
                    continue
                return
            finally:
                engine.in_flight -= 1
                gauge.dec()
        assert last_error is not None
        raise last_error

    async def _respond(
        self,
        send: Send,
        resp: UpstreamResponse,
        engine: Engine,
        ctx: RequestContext,
        request_id: bytes,
        state: ForwardState,
        started_at: float,
    ) -> None:
        status = resp.status
        is_sse = False
        out_headers: list[tuple[bytes, bytes]] = []
        has_rid = False
        listed = connection_listed(resp.headers)
        for k, v in resp.headers:
            lk = k.lower()
            if lk in HOP_BY_HOP or lk in listed:
                continue
            if lk == b"content-type" and v.startswith(b"text/event-stream"):
                is_sse = True
            elif lk == b"x-request-id":
                has_rid = True
            out_headers.append((k, v))
        if not has_rid:
            out_headers.append((b"x-request-id", request_id))
        state.status = str(status)
        breaker = engine.breaker
        try:
            if not is_sse:
                payload = await resp.read()
                state.started = True
                await send({"type": "http.response.start", "status": status, "headers": out_headers})
                state.finished = True
                await send({"type": "http.response.body", "body": payload})
            else:
                await self._stream(send, resp, ctx, status, out_headers, state, started_at)
        except UpstreamBroken as exc:
            breaker.failure()
            resp.close()
            if not state.started:
                raise _BrokenBeforeStart(f"Engine {engine.name} broke the response: {exc}") from None
            state.status = "upstream_error"
            log.warning("upstream %s broke mid-response: %s", engine.name, exc)
            if is_sse:
                state.finished = True
                await send(
                    {
                        "type": "http.response.body",
                        "body": sse_error_event(f"engine {engine.name} failed mid-stream"),
                    }
                )
            return  # non-SSE: leave the response incomplete so the server closes the connection
        except BaseException:
            resp.close()  # client gone / cancelled: closing the connection makes the engine abort
            breaker.release()
            raise
        if status >= 500:
            breaker.failure()
        else:
            breaker.success()

    async def _stream(
        self,
        send: Send,
        resp: UpstreamResponse,
        ctx: RequestContext,
        status: int,
        out_headers: list[tuple[bytes, bytes]],
        state: ForwardState,
        started_at: float,
    ) -> None:
        perf = time.perf_counter
        itl = self._metrics.itl_child(ctx.model)
        state.started = True
        await send({"type": "http.response.start", "status": status, "headers": out_headers})
        last = 0.0
        async for chunk in resp.chunks():
            now = perf()
            if last:
                itl.observe(now - last)
            else:
                self._metrics.observe_ttft(ctx.model, now - started_at)
            last = now
            if resp.complete:
                state.finished = True
                await send({"type": "http.response.body", "body": chunk})
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        state.finished = True
        await send({"type": "http.response.body", "body": b""})
