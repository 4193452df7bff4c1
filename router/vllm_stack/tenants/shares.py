"""Who holds more than its share of a model's engines now: the tenant headroom's measure (docs/tenants.md).

The fair queue decides who goes next once every engine is full, but a request that reaches a full engine
still waits there for a running slot to free: with a noisy tenant keeping every slot busy, a quiet tenant's
request waits for one to end however fair the queue is. The headroom (``tenant_headroom_slots``) keeps slots
free of a tenant that holds more than its share while another tenant is active, so a request of a tenant
within its share finds a free slot at once. This module says which tenants are past their share; the
saturation rule (:mod:`vllm_stack.engines.load`) keeps the slots, the director asks here per request.

A tenant's share of a model is its weight over the weights of the model's **active** tenants: those with
requests on its engines now, or that sent one within the last :data:`ACTIVE_SECONDS`. A tenant is past its
share when its requests on the model's engines, **averaged over the last few seconds** (time-weighted, with
a time constant of ``share_seconds``, the router's ``tenant_share_seconds``: 5 s), exceed that share of the
engines' running slots (the slot counts the router learned; none known: nobody is past it).
- Measured against the slots, not against what the tenants hold now: two tenants that each hold about half
  of a busy fleet would otherwise take turns being "past" it, each losing the headroom half of the time,
  and the fleet running a slot short per engine when nobody floods it.
- Averaged, not the count of the moment: a tenant sending well within its share of the fleet's throughput
  still holds more than its share of the slots for a moment when its arrivals bunch up, and held back then
  it waited in the router's queue while slots were free (issue 51's run, ``tenants_noisy_neighbour_held_back``:
  every quiet request that waited beside a rate-limited noisy tenant was held back at such a peak, or queued
  behind one that was). A tenant that keeps more than its share busy crosses its share within about one time
  constant. ``share_seconds`` 0: the count of the moment.
A tenant with nothing on the engines is never past its share, and no tenant is held back while it is the only
active one (it alone loses nothing).

Nothing is counted while the router has seen one tenant only (an untenanted router's every request is the
shared tenant's): the director notes each request's tenant against :attr:`TenantShares.solo`, and counting
starts (:attr:`TenantShares.tracking`) with the first request of a second tenant. The first tenant counts
as seen at that moment on every model, and its requests already on engines then are not counted: for as
long as they run (a request's length), it holds less than it does. Its average on the model the second
tenant asked for starts from the requests the router had on that model's engines then (all of them were
its own), so a tenant that filled the fleet alone is past its share from the second tenant's first request,
not a time constant later. Each counted request keeps its model's entry and gives it back as it ends.

Bounded: a model is tracked once a request of it reached an engine; the tenants seen are swept at most once
a second, and a model is dropped once it has no active tenant. At most :data:`MAX_TENANTS` tenants a model
are remembered as seen (beyond them a tenant still counts while it holds slots).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from vllm_stack.tenants.declaration import TenantTable

#: Seconds a tenant stays active after its last request arrived or ended: a quiet tenant between two
#: requests still has the headroom kept for it.
ACTIVE_SECONDS = 10.0
#: The time constant of a tenant's averaged requests on a model's engines (the router's default).
SHARE_SECONDS = 5.0
#: Seconds between sweeps of the tenants seen.
SWEEP_SECONDS = 1.0
#: Tenants a model remembers as seen (tenant names from a header are the client's to make up).
MAX_TENANTS = 10_000


class ModelShares:
    """One model's tenants: requests on its engines per tenant, their averages, and when each was last seen."""

    __slots__ = ("in_flight", "total", "seen", "weight_sum", "average")

    def __init__(self) -> None:
        self.in_flight: dict[str, int] = {}
        self.total = 0
        self.seen: dict[str, float] = {}  # tenant -> time.monotonic() of its last request or end
        self.weight_sum = 0.0  # the weights of the tenants in ``seen``
        # tenant -> [its requests on the engines averaged up to a moment, that moment]: kept for the
        # tenants in ``seen`` or ``in_flight``
        self.average: dict[str, list[float]] = {}


