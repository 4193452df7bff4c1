"""Where LoRA adapters are: which engine holds which, loading them there, freeing slots for them.

What an engine holds comes from the engine: its ``/v1/models`` cards with a ``parent`` (learned by
the registry on every probe, and at once when the router loaded or unloaded one itself), its slot
count ``max_lora`` and the adapters with requests running or waiting there from
``vllm:lora_requests_info`` (the scraper). Nothing is guessed: an engine that restarted lists no
adapters, and the hot ones are loaded there again as soon as its first probe answers.

The paths and the answers' meanings are the engine's kind's (vLLM: ``/v1/load_lora_adapter``).
Loads are single-flight: one load per (engine, adapter) however many
requests wait for it; a client that leaves stops waiting without cancelling the load for the others
(the waiters hold :func:`asyncio.shield`). Loads on one engine run one at a time, so two different
adapters never both take its last free slot.

A slot is freed by unloading the least recently used adapter the router registered (cold ones before
warm ones; hot ones never) that no request of this router is using and that the engine does not list
as running or waiting (so several router replicas never unload each other's work). Without fresh
telemetry nothing is unloaded: the router cannot tell what runs there. With no slot to free, the
adapter is loaded anyway: vLLM serves more registered adapters than ``--max-loras`` by swapping them
through its batch, slower but not failing, and the next eviction brings the count back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from vllm_stack.engines import load
from vllm_stack.engines.adapters import AdapterCatalog, AdapterSpec
from vllm_stack.engines.engine import Engine
from vllm_stack.engines.registry import EngineRegistry
from vllm_stack.metrics import RouterMetrics

log = logging.getLogger(__name__)

#: POSTs a JSON document to an engine's path; returns (status, body). Raises on transport failure.
EngineCall = Callable[[Engine, str, dict[str, Any]], Awaitable[tuple[int, bytes]]]

#: A hot adapter whose load failed on an engine is tried there again after this many seconds.
HOT_RETRY_SECONDS = 30.0


class AdapterLoadError(Exception):
    """A load failed; the message is the client's (engine name, status and the engine's words)."""


class AdapterPlacement:
    """Adapter placement over one registry. Owned by the router; ``catalog`` is swapped on reload."""

    def __init__(
        self,
        registry: EngineRegistry,
        call: EngineCall,
        metrics: RouterMetrics,
        catalog: AdapterCatalog | None = None,
        load_timeout: float = 120.0,
    ) -> None:
        self.registry = registry
        self._call = call
        self._metrics = metrics
        self.catalog = catalog or AdapterCatalog()
        self.load_timeout = load_timeout
        self._loads: dict[tuple[str, str], asyncio.Task[None]] = {}  # (engine, adapter) under way
        self._locks: dict[str, asyncio.Lock] = {}  # per engine: one load or unload at a time
        self._in_use: dict[tuple[str, str], int] = {}  # requests of this router per (engine, adapter)
        self._last_used: dict[tuple[str, str], float] = {}  # LRU clock per (engine, adapter)
        self._hot_failed: dict[tuple[str, str], float] = {}  # when a hot load last failed there
        self._loaded_here: set[tuple[str, str]] = set()  # (engine, adapter) this router loaded
        self._background: set[asyncio.Task[None]] = set()
        registry.on_models_learned.append(self.reconcile)
        registry.on_engine_left.append(lambda engine: self.forget_engine(engine.name))

    # ---- what routing asks -----------------------------------------------------------------------------
    def holds(self, engine: Engine, name: str) -> bool:
        """The engine serves the adapter, or a load of it there is under way."""
        return name in engine.models or (engine.name, name) in self._loads

    def free_slots(self, engine: Engine) -> int | None:
        """Adapter slots left (loads under way count as taken); None when the engine never said."""
        slots = engine.max_loras
        if slots is None:
            return None
        held = engine.adapters()
        pending = sum(1 for (e, a) in self._loads if e == engine.name and a not in engine.models)
        return slots - len(held) - pending

    def victim(self, engine: Engine) -> str | None:
        """The adapter to unload there for a new one, or None when none may go (see the module doc)."""
        ranked = self._victim(engine)
        return None if ranked is None else ranked[2]

    def _victim(self, engine: Engine) -> tuple[int, float, str] | None:
        """(unregistered -1 / cold 0 / warm 1, last used, name) of the adapter to unload there, or None."""
        telemetry = engine.fresh_telemetry()
        if telemetry is None or telemetry.running_adapters is None or telemetry.waiting_adapters is None:
            return None
        busy = telemetry.running_adapters | telemetry.waiting_adapters
        best: tuple[int, float, str] | None = None
        for name in engine.adapters():
            spec = self.catalog.get(name)
            key = (engine.name, name)
            if spec is None and key not in self._loaded_here:
                continue  # not the router's: loaded by --lora-modules or by someone else
            if (
                (spec is not None and spec.pinned)
                or name in busy
                or self._in_use.get(key)
                or key in self._loads
            ):
                continue
            # one the router loaded and a reload unregistered goes first, then cold, then warm
            tier = -1 if spec is None else 0 if spec.tier == "cold" else 1
            rank = (tier, self._last_used.get(key, 0.0), name)
            if best is None or rank < best:
                best = rank
        return best

    def place(self, spec: AdapterSpec, engines: Sequence[Engine]) -> Sequence[Engine]:
        """The engines an adapter request may go to: those holding it (or loading it), else those
        with a free slot, else those that never published a slot count, else the least loaded one
        with an adapter to unload, else all. The outcome is counted (``adapter_placements_total``)."""
        chosen, outcome = self._place(spec, engines)
        self._metrics.adapter_placements.labels(outcome).inc()
        return chosen

    def _place(self, spec: AdapterSpec, engines: Sequence[Engine]) -> tuple[Sequence[Engine], str]:
        holding = [e for e in engines if self.holds(e, spec.name)]
        if holding:
            loading = all(spec.name not in e.models for e in holding)
            return holding, "loading" if loading else "held"
        free = [e for e in engines if (slots := self.free_slots(e)) is not None and slots > 0]
        if free:
            return free, "free_slot"
        # vLLM publishes its slot count from its first request on: a new engine is tried as free
        # (an engine without --enable-lora never publishes one; its load fails with vLLM's words)
        unknown = [e for e in engines if e.max_loras is None]
        if unknown:
            return unknown, "free_slot"
        victims = [(e, v) for e in engines if (v := self._victim(e)) is not None]
        if victims:
            # the least loaded; between equally loaded ones, the one whose victim is coldest and oldest
            loads = load.engine_loads([e for e, _ in victims])
            best = min(range(len(victims)), key=lambda i: (loads[i], victims[i][1][:2]))
            return [victims[best][0]], "evict"
        return engines, "over_capacity"

    def acquire(self, engine: Engine, name: str) -> None:
        """A request for adapter ``name`` is going to ``engine``: it is in use there until released."""
        key = (engine.name, name)
        self._in_use[key] = self._in_use.get(key, 0) + 1
        self._last_used[key] = time.monotonic()

    def release(self, engine: Engine, name: str) -> None:
        key = (engine.name, name)
        left = self._in_use.get(key, 0) - 1
        if left > 0:
            self._in_use[key] = left
        else:
            self._in_use.pop(key, None)

    # ---- loading -------------------------------------------------------------------------------------
    async def ensure(self, engine: Engine, spec: AdapterSpec) -> None:
        """Wait until ``spec`` is loaded on ``engine`` (one load however many wait); raises
        :class:`AdapterLoadError`. Cancelling this waiter does not cancel the load."""
        if spec.name in engine.models:
            return
        await self.wait(self.start_load(engine, spec))

    @staticmethod
    async def wait(task: asyncio.Task[None]) -> None:
        """Wait for a load without owning it: cancelling the waiter leaves the load running. A load
        cancelled because its engine left is an :class:`AdapterLoadError` for its waiters."""
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                raise AdapterLoadError("The engine left while the LoRA adapter was being loaded.") from None
            raise

    def start_load(self, engine: Engine, spec: AdapterSpec) -> asyncio.Task[None]:
        """The load of ``spec`` on ``engine``: the one under way, or a new one. Started at once, so a
        request scheduled next in the same loop turn sees the slot taken and the adapter coming."""
        key = (engine.name, spec.name)
        task = self._loads.get(key)
        if task is None:
            task = self._loads[key] = asyncio.ensure_future(self._load(engine, spec))
            task.add_done_callback(lambda t, k=key: self._load_done(k, t))
        return task

    def _load_done(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        if self._loads.get(key) is task:
            del self._loads[key]
        if not task.cancelled():
            task.exception()  # retrieved here: every waiter may have left

    async def _load(self, engine: Engine, spec: AdapterSpec) -> None:
        try:
            async with asyncio.timeout(self.load_timeout):  # the wait for the engine's lock included
                await self._load_locked(engine, spec)
        except TimeoutError:
            raise self._failed(engine, spec, f"took longer than {self.load_timeout:g}s.") from None

    def _failed(self, engine: Engine, spec: AdapterSpec, what: str) -> AdapterLoadError:
        """Count a failed load; its error, for the waiters."""
        self._metrics.adapter_loads.labels(spec.tier, "failed").inc()
        return AdapterLoadError(f"Loading the LoRA adapter '{spec.name}' on engine {engine.name} {what}")

    async def _load_locked(self, engine: Engine, spec: AdapterSpec) -> None:
        lock = self._locks.setdefault(engine.name, asyncio.Lock())
        async with lock:
            if spec.name in engine.models:
                return  # loaded while this load waited for the lock (a probe saw it)
            started = time.perf_counter()
            api = engine.kind.adapters
            try:
                slots = engine.max_loras
                if slots is not None and len(engine.adapters()) >= slots:
                    victim = self.victim(engine)
                    if victim is not None:
                        await self._unload(engine, victim)
                    else:
                        log.info(
                            "engine %s: all %d adapter slots busy; loading %s beyond them",
                            engine.name,
                            slots,
                            spec.name,
                        )
                status, body = await self._call(
                    engine, api.load_path, {"lora_name": spec.name, "lora_path": spec.lora_path}
                )
            except TimeoutError:
                raise
            except Exception as exc:  # noqa: BLE001 - any transport failure fails the load, clearly
                raise self._failed(engine, spec, f"failed: {type(exc).__name__}: {exc}") from None
            if not api.load_ok(status, body):
                raise self._failed(engine, spec, f"failed: {status} {body[:300].decode('utf-8', 'replace')}")
            self._metrics.adapter_loads.labels(spec.tier, "ok").inc()
            self._metrics.adapter_load_seconds.observe(time.perf_counter() - started)
            self.registry.learn_adapter(engine, spec.card())
            self._loaded_here.add((engine.name, spec.name))
            log.info("engine %s: loaded LoRA adapter %s (%s)", engine.name, spec.name, spec.tier)

    async def _unload(self, engine: Engine, name: str) -> None:
        spec = self.catalog.get(name)
        # Not routable there from now on: a request arriving meanwhile loads it again rather than
        # meeting an engine that has just dropped it (if the unload fails, the next probe says so).
        self.registry.forget_adapter(engine, name)
        status, body = await self._call(engine, engine.kind.adapters.unload_path, {"lora_name": name})
        if not engine.kind.adapters.unload_ok(status, body):
            log.warning("engine %s: unloading %s failed: %s %s", engine.name, name, status, body[:200])
            return
        self._metrics.adapter_unloads.labels(spec.tier if spec else "unregistered").inc()
        self._last_used.pop((engine.name, name), None)
        self._loaded_here.discard((engine.name, name))
        log.info("engine %s: unloaded LoRA adapter %s to free a slot", engine.name, name)

    # ---- hot adapters ----------------------------------------------------------------------------------
    def reconcile(self, engine: Engine) -> None:
        """Load there every hot adapter of its base models it lacks (called after each probe)."""
        now = time.monotonic()
        for spec in self.catalog.hot:
            key = (engine.name, spec.name)
            if spec.base_model not in engine.models or spec.name in engine.models or key in self._loads:
                continue
            if now - self._hot_failed.get(key, -HOT_RETRY_SECONDS) < HOT_RETRY_SECONDS:
                continue
            task = asyncio.ensure_future(self._hot_load(engine, spec))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _hot_load(self, engine: Engine, spec: AdapterSpec) -> None:
        try:
            await self.ensure(engine, spec)
        except AdapterLoadError as exc:
            if self.registry.get(engine.name) is engine:  # not for an engine that left meanwhile
                self._hot_failed[(engine.name, spec.name)] = time.monotonic()
            log.warning("hot adapter: %s (tried again in %gs)", exc, HOT_RETRY_SECONDS)
        else:
            self._hot_failed.pop((engine.name, spec.name), None)

    def reconcile_all(self) -> None:
        """A new catalog: load its hot adapters wherever they are missing."""
        for engine in self.registry.engines():
            if engine.routable():
                self.reconcile(engine)

    # ---- bookkeeping ---------------------------------------------------------------------------------
    def forget_engine(self, name: str) -> None:
        """An engine left: its loads under way are cancelled (their waiters get an error, not a hang
        on a load for an engine object that is gone) and its counters go."""
        for key in [k for k in self._loads if k[0] == name]:
            self._loads.pop(key).cancel()
        for table in (self._in_use, self._last_used, self._hot_failed):
            for key in [k for k in table if k[0] == name]:
                del table[key]
        self._loaded_here = {k for k in self._loaded_here if k[0] != name}
        self._locks.pop(name, None)

    def set_catalog(self, catalog: AdapterCatalog) -> None:
        """A reload: the new registry. Use counts of adapters it no longer has are dropped (their
        requests may end without a plugin to release them); the router's copies of them become the
        first to unload. Hot adapters it adds are loaded where they are missing."""
        self.catalog = catalog
        for key in [k for k in self._in_use if catalog.get(k[1]) is None]:
            del self._in_use[key]
        self.reconcile_all()

    async def close(self) -> None:
        tasks = [*self._background, *self._loads.values()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def describe(self) -> dict[str, Any]:
        """For ``GET /engines``: the catalog, loads under way and adapters in use."""
        return {
            **self.catalog.describe(),
            "loading": sorted(f"{e}/{a}" for e, a in self._loads),
            "in_use": {f"{e}/{a}": n for (e, a), n in sorted(self._in_use.items())},
        }
