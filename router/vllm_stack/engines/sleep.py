"""Sleeping engines (vLLM's sleep mode): the calls that put an engine to sleep, wake it and ask it, and
what the router learns from their answers.

vLLM serves ``POST /sleep?level=N&mode=M``, ``POST /wake_up?tags=T...`` and ``GET /is_sleeping`` (with
``VLLM_SERVER_DEV_MODE=1`` and ``--enable-sleep-mode``). An engine asleep keeps answering its API
server's paths (models, metrics), so it stays healthy here; it only leaves the candidates
(:meth:`~vllm_stack.engines.registry.EngineRegistry.set_sleeping`, one index rebuild when its state
changes, nothing per request). Its state is learnt from every scrape (``vllm:engine_sleep_state``, the
kind's parser) and, at once, after each sleep or wake-up call made through the router. A request for a
model whose engines all sleep wakes one of them (:meth:`SleepControl.wake_for`), one call per engine at
a time, while the request waits in the model's queue as for scale from zero; a wake-up that failed is
tried again for that engine at most once per :data:`WAKE_RETRY_AFTER` seconds (one warning each time),
however many requests arrive meanwhile (they wait in the queue as for any wake-up).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import orjson

from vllm_stack.engines.engine import Engine
from vllm_stack.engines.registry import EngineRegistry
from vllm_stack.metrics import RouterMetrics

log = logging.getLogger(__name__)

#: Seconds before a wake-up that failed is tried again on the same engine: a few tries within the
#: queue's default 60 s wait, without a call and a warning per request while the engine cannot wake.
WAKE_RETRY_AFTER = 10.0

#: One call to an engine: (engine, method, path, query parameters) -> (status, body, content type).
#: Raises on a transport failure.
EngineCall = Callable[[Engine, str, str, Sequence[tuple[str, str]]], Awaitable[tuple[int, bytes, str]]]


class SleepControl:
    """Calls the engines' sleep endpoints and keeps the registry's view of who sleeps up to date."""

    __slots__ = ("_call", "_failed", "_metrics", "_registry", "_waking", "retry_after")

    def __init__(self, registry: EngineRegistry, metrics: RouterMetrics, call: EngineCall) -> None:
        self._registry = registry
        self._metrics = metrics
        self._call = call
        self._waking: dict[str, asyncio.Task[None]] = {}  # engine name -> its wake-up call in flight
        # engine name -> when its last wake-up failed (monotonic); entries older than retry_after go
        self._failed: dict[str, float] = {}
        self.retry_after = WAKE_RETRY_AFTER

    async def forward(
        self, engine: Engine, method: str, path: str, params: Sequence[tuple[str, str]]
    ) -> tuple[int, bytes, str]:
        """A sleep endpoint's call sent to ``engine`` as the client asked it; the state it reports (a GET:
        ``/is_sleeping``) or, after a sleep or wake-up (a POST), what ``/is_sleeping`` then says, is
        applied before returning."""
        status, body, ctype = await self._call(engine, method, path, params)
        if status < 300:
            if method == "POST":
                await self.refresh(engine, _level(params, engine))
            else:
                self._learn(engine, body, _level(params, engine))
        return status, body, ctype

    async def refresh(self, engine: Engine, level: int = 0) -> None:
        """Ask the engine whether it sleeps (``level``: the sleep level to note when it does)."""
        try:
            status, body, _ = await self._call(engine, "GET", "/is_sleeping", ())
        except Exception as exc:  # noqa: BLE001 - the next scrape tells
            log.warning("engine %s: /is_sleeping failed: %s", engine.name, exc)
            return
        if status == 200:
            self._learn(engine, body, level)

    def _learn(self, engine: Engine, body: bytes, level: int) -> None:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        asleep = doc.get("is_sleeping") if isinstance(doc, dict) else None
        if isinstance(asleep, bool):
            self._registry.set_sleeping(engine, asleep, max(level, 1) if asleep else 0)

    def wake_for(self, model: str) -> bool:
        """A request of ``model`` found no awake engine: wake one of its sleeping engines (the least
        deeply asleep) unless one is being woken already. False when none of them sleeps."""
        sleepers = self._registry.sleeping(model)
        if not sleepers:
            return False
        if any(e.name in self._waking for e in sleepers):
            return True
        now = time.monotonic()
        ready = [e for e in sleepers if now - self._failed.get(e.name, -self.retry_after) >= self.retry_after]
        if (
            not ready
        ):  # each failed to wake a moment ago: the request waits for the next try or the queue's timeout
            return True
        engine = min(ready, key=lambda e: (e.sleep_level, e.name))
        task = asyncio.ensure_future(self._wake(engine))
        self._waking[engine.name] = task
        task.add_done_callback(lambda _t, name=engine.name: self._waking.pop(name, None))
        return True

    async def _wake(self, engine: Engine) -> None:
        log.info("waking engine %s for a request that has no awake engine", engine.name)
        try:
            status, body, _ = await self._call(engine, "POST", "/wake_up", ())
        except Exception as exc:  # noqa: BLE001 - counted; the queue's timeout answers the request
            log.warning("engine %s: wake-up failed: %s", engine.name, exc)
            self._wake_failed(engine)
            return
        if status >= 300:
            log.warning("engine %s: wake-up answered %d: %s", engine.name, status, body[:200])
            self._wake_failed(engine)
            return
        self._failed.pop(engine.name, None)
        self._metrics.engine_wakeups.labels("woken").inc()
        await self.refresh(engine)

    def _wake_failed(self, engine: Engine) -> None:
        """Counted, and noted so the next try on ``engine`` waits :attr:`retry_after` seconds (entries
        that old are dropped here: the map holds only engines failing now)."""
        self._metrics.engine_wakeups.labels("failed").inc()
        now = time.monotonic()
        self._failed = {n: t for n, t in self._failed.items() if now - t < self.retry_after}
        self._failed[engine.name] = now

    async def close(self) -> None:
        for task in list(self._waking.values()):
            task.cancel()
        if self._waking:
            await asyncio.gather(*self._waking.values(), return_exceptions=True)


#: vLLM's sleep levels (``POST /sleep?level=``): the only ones the router notes an engine asleep at
SLEEP_LEVELS = ("0", "1", "2")


def valid_level(value: str) -> bool:
    """Whether a ``level`` parameter is a number (ASCII digits: ``str.isdigit`` also takes ``²``, which
    ``int`` refuses). The router refuses anything else (400); a number vLLM does not take is the engine's
    own refusal (its 422), passed back."""
    return value.isascii() and value.isdigit()


def _level(params: Sequence[tuple[str, str]], engine: Engine) -> int:
    """The sleep level a ``/sleep`` call asked for (vLLM's default 1), else the one it sleeps at; a level
    vLLM does not have is never noted."""
    for key, value in params:
        if key == "level" and value in SLEEP_LEVELS:
            return int(value)
    return max(engine.sleep_level, 1)
