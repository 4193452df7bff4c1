"""Static discovery: a fixed list of engine URLs (from the command line or the YAML file).

The list can be replaced at run time (YAML hot reload); the new snapshot is pushed to the registry,
which adds and removes engines without a restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from urllib.parse import urlsplit

from vllm_stack.engines.discovery.base import DiscoveryStatus, EndpointInfo, SnapshotSink


def endpoint_name(url: str) -> str:
    """``host:port`` of a URL: the engine label under static discovery (see docs/contracts.md)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"{parts.hostname}:{port}"


class StaticDiscovery:
    """Reports a fixed list of endpoints, and the new list whenever :meth:`update` is called."""

    def __init__(
        self, urls: Sequence[str], roles: Sequence[str] = (), kinds: Sequence[str | None] = ()
    ) -> None:
        self._endpoints = self._build(urls, roles, kinds)
        self._changed = asyncio.Event()
        self.status = DiscoveryStatus("static")
        self.status.listed()  # a fixed list cannot fail to be read
        self.status.watching()

    @staticmethod
    def _build(urls: Sequence[str], roles: Sequence[str], kinds: Sequence[str | None]) -> list[EndpointInfo]:
        """One endpoint per URL; ``roles`` (prefill / decode / both) and ``kinds`` (the engine kinds,
        None for the default) one per URL, or empty (all both, all the default kind)."""
        given = list(roles) or [None] * len(urls)
        given_kinds = list(kinds) or [None] * len(urls)
        return [
            EndpointInfo(name=endpoint_name(u), url=u.rstrip("/"), role=r, kind=k)
            for u, r, k in zip(urls, given, given_kinds, strict=True)
        ]

    def update(
        self, urls: Sequence[str], roles: Sequence[str] = (), kinds: Sequence[str | None] = ()
    ) -> None:
        """Replace the list (hot reload); the running :meth:`run` pushes it to the sink."""
        endpoints = self._build(urls, roles, kinds)
        if endpoints != self._endpoints:
            self._endpoints = endpoints
            self._changed.set()

    async def run(self, sink: SnapshotSink) -> None:
        while True:
            self._changed.clear()
            await sink(list(self._endpoints))
            await self._changed.wait()
