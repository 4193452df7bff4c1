"""The discovery interface shared by every source of engine endpoints.

A discovery source only knows *where* engines are (and whether the platform considers them ready).
It reports the full current list on every change; the registry diffs snapshots, learns model names
from each engine and runs health checks. Keeping the interface this small lets the static and the
Kubernetes sources be written and tested independently.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    """One engine endpoint as seen by a discovery source."""

    name: str  # pod name, or host:port for static
    url: str  # http://ip:port
    ready: bool = True
    kv_events: str | None = None  # ZMQ endpoint of its KV events, when discovery knows it
    kv_replay: str | None = None  # ... and of their replay
    role: str | None = None  # prefill / decode / both, when discovery knows it (a pod label)


SnapshotSink = Callable[[list[EndpointInfo]], Awaitable[None]]


class Discovery(Protocol):
    """A source of engine endpoints."""

    async def run(self, sink: SnapshotSink) -> None:
        """Run until cancelled; call ``sink`` with the FULL current endpoint list on every change."""
        ...
