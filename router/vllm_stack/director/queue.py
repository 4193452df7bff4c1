"""The router's per-model queue: requests that wait for an engine with room, strictly by priority.

A request waits here when every candidate engine is saturated (critical and standard requests; a
sheddable one is answered 429 instead) or when its model is configured but has no ready engine yet
(scale from zero). Within a model, the request with the highest priority leaves first, and among
equals the one that came first. A new request that would overtake a waiting one of at least its
priority joins the queue behind it instead of being scheduled.

It leaves when the scheduler gives it an engine: the queue tries its head whenever room may have
appeared (a request on one of the model's engines ended, an engine's figures were scraped, the
engine index changed) and on a half-second tick while anything waits. It also leaves, answered by
the director, when it waited ``queue_timeout`` (503 ``queue_timeout``), when its client went away, or
when the queue was full and a request of higher priority took its place (429 ``queue_full``).

Bounded: at most ``max_per_model`` live entries per model; entries of requests that left are
dropped lazily and the heap is compacted when they outnumber the live ones.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Iterable
from typing import Protocol

from vllm_stack.metrics import RouterMetrics
from vllm_stack.priority import criticality

#: Seconds between the queue's own tries while anything waits (a safety net under the event kicks).
TICK = 0.5


class Waiting(Protocol):
    """What the queue holds: a request that tries to leave when asked."""

    queue_seq: int  # its entry's sequence number while queued; 0 when not queued
    queued_at: float  # time.perf_counter() when it joined

    @property
    def priority(self) -> int: ...

    def try_dispatch(self) -> str | None:
        """Schedule it: the exit outcome (``dispatched``, ``failed``) when it left, None to stay."""
        ...

    def displaced(self) -> None:
        """It was pushed out of a full queue for a request of higher priority (answer it)."""
        ...


_Entry = tuple[int, int, Waiting]  # (-priority, sequence, request): heap order is the leaving order


class _ModelQueue:
    __slots__ = ("heap", "size")

    def __init__(self) -> None:
        self.heap: list[_Entry] = []
        self.size = 0  # live entries

    def head(self) -> _Entry | None:
        heap = self.heap
        while heap and heap[0][2].queue_seq != heap[0][1]:
            heapq.heappop(heap)  # a request that left
        return heap[0] if heap else None


class RequestQueue:
    """Per-model priority queues with one length bound each."""

    def __init__(self, metrics: RouterMetrics, max_per_model: int = 1000) -> None:
        self.metrics = metrics
        self.max_per_model = max_per_model
        self.length = 0  # live entries over all models (the hot path reads only this)
        self._queues: dict[str, _ModelQueue] = {}
        self._seq = 0
        self._kicked: set[str] = set()
        self._kick_scheduled = False
        self._tick: asyncio.TimerHandle | None = None

    # ---- joining and leaving -------------------------------------------------------------------------
    def ahead(self, model: str, priority: int) -> bool:
        """Whether a request of at least ``priority`` waits for ``model`` (a new one goes behind it)."""
        q = self._queues.get(model)
        if q is None or not q.size:
            return False
        head = q.head()
        return head is not None and -head[0] >= priority

    def add(self, model: str, request: Waiting) -> bool:
        """Queue ``request`` for ``model``; False when the queue is full of requests of at least its
        priority (one of lower priority is displaced to make room otherwise)."""
        q = self._queues.get(model)
        if q is None:
            q = self._queues[model] = _ModelQueue()
        if q.size >= self.max_per_model:
            victim = self._last(q)
            if victim is None or -victim[0] >= request.priority:
                return False
            self._leave(model, q, victim[2], "displaced")
            victim[2].displaced()
        self._seq += 1
        request.queue_seq = self._seq
        request.queued_at = time.perf_counter()
        heapq.heappush(q.heap, (-request.priority, self._seq, request))
        q.size += 1
        self.length += 1
        self._set_length(model, q)
        if self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(TICK, self._on_tick)
        return True

    def remove(self, model: str, request: Waiting, outcome: str) -> None:
        """``request`` leaves without an engine (``timeout``, ``client_closed``)."""
        q = self._queues.get(model)
        if q is not None and request.queue_seq:
            self._leave(model, q, request, outcome)
            if len(q.heap) > 2 * q.size + 16:
                q.heap = [e for e in q.heap if e[2].queue_seq == e[1]]
                heapq.heapify(q.heap)

    def _leave(self, model: str, q: _ModelQueue, request: Waiting, outcome: str) -> None:
        request.queue_seq = 0
        q.size -= 1
        self.length -= 1
        self._set_length(model, q)
        cls = criticality(request.priority)
        self.metrics.queue_exit(model, cls, outcome, time.perf_counter() - request.queued_at)
        if not q.size:
            q.heap.clear()
            del self._queues[model]

    @staticmethod
    def _last(q: _ModelQueue) -> _Entry | None:
        """The live entry that would leave last (lowest priority, newest)."""
        live = [e for e in q.heap if e[2].queue_seq == e[1]]
        return max(live, key=lambda e: (e[0], e[1])) if live else None

    def _set_length(self, model: str, q: _ModelQueue) -> None:
        self.metrics.queue_length_child(model).set(q.size)

    # ---- dispatching -----------------------------------------------------------------------------------
    def kick(self, model: str) -> None:
        """Room may have appeared for ``model``: try its head soon (coalesced; never re-entrant)."""
        if model in self._queues:
            self._kicked.add(model)
            self._schedule()

    def kick_models(self, models: Iterable[str]) -> None:
        """:meth:`kick` each of ``models`` that has a queue."""
        if not self.length:
            return
        for model in models:
            if model in self._queues:
                self._kicked.add(model)
        if self._kicked:
            self._schedule()

    def kick_all(self) -> None:
        if self.length:
            self._kicked.update(self._queues)
            self._schedule()

    def _schedule(self) -> None:
        if not self._kick_scheduled:
            self._kick_scheduled = True
            asyncio.get_running_loop().call_soon(self._run_kicked)

    def _run_kicked(self) -> None:
        self._kick_scheduled = False
        kicked, self._kicked = self._kicked, set()
        for model in kicked:
            self.dispatch(model)

    def _on_tick(self) -> None:
        self._tick = None
        for model in list(self._queues):
            self.dispatch(model)
        if self.length:
            self._tick = asyncio.get_running_loop().call_later(TICK, self._on_tick)

    def dispatch(self, model: str) -> None:
        """Hand engines to the head of ``model``'s queue while the scheduler finds one for it."""
        q = self._queues.get(model)
        while q is not None and q.size:
            entry = q.head()
            if entry is None:
                break
            heapq.heappop(q.heap)
            request = entry[2]
            outcome = request.try_dispatch()
            if outcome is None:  # still no room: it keeps its place
                heapq.heappush(q.heap, entry)
                break
            self._leave(model, q, request, outcome)
            q = self._queues.get(model)

    def describe(self) -> dict[str, int]:
        """Waiting requests per model (``GET /engines``)."""
        return {model: q.size for model, q in self._queues.items()}

    def close(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
