"""Upstream client on httpx (pooled AsyncClient; raw bytes, no decoding)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx

from vllm_stack.upstream.base import UpstreamBroken, UpstreamConnectError, UpstreamTimeout


class _HttpxResponse:
    __slots__ = ("_resp", "status", "headers")

    def __init__(self, resp: httpx.Response) -> None:
        self._resp = resp
        self.status = resp.status_code
        self.headers = list(resp.headers.raw)

    complete = False  # not known before the iterator ends

    async def chunks(self) -> AsyncIterator[bytes]:
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
        task = asyncio.ensure_future(self._resp.aclose())
        task.add_done_callback(lambda t: None if t.cancelled() else t.exception())


class HttpxTransport:
    name = "httpx"

    def __init__(self, connect_timeout: float = 5.0) -> None:
        self._client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=1000), trust_env=False
        )
        self._connect_timeout = connect_timeout

    async def send(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes, read_timeout: float
    ) -> _HttpxResponse:
        request = self._client.build_request(
            method,
            url,
            content=body,
            headers=headers,
            timeout=httpx.Timeout(read_timeout, connect=self._connect_timeout),
        )
        # httpx adds accept/accept-encoding/user-agent defaults; drop those the client did not send.
        sent = {k.lower() for k, _ in headers}
        for default in (b"accept", b"accept-encoding", b"user-agent"):
            if default not in sent and default.decode() in request.headers:
                del request.headers[default.decode()]
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
