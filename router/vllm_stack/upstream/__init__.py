"""Upstream HTTP clients (router -> engine), interchangeable behind :class:`~.base.Transport`.

Three implementations, compared by ``benchmarks/router``: ``raw`` (our own keep-alive HTTP/1.1
client on asyncio protocols + httptools, the default: the proxy needs only a tiny part of HTTP, and
general clients spend most of the router's CPU), ``aiohttp`` and ``httpx``.
"""

from __future__ import annotations

from vllm_stack.upstream.base import (
    Transport,
    UpstreamBroken,
    UpstreamConnectError,
    UpstreamResponse,
    UpstreamTimeout,
)

UPSTREAM_CLIENTS = ("raw", "aiohttp", "httpx")


def make_transport(name: str, connect_timeout: float) -> Transport:
    """Build the named client (imports only the one used)."""
    if name == "aiohttp":
        from vllm_stack.upstream.aiohttp_client import AiohttpTransport

        return AiohttpTransport(connect_timeout)
    if name == "httpx":
        from vllm_stack.upstream.httpx_client import HttpxTransport

        return HttpxTransport(connect_timeout)
    from vllm_stack.upstream.raw_client import RawTransport

    return RawTransport(connect_timeout)


__all__ = [
    "UPSTREAM_CLIENTS",
    "Transport",
    "UpstreamBroken",
    "UpstreamConnectError",
    "UpstreamResponse",
    "UpstreamTimeout",
    "make_transport",
]
