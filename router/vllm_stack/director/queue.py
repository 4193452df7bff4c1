"""The router's per-model queue: requests that wait for an engine with room, by priority band, and
within a band by tenant in turn (docs/tenants.md).

A request waits here when every candidate engine is saturated (critical and standard requests; a
sheddable one is answered 429 instead) or when its model is configured but has no ready engine yet
(scale from zero). A model's queue is split into **bands**, one per priority value: the highest band
with a waiting request always leaves first, so a higher priority never waits behind a lower one. A
new request that would overtake a waiting one of at least its priority joins the queue instead of
being scheduled.

Within a band, waiting requests are held per tenant (``Waiting.tenant``), each tenant's in arrival
order, and the band hands its turn to the tenants in **weighted fair** order, not in arrival order:
start-time fair queueing, in which each tenant carries a virtual tag that grows by ``1 / weight`` with
each of its departures and the tenant with the smallest tag goes next. Under saturation tenants of
weights 2 and 1 leave 2:1, and a tenant sending ten times another's requests cannot put the other's
behind all of its own. A tenant that starts waiting takes the band's current virtual time as its tag
(an idle tenant banks no credit), or the tag its last departure moved it to when that is later: a
tenant whose last waiting request just left is ahead of the band's time by its turn, and coming back
at once must not give it the turn again (a tenant keeping one request waiting would otherwise take
every turn ahead of a backlogged one). Weights come from the tenants declaration (1 when undeclared).

It leaves when the scheduler gives it an engine: the queue tries its head whenever room may have
appeared (a request on one of the model's engines ended, an engine's figures were scraped, the
engine index changed) and on a half-second tick while anything waits. It also leaves, answered by
the director, when it waited ``queue_timeout`` (``queue_timeout``), when its client went away, or
when it was pushed out to make room (``queue_full``, :meth:`RequestQueue.add`).

With the tenant headroom kept (``tenant_headroom_slots``, :mod:`vllm_stack.tenants.shares`), a request whose
tenant is past its share may find no room where one of another tenant would: when the head is held back
so, the band's next tenant within its share (the smallest tag among them) is tried before the queue gives
up, and a request that joins behind waiting ones has the queue try at once (ProxiedRequest._attempt).

Bounded twice: at most ``max_per_band`` requests per band and ``max_per_model`` per model. A full
band makes room by displacing the newest request of its heaviest tenant (most waiting per unit of
weight) when that tenant is heavier than the newcomer's would become, else refuses the newcomer; a
full model displaces from its lowest band below the newcomer's (its heaviest tenant's newest), else
treats the newcomer's own band as full.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Iterable
from operator import attrgetter
from typing import Protocol

from vllm_stack.metrics import RouterMetrics
from vllm_stack.priority import criticality
from vllm_stack.tenants.declaration import TenantTable

#: Seconds between the queue's own tries while anything waits (a safety net under the event kicks).
TICK = 0.5

_tag = attrgetter("tag")

#: Tenants a band remembers as having left ahead of its virtual time (beyond: those the band's time has
#: passed are dropped, then all of them: a band with more tenants coming and going than this is
#: fair by arrival for the ones it forgot)
RETURNING_BOUND = 1024

#: Exits that turn the request away, as the tenants' rejection reasons (metrics.REJECTION_REASONS)
_REJECTED = {"displaced": "queue_full", "timeout": "queue_timeout"}


class Waiting(Protocol):
    """What the queue holds: a request that tries to leave when asked."""

    queue_seq: int  # its sequence number while queued; 0 when not queued
    queued_at: float  # time.perf_counter() when it joined

    @property
    def priority(self) -> int: ...

    @property
    def tenant(self) -> str: ...

    @property
    def held_back(self) -> bool:
        """Its last try found no room kept for a tenant past its share (tenant headroom)."""
        ...

    def try_dispatch(self) -> str | None:
        """Schedule it: the exit outcome (``dispatched``, ``failed``) when it left, None to stay."""
        ...

    def displaced(self) -> None:
        """It was pushed out of a full queue to make room for another (answer it)."""
        ...


class _Flow:
    """One tenant's waiting requests in one band, oldest first, and its virtual tag."""

    __slots__ = ("tenant", "weight", "requests", "tag", "entry")

    def __init__(self, tenant: str, weight: float, tag: float) -> None:
        self.tenant = tenant
        self.weight = weight
        self.requests: deque[Waiting] = deque()
        self.tag = tag  # the virtual start of its head request: the smallest goes next
        self.entry = 0  # the sequence of its live entry in the band's heap


