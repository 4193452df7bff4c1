"""Scrapes every engine's ``/metrics`` concurrently and keeps the load figures routing uses.

What the series are and how they are read is the engine's kind's (:mod:`vllm_stack.engines.kinds`:
vLLM's sums a few ``vllm:`` series over ``model_name``). A failed scrape clears the figures and counts an error: stale or missing data is
*unknown* to the scheduler, never zero (a dead engine must not look idle).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp

from vllm_stack.engines.engine import Engine
from vllm_stack.engines.kinds.vllm import KIND as VLLM
from vllm_stack.metrics import RouterMetrics

log = logging.getLogger(__name__)

INTERVAL_READ = 0.5  # seconds: the longest wait before a changed scrape interval is seen

#: Fetches an engine's ``/metrics`` text; raises on failure.
MetricsFetcher = Callable[[Engine], Awaitable[str]]

#: vLLM's parser, the default kind's (its tests and tools name it here).
parse_engine_metrics = VLLM.parse_metrics


class Liveness(Protocol):
    """What a scrape's outcome says about the engine (the registry acts on it)."""

    def engine_answered(self, engine: Engine) -> None: ...

    def engine_silent(self, engine: Engine) -> None: ...

    def engine_unreachable(self, engine: Engine) -> None: ...

    def set_sleeping(self, engine: Engine, sleeping: bool, level: int = 0) -> None: ...


class EngineScraper:
    """Periodic concurrent scrape of every engine known to a registry.

    Scrapes run every second, more often than health checks, so their outcome also feeds liveness:
    a refused connection means the engine is gone, a timeout that it hangs (see :class:`Liveness`).
    """

    def __init__(
        self,
        engines: Callable[[], list[Engine]],
        fetch: MetricsFetcher,
        metrics: RouterMetrics,
        liveness: Liveness | None = None,
        interval: float = 1.0,
    ) -> None:
        self.interval = interval  # seconds between rounds (read at each round: a reload may change it)
        self._engines = engines
        self._fetch = fetch
        self._metrics = metrics
        self._liveness = liveness
        # Told after every scrape that gave figures (e.g. dispatch requests queued for saturated engines)
        self.on_scraped: list[Callable[[Engine], None]] = []

    async def scrape(self, engine: Engine) -> None:
        liveness = self._liveness
        try:
            text = await self._fetch(engine)
        except Exception as exc:  # noqa: BLE001 - any failure makes the data unknown
            self._failed(engine, exc)
            if liveness is not None:
                if isinstance(exc, TimeoutError):
                    liveness.engine_silent(engine)
                elif isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
                    liveness.engine_unreachable(engine)
            return
        if liveness is not None:
            liveness.engine_answered(engine)
        try:
            telemetry = engine.telemetry = engine.kind.parse_metrics(text)
        except ValueError as exc:
            self._failed(engine, exc)
            return
        telemetry.in_flight = engine.in_flight
        if telemetry.block_size:
            engine.kv_block_size = telemetry.block_size
        if telemetry.num_blocks:
            engine.kv_blocks = telemetry.num_blocks
        if telemetry.max_loras is not None:
            engine.max_loras = telemetry.max_loras
        level = telemetry.sleep_level
        if level is not None and liveness is not None and (level > 0) != engine.sleeping:
            liveness.set_sleeping(engine, level > 0, level)  # asleep or awoken without the router's call
        if telemetry.waiting > 0 and telemetry.running > (engine.running_slots or 0):
            engine.running_slots = int(telemetry.running)
        for fn in self.on_scraped:
            fn(engine)

    def _failed(self, engine: Engine, exc: Exception) -> None:
        engine.telemetry = None
        self._metrics.engine_scrape_errors.labels(engine.name).inc()
        log.debug("scrape of %s failed: %s", engine.name, exc)

    async def scrape_all(self) -> None:
        engines = self._engines()
        if engines:
            await asyncio.gather(*(self.scrape(e) for e in engines))

    async def run(self) -> None:
        """Scrape every :attr:`interval` seconds until cancelled (a slow round delays, never overlaps,
        the next). The wait is read again every :data:`INTERVAL_READ` seconds at most, so a reload's
        new interval applies within that, not after the old one."""
        while True:
            started = time.monotonic()
            await self.scrape_all()
            while (left := self.interval - (time.monotonic() - started)) > 0:  # noqa: ASYNC110 - a number read twice a second, no event to wait for
                await asyncio.sleep(min(left, INTERVAL_READ))
