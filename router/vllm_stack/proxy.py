"""Forwards one request to an engine: pooled upstream client, streaming, retries, circuit breaking.

Invariants:
- bytes pass through unchanged (no decompression, no re-encoding); hop-by-hop headers are dropped;
- a retry happens only while nothing has reached the client, on a connection failure or a 429/5xx
  answer, on another engine;
- after the response started, an upstream failure ends an SSE stream with an error event;
- a client disconnect cancels the forward, which closes the upstream connection (the engine aborts).

Two upstream clients implement :class:`Transport` (aiohttp and httpx) so the benchmark can compare them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_stack.api.errors import RouterError, Send, sse_error_event
from vllm_stack.discovery.engine import Engine
from vllm_stack.discovery.registry import EngineRegistry
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.framework import RequestContext, Scheduler

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


class UpstreamConnectError(Exception):
    """The request never reached an engine that could answer (safe to retry elsewhere)."""


class UpstreamTimeout(Exception):
    """The engine accepted the request but did not answer in time."""


class UpstreamBroken(Exception):
    """The engine's response broke off mid-way."""


class UpstreamResponse(Protocol):
    status: int
    headers: list[tuple[bytes, bytes]]

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    def close(self) -> None: ...


class Transport(Protocol):
    name: str

    async def send(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes, read_timeout: float
    ) -> UpstreamResponse: ...

    async def aclose(self) -> None: ...


# ---- aiohttp ------------------------------------------------------------------------------------
class _AiohttpResponse:
    __slots__ = ("_resp", "status", "headers")

    def __init__(self, resp: Any) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers = list(resp.raw_headers)

    async def chunks(self) -> AsyncIterator[bytes]:
        import aiohttp

        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise UpstreamBroken(str(exc) or type(exc).__name__) from exc

    async def read(self) -> bytes:
        import aiohttp

        try:
            return await self._resp.read()
        except (TimeoutError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise UpstreamBroken(str(exc) or type(exc).__name__) from exc

    def close(self) -> None:
        self._resp.close()  # drops the connection unless the body was fully read and released

    def release(self) -> None:
        self._resp.release()


class AiohttpTransport:
    """aiohttp client session with a keep-alive pool; no auto-decompression (bytes unchanged)."""

    name = "aiohttp"

    def __init__(self, connect_timeout: float = 5.0, pool_size: int = 0) -> None:
        import aiohttp

        self._aiohttp = aiohttp
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=pool_size, ttl_dns_cache=300, enable_cleanup_closed=True),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._connect_timeout = connect_timeout
        self._timeouts: dict[float, Any] = {}

    @property
    def session(self) -> Any:
        return self._session

    def _timeout(self, read: float) -> Any:
        t = self._timeouts.get(read)
        if t is None:
            t = self._aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout, sock_read=read)
            if len(self._timeouts) < 64:
                self._timeouts[read] = t
        return t

    async def send(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes, read_timeout: float
    ) -> _AiohttpResponse:
        aiohttp = self._aiohttp
        try:
            resp = await self._session.request(
                method,
                url,
                data=body,
                headers=headers,
                allow_redirects=False,
                timeout=self._timeout(read_timeout),
            )
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            if isinstance(exc, aiohttp.ConnectionTimeoutError):
                raise UpstreamConnectError(f"connect timeout: {exc}") from exc
            raise UpstreamTimeout(str(exc) or "read timeout") from exc
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            raise UpstreamConnectError(f"{type(exc).__name__}: {exc}") from exc
        return _AiohttpResponse(resp)

    async def aclose(self) -> None:
        await self._session.close()


# ---- httpx --------------------------------------------------------------------------------------
class _HttpxResponse:
    __slots__ = ("_resp", "status", "headers")

    def __init__(self, resp: Any) -> None:
        self._resp = resp
        self.status = resp.status_code
        self.headers = [(k.lower(), v) for k, v in resp.headers.raw]

    async def chunks(self) -> AsyncIterator[bytes]:
        import httpx

        try:
            async for chunk in self._resp.aiter_raw():
                yield chunk
        except (httpx.TransportError, httpx.StreamError) as exc:
            raise UpstreamBroken(str(exc) or type(exc).__name__) from exc
        finally:
            await self._resp.aclose()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    def close(self) -> None:
        stream = self._resp.stream
        task = asyncio.ensure_future(self._resp.aclose())
        del stream
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    def release(self) -> None:
        pass


class HttpxTransport:
    name = "httpx"

    def __init__(self, connect_timeout: float = 5.0) -> None:
        import httpx

        self._httpx = httpx
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1000), trust_env=False
        )
        self._connect_timeout = connect_timeout

    async def send(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes, read_timeout: float
    ) -> _HttpxResponse:
        httpx = self._httpx
        request = self._client.build_request(
            method,
            url,
            content=body,
            headers=headers,
            timeout=httpx.Timeout(read_timeout, connect=self._connect_timeout),
        )
        # httpx adds accept/accept-encoding/user-agent defaults; drop those the client did not send.
        sent = {k for k, _ in headers}
        for default in ("accept", "accept-encoding", "user-agent"):
            if default not in sent and default in request.headers:
                del request.headers[default]
        try:
            resp = await self._client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.WriteError) as exc:
            raise UpstreamConnectError(f"{type(exc).__name__}: {exc}") from exc
        except httpx.TimeoutException as exc:
            raise UpstreamTimeout(str(exc) or "read timeout") from exc
        except httpx.TransportError as exc:
            raise UpstreamConnectError(f"{type(exc).__name__}: {exc}") from exc
        return _HttpxResponse(resp)

    async def aclose(self) -> None:
        await self._client.aclose()


def make_transport(name: str, connect_timeout: float) -> Transport:
    return HttpxTransport(connect_timeout) if name == "httpx" else AiohttpTransport(connect_timeout)


# ---- forwarding ---------------------------------------------------------------------------------
@dataclass(slots=True)
class ProxySettings:
    retries: int = 2
    request_timeout: float = 600.0
    engine_api_key: str | None = None


@dataclass(slots=True)
class ForwardState:
    """What the forward did, read by the caller's accounting (also after a cancellation)."""

    engine: Engine | None = None
    status: str = "none"
    started: bool = False  # a byte (the status line) reached the client: no retry, no error JSON
    finished: bool = False  # the last byte was handed to the server: a disconnect now is not an abort


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
        self, headers: list[tuple[bytes, bytes]], request_id: bytes
    ) -> list[tuple[str, str]]:
        """Client headers minus hop-by-hop and credentials, plus the request id and the engines' key."""
        out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers if k not in _REQUEST_DROP]
        if b"x-request-id" not in (k for k, _ in headers):
            out.append(("x-request-id", request_id.decode("latin-1")))
        key = self._settings().engine_api_key
        if key:
            out.append(("authorization", "Bearer " + key))
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
        state: ForwardState,
        started_at: float,
    ) -> None:
        """Forward with retries; raises :class:`RouterError` when nothing was sent to the client."""
        settings = self._settings()
        registry = self._registry
        metrics = self._metrics
        up_headers = self.upstream_headers(headers, request_id)
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
                await self._respond(send, resp, engine, ctx, request_id, state, started_at)
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
        for k, v in resp.headers:
            lk = k.lower()
            if lk in HOP_BY_HOP:
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
                raise RouterError(
                    502, f"Engine {engine.name} broke the response: {exc}", code="upstream_broken"
                ) from None
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
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        state.finished = True
        await send({"type": "http.response.body", "body": b""})
