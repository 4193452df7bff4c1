"""Engine load as the load-aware plugins see it: router in-flight plus the engine's own queue."""

from __future__ import annotations

import time
from collections.abc import Sequence

from vllm_stack.discovery.engine import Engine


def engine_loads(engines: Sequence[Engine]) -> list[float]:
    """In-flight requests (exact, the router's own count) plus ``vllm:num_requests_waiting``.

    The queue term is added only when every candidate has fresh telemetry: stale data is unknown,
    and comparing a known queue with an unknown one would push traffic to the engine we know least.
    """
    now = time.monotonic()
    waiting: list[float] = []
    for e in engines:
        t = e.fresh_telemetry(now)
        if t is None:
            return [float(e.in_flight) for e in engines]
        waiting.append(t.waiting)
    return [e.in_flight + w for e, w in zip(engines, waiting, strict=True)]
