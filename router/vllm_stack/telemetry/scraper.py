"""Scrapes every engine's ``/metrics`` concurrently and keeps the load figures routing uses.

Only the few vLLM 0.32 series routing needs are parsed (a line-prefix test before any split), summed
over ``model_name``. A failed scrape clears the figures and counts an error: stale or missing data is
*unknown* to the scheduler, never zero (a dead engine must not look idle).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import aiohttp

from vllm_stack.engines.engine import Engine, EngineTelemetry
from vllm_stack.metrics import RouterMetrics

log = logging.getLogger(__name__)

INTERVAL_READ = 0.5  # seconds: the longest wait before a changed scrape interval is seen

#: Fetches an engine's ``/metrics`` text; raises on failure.
MetricsFetcher = Callable[[Engine], Awaitable[str]]

_WANTED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:prefix_cache_queries_total": "pq",
    "vllm:prefix_cache_hits_total": "ph",
}


_CACHE_CONFIG = "vllm:cache_config_info{"
_LABEL = re.compile(r'(block_size|num_gpu_blocks)="(\d+)"')
# vLLM sets this gauge to the current time under a new label set whenever the running or waiting
# adapters change, and the old label sets stay in the exposition: the latest (largest value) is now.
_LORA_INFO = "vllm:lora_requests_info{"
_LORA_LABEL = re.compile(r'(max_lora|running_lora_adapters|waiting_lora_adapters)="([^"]*)"')


def _adapter_set(value: str) -> frozenset[str]:
    return frozenset(name for name in value.split(",") if name)


def parse_engine_metrics(text: str, now: float | None = None) -> EngineTelemetry:
    """Sum the wanted series over their labels. Raises ``ValueError`` when the load series are absent."""
    sums: dict[str, float] = {}
    geometry: dict[str, int] = {}
    lora: dict[str, str] | None = None
    lora_at = float("-inf")
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        if line.startswith(_CACHE_CONFIG):
            geometry.update((k, int(v)) for k, v in _LABEL.findall(line))
            continue
        if line.startswith(_LORA_INFO):
            try:
                at = float(line.rsplit("}", 1)[1].split()[0])
            except (IndexError, ValueError):
                continue
            if at > lora_at:
                lora_at, lora = at, dict(_LORA_LABEL.findall(line))
            continue
        name_end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if i != -1 and i < name_end:
                name_end = i
        key = _WANTED.get(line[:name_end])
        if key is None:
            continue
        try:
            value = (
                float(line.rsplit(" ", 1)[1]) if "}" not in line else float(line.rsplit("}", 1)[1].split()[0])
            )
        except (IndexError, ValueError):
            continue
        sums[key] = sums.get(key, 0.0) + value
    if "running" not in sums or "waiting" not in sums:
        raise ValueError("engine /metrics lacks vllm:num_requests_running / vllm:num_requests_waiting")
    max_loras: int | None = None
    if lora is not None and lora.get("max_lora", "").isdigit():
        max_loras = int(lora["max_lora"])
    return EngineTelemetry(
        running=sums["running"],
        waiting=sums["waiting"],
        kv_cache_usage=sums.get("kv"),
        prefix_cache_queries=sums.get("pq"),
        prefix_cache_hits=sums.get("ph"),
        scraped_at=time.monotonic() if now is None else now,
        block_size=geometry.get("block_size"),
        num_blocks=geometry.get("num_gpu_blocks"),
        max_loras=max_loras,
        running_adapters=None if lora is None else _adapter_set(lora.get("running_lora_adapters", "")),
        waiting_adapters=None if lora is None else _adapter_set(lora.get("waiting_lora_adapters", "")),
    )


class Liveness(Protocol):
    """What a scrape's outcome says about the engine (the registry acts on it)."""

    def engine_answered(self, engine: Engine) -> None: ...

    def engine_silent(self, engine: Engine) -> None: ...

    def engine_unreachable(self, engine: Engine) -> None: ...


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
            telemetry = engine.telemetry = parse_engine_metrics(text)
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
