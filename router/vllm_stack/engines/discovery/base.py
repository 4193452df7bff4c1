"""The discovery interface shared by every source of engine endpoints.

A discovery source only knows *where* engines are (and whether the platform considers them ready).
It reports the full current list on every change; the registry diffs snapshots, learns model names
from each engine and runs health checks. Keeping the interface this small lets the static and the
Kubernetes sources be written and tested independently.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class EndpointInfo:
    """One engine endpoint as seen by a discovery source."""

    name: str  # pod name, or host:port for static
    url: str  # http://ip:port
    ready: bool = True
    kv_events: str | None = None  # ZMQ endpoint of its KV events, when discovery knows it
    kv_replay: str | None = None  # ... and of their replay
    role: str | None = None  # prefill / decode / both, when discovery knows it (a pod label)
    kind: str | None = None  # the engine kind's name (vllm_stack.engines.kinds), when discovery knows it


SnapshotSink = Callable[[list[EndpointInfo]], Awaitable[None]]


@dataclass
class DiscoveryStatus:
    """Whether a discovery source can currently see the platform, and why not.

    Kept by the source and read by ``GET /engines`` and the metrics collector at request time, so a
    failure that discovery itself cannot report through its snapshots (the last known endpoints stay
    while the API server refuses or is away) is visible to an operator: a Role missing a verb, an
    expired token, an unreachable API server.
    """

    source: str
    healthy: bool = False  # True while discovery follows the platform (listed, and watching)
    error: str | None = None  # the last failure, one line, while unhealthy
    reason: str | None = None  # its class: forbidden, unauthorized, gone, unreachable, server_error, ...
    consecutive_failures: int = 0
    failures_total: dict[str, int] = field(default_factory=dict)  # reason -> count, since start
    last_synced: float | None = None  # wall-clock time of the last successful list
    changed: float = field(default_factory=time.time)  # wall-clock time healthy last flipped

    def listed(self) -> None:
        """A list succeeded: the endpoints reflect the platform as of now."""
        self.last_synced = time.time()

    def watching(self) -> None:
        """Changes are followed from now on (a watch accepted; for a fixed list, at once)."""
        if not self.healthy:
            self.changed = time.time()
        self.healthy, self.error, self.reason, self.consecutive_failures = True, None, None, 0

    def failed(self, reason: str, error: str) -> None:
        """An attempt failed; ``error`` is the one-line message an operator reads."""
        if self.healthy:
            self.changed = time.time()
        self.healthy, self.error, self.reason = False, error, reason
        self.consecutive_failures += 1
        self.failures_total[reason] = self.failures_total.get(reason, 0) + 1

    def describe(self) -> dict[str, Any]:
        """For ``GET /engines``."""
        return {
            "source": self.source,
            "healthy": self.healthy,
            "error": self.error,
            "reason": self.reason,
            "consecutive_failures": self.consecutive_failures,
            "failures_total": dict(self.failures_total),
            "last_synced": self.last_synced,
            "since": self.changed,
        }


class Discovery(Protocol):
    """A source of engine endpoints, and its own view of whether it currently works."""

    status: DiscoveryStatus

    async def run(self, sink: SnapshotSink) -> None:
        """Run until cancelled; call ``sink`` with the FULL current endpoint list on every change."""
        ...
