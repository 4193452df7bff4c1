"""The KV-event feed: one ZMQ subscription per engine, for the plugins that index engines' caches.

Where an engine publishes: the endpoint its discovery reported (the pod's ``kv-events`` container port
under Kubernetes), otherwise what the engine itself says where its kind says to ask (vLLM:
``GET /kv_event_sources``, a bind address such as ``tcp://*:5557``, whose ``*`` is the engine's own
host; SGLang: ``GET /server_info``). Batches are decoded by the engine's kind. Engines without events are asked again
now and then (an engine may be restarted with them on).

Each message is ``[topic, sequence (8 bytes, big-endian), msgpack batch]``. The sequence tells what
was lost: ZMQ drops messages when a subscriber falls behind its high-water mark, and a subscriber that
connects late misses what came before.
- On the first message, or after a gap, the feed asks the engine's replay endpoint (when it has one)
  for the missing batches; the engine keeps its last ``buffer_steps`` batches.
- When no replay is possible, or the replay no longer covers the gap, the consumers drop that engine's
  entries and start again from what follows (an index that is empty for an engine is honest; one that
  is wrong sends requests where their prefix is not).
- A sequence that goes backwards is an engine that restarted: its cache is empty, and so is its entry.

Consumers (:class:`KvEventConsumer`) are the plugins whose index the events update; the router hands
the feed the current ones after each configuration (re)load, and the feed subscribes only while there
are some. Everything runs on the event loop (pyzmq's asyncio sockets), as does the matching, so an
index is never read half-updated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from vllm_stack.engines.engine import Engine
from vllm_stack.engines.kinds.base import EventSource
from vllm_stack.engines.kinds.vllm import KIND as VLLM
from vllm_stack.scheduling.index.kv_events import EventBatch

log = logging.getLogger(__name__)

END_OF_REPLAY = -1
REPLAY_TIMEOUT = 2.0
RECONCILE_INTERVAL = 2.0
RETRY_NO_EVENTS = 30.0  # seconds before asking an engine without events again
RECEIVE_HWM = 100_000  # batches queued in the socket before ZMQ drops (a gap, then recovered)


class KvEventConsumer(Protocol):
    """A plugin whose index engines' KV events keep exact."""

    def apply_events(self, engine: Engine, batch: EventBatch) -> None: ...

    def engine_reset(self, engine: Engine) -> None:
        """Forget what the engine holds (it restarted, cleared, or events were lost for good)."""
        ...


SourceFetcher = Callable[[Engine], Awaitable[Any]]

#: vLLM's reader of ``GET /kv_event_sources`` (the default kind's; other kinds read their own answer).
sources_from_engine = VLLM.kv_sources


@dataclass
class StreamStats:
    """What one subscription has seen, for ``GET /engines`` and the tests."""

    endpoint: str
    batches: int = 0
    last_seq: int | None = None
    replayed: int = 0
    gaps: int = 0
    resets: int = 0
    decode_errors: int = 0
    connected_at: float = field(default_factory=time.monotonic)