class _Band:
    """The waiting requests of one priority value of one model."""

    __slots__ = ("priority", "flows", "heap", "vtime", "size", "returning")

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.flows: dict[str, _Flow] = {}
        self.heap: list[tuple[float, int, _Flow]] = []  # (tag, entry sequence, flow): stale ones skipped
        self.vtime = 0.0  # the tag of the last departure: where a tenant that starts waiting begins
        self.size = 0
        self.returning: dict[str, float] = {}  # tenant -> its tag as its last request left, if ahead

    def start_tag(self, tenant: str) -> float:
        """Where a tenant that starts waiting begins: the band's time, or its own tag if that is later."""
        return max(self.vtime, self.returning.pop(tenant, 0.0))

    def left(self, flow: _Flow) -> None:
        """``flow``'s last waiting request left: its tag is remembered while ahead of the band's time."""
        if flow.tag <= self.vtime:
            return
        returning = self.returning
        returning[flow.tenant] = flow.tag
        if len(returning) > RETURNING_BOUND:
            vtime = self.vtime
            ahead = {t: tag for t, tag in returning.items() if tag > vtime}
            self.returning = ahead if len(ahead) <= RETURNING_BOUND // 2 else {}

    def next_flow(self) -> _Flow | None:
        """The tenant whose turn it is (the smallest tag), stale heap entries dropped."""
        heap = self.heap
        while heap:
            tag, entry, flow = heap[0]
            if flow.entry == entry and flow.requests:
                return flow
            heapq.heappop(heap)
        return None

    def heaviest(self) -> _Flow | None:
        """The tenant with the most waiting per unit of weight; among equals, the one that began waiting
        last (``flows`` keeps that order: a tenant's entry goes as its last request leaves, and ``max``
        keeps the first maximum of the reversed order)."""
        return max(reversed(self.flows.values()), key=lambda f: len(f.requests) / f.weight, default=None)


class _ModelQueue:
    __slots__ = ("bands", "order", "size")

    def __init__(self) -> None:
        self.bands: dict[int, _Band] = {}
        self.order: list[int] = []  # the bands' priorities, highest first
        self.size = 0  # waiting requests over all bands

    def top(self) -> _Band | None:
        return self.bands[self.order[0]] if self.order else None


