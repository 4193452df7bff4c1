"""The contract between the proxy and an upstream HTTP client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol


class UpstreamConnectError(Exception):
    """The request never reached an engine that could answer (safe to retry elsewhere)."""


class UpstreamTimeout(Exception):
    """The engine accepted the request but did not answer in time."""


class UpstreamBroken(Exception):
    """The engine's response broke off mid-way."""


class UpstreamResponse(Protocol):
    status: int
    headers: list[tuple[bytes, bytes]]  # raw, as received (names in any case)

    @property
    def complete(self) -> bool:
        """True once the whole body was received (lets the proxy send the last chunk as final)."""
        ...

    def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (raises :class:`UpstreamBroken`)."""
        ...

    async def read(self) -> bytes:
        """The whole body (raises :class:`UpstreamBroken`)."""
        ...

    def close(self) -> None:
        """Abort: drop the connection unless the body was completely read (the engine then aborts)."""
        ...


class Transport(Protocol):
    name: str

    async def send(
        self, method: str, url: str, headers: list[tuple[bytes, bytes]], body: bytes, read_timeout: float
    ) -> UpstreamResponse:
        """Send a request; return once the status line and headers arrived.

        ``headers`` must not contain ``host``, ``content-length`` or hop-by-hop headers.
        Raises :class:`UpstreamConnectError` or :class:`UpstreamTimeout`.
        """
        ...

    async def aclose(self) -> None: ...