class KvEventFeed:
    """Keeps one subscription per engine that publishes KV events, while some consumer wants them."""

    def __init__(self, engines: Callable[[], Sequence[Engine]], fetch_sources: SourceFetcher) -> None:
        self._engines = engines
        self._fetch_sources = fetch_sources
        self.consumers: tuple[KvEventConsumer, ...] = ()
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._next_ask: dict[str, float] = {}
        self.stats: dict[str, list[StreamStats]] = {}
        self._wake = asyncio.Event()
        self._caught_up = False  # following() was true once with a healthy engine

    # ---- subscriptions -------------------------------------------------------------------------------
    async def run(self, interval: float = RECONCILE_INTERVAL) -> None:
        """Until cancelled: subscribe to engines that joined, drop those that left; at once when
        :meth:`kick` says an engine turned healthy, else every ``interval`` seconds."""
        try:
            while True:
                self._wake.clear()
                await self.reconcile()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(interval):
                        await self._wake.wait()
        finally:
            self.close()

    def kick(self) -> None:
        """An engine turned healthy: subscribe to it now, not at the next round (what a router replica
        routes before it follows an engine's events, it routes without them)."""
        self._wake.set()

    def following(self) -> bool:
        """For readiness: whether every healthy engine's events are followed, or its publisher was asked
        for and it has none. A router that routes by the engines' events should take requests only once
        it follows them. Once true with a healthy engine it stays true: an engine that joins later is
        subscribed to at once (:meth:`kick`), and a router already serving should not leave its Service
        for that moment. True while no consumer wants events."""
        if self._caught_up or not self.consumers:
            return True
        healthy = False
        for engine in self._engines():
            if not engine.healthy:
                continue
            healthy = True
            task = self._tasks.get(engine.name)
            if (task is None or task.done()) and engine.name not in self._next_ask:
                return False
        self._caught_up = healthy
        return True

    async def reconcile(self) -> None:
        engines = {e.name: e for e in self._engines()} if self.consumers else {}
        for name in [n for n in self._tasks if n not in engines]:
            self._tasks.pop(name).cancel()
            self.stats.pop(name, None)
            self._next_ask.pop(name, None)
        now = time.monotonic()
        for name, engine in engines.items():
            task = self._tasks.get(name)
            if task is not None and not task.done():
                continue
            if not engine.healthy or self._next_ask.get(name, 0.0) > now:
                continue
            sources = await self._sources(engine)
            if not sources:
                self._next_ask[name] = now + RETRY_NO_EVENTS
                continue
            self._tasks[name] = asyncio.ensure_future(self._follow(engine, sources))

    async def _sources(self, engine: Engine) -> list[EventSource]:
        if engine.kv_events_endpoint:
            return [EventSource(engine.kv_events_endpoint, engine.kv_replay_endpoint)]
        try:
            return engine.kind.kv_sources(await self._fetch_sources(engine), engine.url)
        except Exception as exc:  # noqa: BLE001 - an engine without the endpoint, or unreachable now
            log.debug("no KV-event sources from %s: %s", engine.name, exc)
            return []

    async def _follow(self, engine: Engine, sources: list[EventSource]) -> None:
        stats = self.stats[engine.name] = [StreamStats(s.endpoint) for s in sources]
        try:
            await asyncio.gather(*(self._stream(engine, s, st) for s, st in zip(sources, stats, strict=True)))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("KV events of %s stopped; subscribing again", engine.name)
            self._reset(engine)

    def _context(self) -> zmq.asyncio.Context:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        return self._ctx

    async def _stream(self, engine: Engine, source: EventSource, stats: StreamStats) -> None:
        sub = self._context().socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(source.endpoint)
            log.info("following KV events of %s at %s", engine.name, source.endpoint)
            while True:
                frames = await sub.recv_multipart(copy=False)
                if len(frames) != 3:
                    stats.decode_errors += 1
                    continue
                seq = int.from_bytes(frames[1].bytes, "big", signed=True)
                last = stats.last_seq
                if last is None or seq > last + 1:
                    if last is not None:
                        stats.gaps += 1
                    start = 0 if last is None else last + 1
                    if not await self._replay(engine, source, stats, start, seq) and last is not None:
                        self._reset(engine)
                        stats.resets += 1
                elif seq <= last:
                    log.info("KV events of %s restarted at %d (engine restarted)", engine.name, seq)
                    self._reset(engine)
                    stats.resets += 1
                self._apply(engine, frames[2].buffer, stats)
                stats.last_seq = seq
        finally:
            sub.close(linger=0)

    async def _replay(
        self, engine: Engine, source: EventSource, stats: StreamStats, start: int, upto: int
    ) -> bool:
        """Apply batches ``start`` .. ``upto - 1`` from the engine's replay buffer. True when the index is
        consistent after it: all came, or the buffer had lost the first ones and the engine's entries
        were dropped before applying the rest."""
        if start >= upto:
            return True
        if source.replay is None:
            return False
        sock = self._context().socket(zmq.DEALER)
        expected = start
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(source.replay)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            while True:
                async with asyncio.timeout(REPLAY_TIMEOUT):  # (not wait_for, which can lose a cancellation)
                    frames = await sock.recv_multipart(copy=False)
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2].bytes, "big", signed=True)
                if seq == END_OF_REPLAY:
                    break
                if seq < expected or seq >= upto:
                    continue
                if seq > expected:  # the buffer no longer holds the start: what is missing is lost
                    self._reset(engine)
                    stats.resets += 1
                self._apply(engine, frames[3].buffer, stats)
                stats.replayed += 1
                expected = seq + 1
        except TimeoutError:
            log.warning("replay from %s timed out", source.replay)
        finally:
            sock.close(linger=0)
        return expected == upto

    def _apply(self, engine: Engine, payload: memoryview, stats: StreamStats) -> None:
        try:
            batch = engine.kind.decode_events(payload)
        except msgspec.DecodeError:
            stats.decode_errors += 1
            return
        stats.batches += 1
        for consumer in self.consumers:
            consumer.apply_events(engine, batch)

    def _reset(self, engine: Engine) -> None:
        for consumer in self.consumers:
            consumer.engine_reset(engine)

    def describe(self) -> dict[str, Any]:
        return {
            name: [
                {k: getattr(s, k) for k in ("endpoint", "batches", "last_seq", "replayed", "gaps", "resets")}
                for s in streams
            ]
            for name, streams in self.stats.items()
        }

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        if self._ctx is not None:
            with contextlib.suppress(Exception):
                self._ctx.destroy(linger=0)  # closes the sockets of cancelled streams too
            self._ctx = None
