"""Upstream client on aiohttp (pooled session; no auto-decompression so bytes pass unchanged)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from vllm_stack.upstream.base import UpstreamBroken, UpstreamConnectError, UpstreamTimeout

_BROKEN = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)


class _AiohttpResponse:
    __slots__ = ("_resp", "status", "headers")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers = list(resp.raw_headers)

    complete = False  # not known before the iterator ends

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._resp.content.iter_any():
                yield chunk
        except _BROKEN as exc:
            raise UpstreamBroken(str(exc) or type(exc).__name__) from exc
        self._resp.release()

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except _BROKEN as exc:
            raise UpstreamBroken(str(exc) or type(exc).__name__) from exc

    def close(self) -> None:
        self._resp.close()


class AiohttpTransport:
    name = "aiohttp"

    def __init__(self, connect_timeout: float = 5.0) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._connect_timeout = connect_timeout
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}

    def _timeout(self, read: float) -> aiohttp.ClientTimeout:
        t = self._timeouts.get(read)
        if t is None:
            t = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout, sock_read=read)
            if len(self._timeouts) < 64:
                self._timeouts[read] = t
        return t

    async def send(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes, read_timeout: float
    ) -> _AiohttpResponse:
        str_headers: Any = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in headers]
        try:
            resp = await self._session.request(
                method,
                url,
                data=body,
                headers=str_headers,
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