class RequestQueue:
    """Per-model queues of priority bands, fair by tenant within a band, bounded per band and model."""

    def __init__(
        self,
        metrics: RouterMetrics,
        max_per_model: int = 1000,
        max_per_band: int = 0,
        tenants: TenantTable | None = None,
    ) -> None:
        self.metrics = metrics
        self.max_per_model = max_per_model
        self.max_per_band = max_per_band or 0  # 0: a band may hold as many as its model
        self.tenants = tenants if tenants is not None else TenantTable()  # weights and metric labels
        self.length = 0  # waiting requests over all models (the hot path reads only this)
        self._queues: dict[str, _ModelQueue] = {}
        self._seq = 0
        self._kicked: set[str] = set()
        self._kick_scheduled = False
        self._tick: asyncio.TimerHandle | None = None

    # ---- joining and leaving -------------------------------------------------------------------------
    def ahead(self, model: str, priority: int) -> bool:
        """Whether a request of at least ``priority`` waits for ``model`` (a new one goes behind it)."""
        q = self._queues.get(model)
        return q is not None and bool(q.order) and q.order[0] >= priority

    def add(self, model: str, request: Waiting) -> bool:
        """Queue ``request`` for ``model``; False when there is no room for it (module docstring: a
        request pushed out to make room is told :meth:`Waiting.displaced`)."""
        q = self._queues.get(model)
        if q is None:
            q = self._queues[model] = _ModelQueue()
        priority = request.priority
        band = q.bands.get(priority)
        tenant = request.tenant
        if band is not None and band.size >= (self.max_per_band or self.max_per_model):
            if not self._displace_heavier(model, q, band, tenant):
                return self._refuse(model, q, tenant)
        if q.size >= self.max_per_model:
            lower = [p for p in q.order if p < priority]
            if lower:
                self._displace_from(model, q, q.bands[lower[-1]])
            elif band is None or not self._displace_heavier(model, q, band, tenant):
                return self._refuse(model, q, tenant)
        self._queues[model] = q  # (again, when making room emptied it)
        band = q.bands.get(priority)
        if band is None:
            band = q.bands[priority] = _Band(priority)
            q.order.append(priority)
            q.order.sort(reverse=True)
        flow = band.flows.get(tenant)
        if flow is None:
            flow = band.flows[tenant] = _Flow(tenant, self.tenants.weight(tenant), band.start_tag(tenant))
        self._seq += 1
        request.queue_seq = self._seq
        request.queued_at = time.perf_counter()
        flow.requests.append(request)
        if len(flow.requests) == 1:
            self._push(band, flow)
        band.size += 1
        q.size += 1
        self.length += 1
        self._set_length(model, q)
        if self._tick is None:
            self._tick = asyncio.get_running_loop().call_later(TICK, self._on_tick)
        return True

    def _displace_heavier(self, model: str, q: _ModelQueue, band: _Band, tenant: str) -> bool:
        """Room in a full ``band`` for a request of ``tenant``: its heaviest tenant's newest request
        goes when that tenant would still be heavier than ``tenant`` with the newcomer."""
        heaviest = band.heaviest()
        if heaviest is None or heaviest.tenant == tenant:
            return False
        mine = band.flows.get(tenant)
        after = (len(mine.requests) if mine is not None else 0) + 1
        if len(heaviest.requests) / heaviest.weight <= after / self.tenants.weight(tenant):
            return False
        self._displace_from(model, q, band, heaviest)
        return True

    def _displace_from(self, model: str, q: _ModelQueue, band: _Band, flow: _Flow | None = None) -> None:
        flow = flow or band.heaviest()
        assert flow is not None and flow.requests
        victim = flow.requests[-1]
        self._leave(model, q, band, flow, victim, "displaced")
        victim.displaced()

    def _refuse(self, model: str, q: _ModelQueue, tenant: str) -> bool:
        """No room for a request of ``tenant`` (its caller answers 429 ``queue_full``): counted."""
        if not q.size:
            del self._queues[model]
        self.metrics.tenant_rejected(self.tenants.label(tenant), "queue_full")
        return False

    def remove(self, model: str, request: Waiting, outcome: str) -> None:
        """``request`` leaves without an engine (``timeout``, ``client_closed``)."""
        q = self._queues.get(model)
        if q is None or not request.queue_seq:
            return
        band = q.bands.get(request.priority)
        flow = band.flows.get(request.tenant) if band is not None else None
        if band is None or flow is None:
            return
        self._leave(model, q, band, flow, request, outcome)

    def _leave(
        self, model: str, q: _ModelQueue, band: _Band, flow: _Flow, request: Waiting, outcome: str
    ) -> None:
        requests = flow.requests
        head = requests[0] is request
        if head:
            requests.popleft()
        else:
            requests.remove(request)
        request.queue_seq = 0
        band.size -= 1
        q.size -= 1
        self.length -= 1
        self._set_length(model, q)
        cls = criticality(request.priority)
        waited = time.perf_counter() - request.queued_at
        metrics = self.metrics
        metrics.queue_exit(model, cls, outcome, waited)
        label = self.tenants.label(flow.tenant)
        metrics.tenant_queue_exit(model, cls, label, waited)
        if outcome in _REJECTED:
            metrics.tenant_rejected(label, _REJECTED[outcome])
        if outcome == "dispatched":  # its tenant's turn is taken: the tag moves on by its share
            band.vtime = flow.tag
            flow.tag += 1.0 / flow.weight
            if requests:
                self._push(band, flow)
        if not requests:
            flow.entry = 0  # its heap entry is stale
            del band.flows[flow.tenant]
            band.left(flow)
        if not band.size:
            del q.bands[band.priority]
            q.order.remove(band.priority)
        if not q.size:
            del self._queues[model]

    def _push(self, band: _Band, flow: _Flow) -> None:
        self._seq += 1
        flow.entry = self._seq
        heap = band.heap
        if len(heap) > 2 * len(band.flows) + 16:  # mostly stale entries: keep the live ones
            heap[:] = [e for e in heap if e[2].entry == e[1] and e[2].requests]
            heapq.heapify(heap)
        heapq.heappush(heap, (flow.tag, self._seq, flow))

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
        """Hand engines to the head of ``model``'s queue (the top band's next tenant's oldest request)
        while the scheduler finds one for it."""
        q = self._queues.get(model)
        while q is not None and q.size:
            band = q.top()
            flow = band.next_flow() if band is not None else None
            if band is None or flow is None:
                break
            request = flow.requests[0]
            outcome = request.try_dispatch()
            if outcome is None:  # still no room: it keeps its place
                if not request.held_back:
                    break
                # its tenant is past its share: one within its share may take the room kept for it
                held = flow
                flow = self._within_share(band, held)
                if flow is None:
                    break
                request = flow.requests[0]
                outcome = request.try_dispatch()
                if outcome is None:
                    break
                if outcome == "dispatched" and held.tag < flow.tag:
                    # a turn it could not take banks no credit: else, once eligible again, it would take
                    # as many turns in a row as others took past it while it was held back
                    held.tag = flow.tag
                    self._push(band, held)
            self._leave(model, q, band, flow, request, outcome)
            q = self._queues.get(model)

    @staticmethod
    def _within_share(band: _Band, held: _Flow) -> _Flow | None:
        """The band's tenant whose turn comes first among those whose oldest request was not held back
        when it was last scheduled (as it arrived, or as the queue's head), other than ``held``'s; None
        when there is none."""
        eligible = (f for f in band.flows.values() if f is not held and not f.requests[0].held_back)
        return min(eligible, key=_tag, default=None)

    def describe(self) -> dict[str, int]:
        """Waiting requests per model (``GET /engines``)."""
        return {model: q.size for model, q in self._queues.items()}

    def close(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