class TenantShares:
    """Per model, each tenant's requests on its engines and whether a tenant is past its share."""

    __slots__ = (
        "tenants",
        "models",
        "_next_sweep",
        "active_seconds",
        "share_seconds",
        "clock",
        "solo",
        "tracking",
        "_solo_seen",
        "_solo_seed",
    )

    def __init__(
        self,
        tenants: TenantTable | None = None,
        active_seconds: float = ACTIVE_SECONDS,
        share_seconds: float = SHARE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tenants = tenants if tenants is not None else TenantTable()  # weights; a reload sets another
        self.active_seconds = active_seconds
        self.share_seconds = share_seconds  # the averages' time constant; 0: the count of the moment
        self.clock = clock
        self.solo: str | None = None  # the one tenant seen while nothing is counted
        self.tracking = False  # requests are counted per tenant: a second tenant was seen
        self._solo_seen = 0.0  # when counting started: the first tenant's last sight, on every model
        # (model, the router's requests on its engines) as counting started: the first tenant's average there
        self._solo_seed: tuple[str, int] | None = None
        # per model, once a request of it reached an engine (read by the director's fast path: a model's
        # only active tenant is never past its share, so past_share is not called for it)
        self.models: dict[str, ModelShares] = {}
        self._next_sweep = 0.0

    def note(self, tenant: str, model: str = "", on_engines: int = 0) -> None:
        """A request of ``tenant`` for ``model``, not the one tenant seen so far (the director checks
        :attr:`solo` first): the first names it, another starts the counting. ``on_engines``: the router's
        requests on ``model``'s engines now (the first tenant's, as counting starts)."""
        if self.solo is None:
            self.solo = tenant
        elif tenant != self.solo:
            self.tracking = True
            self._solo_seen = self.clock()
            self._solo_seed = (model, on_engines)

    def started(self, model: str, tenant: str) -> ModelShares:
        """A request of ``tenant`` went to an engine of ``model`` (while :attr:`tracking`); what it gives
        to :meth:`finished` as it ends."""
        now = self.clock()
        m = self.models.get(model)
        if m is None:
            m = self.models[model] = ModelShares()
            solo = self.solo
            if solo is not None:  # the first tenant was active when counting started
                self._see(m, solo, self._solo_seen)
                seed = self._solo_seed
                if seed is not None and seed[0] == model:  # once: a model swept and tracked again starts anew
                    m.average[solo] = [float(seed[1]), now]
                    self._solo_seed = None
        counts = m.in_flight
        held = counts.get(tenant, 0)
        self._average(m, tenant, held, now)
        counts[tenant] = held + 1
        m.total += 1
        if tenant not in m.seen:
            self._see(m, tenant, now)
        return m

    def finished(self, m: ModelShares, tenant: str) -> None:
        """A request that :meth:`started` with ``m`` left its engine (after :meth:`clear`, ``m`` is no
        model's any more and this changes nothing that is read)."""
        counts = m.in_flight
        held = counts.get(tenant, 0)
        if not held:
            return
        now = self.clock()
        self._average(m, tenant, held, now)
        m.total -= 1
        if held == 1:  # its last one: active for the window from now
            del counts[tenant]
            seen = m.seen
            if tenant in seen:
                seen[tenant] = now
            else:
                self._see(m, tenant, now)
                if tenant not in seen:  # beyond MAX_TENANTS: nothing more of it is kept
                    m.average.pop(tenant, None)
        else:
            counts[tenant] = held - 1

    def past_share(self, model: str, tenant: str, slots: int) -> bool:
        """Whether ``tenant``'s requests on ``model``'s engines, averaged (module docstring), exceed its
        share of ``slots``, those engines' running slots; it counts as seen from now (the director does
        not call it for a model's only active tenant, whose last sight is taken as its requests end)."""
        m = self.models.get(model)
        if m is None:  # nothing of the model reached an engine: nobody holds anything
            return False
        now = self.clock()
        mine = m.in_flight.get(tenant, 0)
        if not mine:  # never past its share; it counts as seen from now
            self._see(m, tenant, now)
            return False
        seen = m.seen
        if len(seen) < 2:  # it alone is active (the untenanted router's every request)
            return False
        self._see(m, tenant, now)
        if now >= self._next_sweep:
            self._sweep(now)
        held = self._average(m, tenant, mine, now)
        return slots > 0 and held * m.weight_sum > self.tenants.weight(tenant) * slots

    def _average(self, m: ModelShares, tenant: str, held: int, now: float) -> float:
        """``tenant``'s average brought up to ``now``, having held ``held`` requests since it was last
        brought up (a time-weighted exponential average: a step's weight fades with ``share_seconds``)."""
        tau = self.share_seconds
        if tau <= 0.0:
            return float(held)
        entry = m.average.get(tenant)
        if entry is None:
            # its first request (or the averaging just turned on by a reload): from what it holds
            m.average[tenant] = [float(held), now]
            return float(held)
        value, at = entry
        value = held + (value - held) * math.exp((at - now) / tau)
        entry[0], entry[1] = value, now
        return value

    def set_tenants(self, tenants: TenantTable) -> None:
        """A reload's declaration: its weights count from now, for the tenants seen already too."""
        self.tenants = tenants
        for m in self.models.values():
            m.weight_sum = sum(tenants.weight(t) for t in m.seen)

    def clear(self) -> None:
        """Forget everything (the headroom was turned off: nothing is counted until it is on again and a
        second tenant is seen)."""
        self.models.clear()
        self.solo = None
        self.tracking = False
        self._solo_seed = None

    def describe(self) -> dict[str, dict[str, int]]:
        """Requests on engines per model and tenant (tests, debugging)."""
        return {model: dict(m.in_flight) for model, m in self.models.items()}

    def _see(self, m: ModelShares, tenant: str, now: float) -> None:
        seen = m.seen
        if tenant not in seen:
            if len(seen) >= MAX_TENANTS:
                return
            m.weight_sum += self.tenants.weight(tenant)
        seen[tenant] = now

    def _sweep(self, now: float) -> None:
        """Tenants idle past the window and holding nothing stop being active; empty models go."""
        self._next_sweep = now + SWEEP_SECONDS
        horizon = now - self.active_seconds
        weight = self.tenants.weight
        for model, m in list(self.models.items()):
            seen = m.seen
            gone = [t for t, last in seen.items() if last < horizon and t not in m.in_flight]
            for t in gone:
                del seen[t]
                m.average.pop(t, None)
            if gone:  # summed again, not subtracted: a reload may have changed the weights
                m.weight_sum = sum(weight(t) for t in seen)
            if not seen and not m.in_flight:
                del self.models[model]
