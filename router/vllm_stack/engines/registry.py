"""The engine registry: diffs discovery snapshots, learns models, tracks health, indexes candidates.

Discovery sources only say where engines are. The registry asks each engine's ``/v1/models`` which
base models and LoRA adapters it serves (this doubles as the active health check), applies
failure/success thresholds, ejects an engine at once on a connection error (passive check) and keeps
a per-model index of healthy engines so the hot path is one dictionary lookup.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from vllm_stack.engines.circuit import BreakerState, CircuitBreaker
from vllm_stack.engines.discovery.base import EndpointInfo
from vllm_stack.engines.engine import ROLE_BOTH, ROLE_PREFILL, Engine
from vllm_stack.engines.kinds import DEFAULT_KIND, kind_named
from vllm_stack.metrics import RouterMetrics

log = logging.getLogger(__name__)

#: Fetches an engine's ``/v1/models`` ``data`` list; raises on any failure.
ModelsFetcher = Callable[[Engine], Awaitable[list[dict[str, Any]]]]

#: Unhealthy engines are checked this often (seconds), not only every health-check interval, so an
#: engine restarted on its address is back in rotation within about a second of being ready.
RECOVERY_INTERVAL = 0.5
#: Consecutive timed-out scrapes after which an engine counts as hung and its breaker opens.
HANG_AFTER_SILENT_SCRAPES = 2
MAX_MODELS_PER_ENGINE = 1024  # bound on what one engine can make us store
_CARD_FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission")


def _kept_fields(card: dict[str, Any]) -> dict[str, Any]:
    """The fields of a ``/v1/models`` card the registry keeps (and serves again)."""
    return {k: card[k] for k in _CARD_FIELDS if k in card}


class EngineRegistry:
    """All known engines and the per-model index of healthy ones."""

    def __init__(
        self,
        fetch_models: ModelsFetcher,
        metrics: RouterMetrics,
        *,
        failure_threshold: int = 3,
        success_threshold: int = 2,
        breaker_failures: int = 5,
        breaker_open_seconds: float = 10.0,
        stale_after: float = 3.0,
        check_interval: float = 5.0,
        static_models: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        self._fetch_models = fetch_models
        self._metrics = metrics
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.breaker_failures = breaker_failures
        self.breaker_open_seconds = breaker_open_seconds
        self.stale_after = stale_after
        self.check_interval = check_interval  # seconds between full health-check rounds
        self.static_models = static_models or {}
        self._engines: dict[str, Engine] = {}
        self._by_model: dict[str, tuple[Engine, ...]] = {}
        # Prefill-only engines apart: they take no whole request, only the prefill leg of one.
        self._prefill_by_model: dict[str, tuple[Engine, ...]] = {}
        # Healthy engines asleep (vLLM's sleep mode), by model: what a request may wake when no candidate is awake.
        self._sleeping_by_model: dict[str, tuple[Engine, ...]] = {}
        self._known_models: frozenset[str] = frozenset()
        self._healthy_count = 0
        self.snapshots_seen = 0
        self._probe_tasks: set[asyncio.Task[None]] = set()
        self._health_series: set[tuple[str, str]] = set()
        self.changed = asyncio.Event()  # set on every index rebuild (tests and /ready waiters)
        self.on_engine_left: list[Callable[[Engine], None]] = []  # e.g. close its pooled connections
        # Told when an engine joins, before its first probe (e.g. an external provider's key and owner)
        self.on_engine_joined: list[Callable[[Engine], None]] = []
        # Told when an engine turns healthy (e.g. follow its KV events at once)
        self.on_engine_healthy: list[Callable[[Engine], None]] = []
        # Told after every answered /v1/models (e.g. load the hot adapters an engine lacks)
        self.on_models_learned: list[Callable[[Engine], None]] = []
        # Told after every index rebuild (e.g. dispatch requests queued for a model that had no engine)
        self.on_rebuilt: list[Callable[[], None]] = []

    # ---- read side (hot path) -------------------------------------------------------------------
    def candidates(self, model: str) -> tuple[Engine, ...]:
        """Healthy, ready engines serving ``model`` (a base model or a LoRA adapter) whole or as the
        decode side of disaggregated serving: every engine but the prefill-only ones."""
        return self._by_model.get(model, ())

    def candidate_at(self, model: str, address: str) -> Engine | None:
        """The candidate of ``model`` at ``address`` (``host:port``, as a gateway and an endpoint picker
        name engines), or None."""
        for engine in self._by_model.get(model, ()):
            if engine.address == address:
                return engine
        return None

    def prefill_candidates(self, model: str) -> tuple[Engine, ...]:
        """Healthy, ready prefill-only engines of ``model`` (empty: it is not served disaggregated)."""
        return self._prefill_by_model.get(model, ())

    def sleeping(self, model: str) -> tuple[Engine, ...]:
        """Healthy, ready engines of ``model`` that are asleep (read only when it has no candidate)."""
        return self._sleeping_by_model.get(model, ())

    def by_engine_id(self, engine_id: str) -> Engine | None:
        """The engine of a production-stack engine id (``/sleep?id=...``), or of that name; None: unknown."""
        for engine in self._engines.values():
            if engine.engine_id == engine_id or engine.name == engine_id:
                return engine
        return None

    def set_sleeping(self, engine: Engine, sleeping: bool, level: int = 0) -> None:
        """The engine fell asleep or woke (its scrape, or its answer to a sleep or wake-up call): it
        leaves or rejoins the candidates now, in one index rebuild, so no request pays for a check."""
        level = level if sleeping else 0
        if engine.sleeping == sleeping and engine.sleep_level == level:
            return
        engine.sleep_level = level
        if engine.sleeping != sleeping:
            engine.sleeping = sleeping
            log.info("engine %s %s", engine.name, "asleep" if sleeping else "awake")
            if self._engines.get(engine.name) is engine:
                self._rebuild()

    def is_known(self, model: str) -> bool:
        """Served by some engine, healthy or not (decides 503 versus 404)."""
        return model in self._known_models

    @property
    def healthy_count(self) -> int:
        return self._healthy_count

    def engines(self) -> list[Engine]:
        return list(self._engines.values())

    def get(self, name: str) -> Engine | None:
        return self._engines.get(name)

    def failing_provider(self, model: str) -> tuple[str, str] | None:
        """An external provider (an engine of fixed models) of ``model`` that is out of rotation, with
        its last check's error, or None: what the client is told instead of "no healthy engine"."""
        for engine in self._engines.values():
            if (
                engine.kind.fixed_models
                and model in engine.models
                and not engine.routable()
                and engine.last_error
            ):
                return engine.name, engine.last_error
        return None

    def available_models(self) -> list[str]:
        return sorted(self._by_model)

    def base_models(self) -> list[str]:
        """Served base models (cards without a ``parent``), healthy engines only."""
        return sorted(c["id"] for c in self.model_cards() if not c.get("parent"))

    def model_cards(self) -> list[dict[str, Any]]:
        """The union of ``/v1/models`` entries over healthy engines, deduplicated by id."""
        seen: dict[str, dict[str, Any]] = {}
        for engine in self._engines.values():
            if not (engine.ready and engine.healthy):  # an engine asleep still serves its models when woken
                continue
            for card in engine.model_cards:
                seen.setdefault(card["id"], card)
            for model in engine.static_models:
                seen.setdefault(
                    model,
                    {"id": model, "object": "model", "owned_by": engine.owner, "root": model, "parent": None},
                )
        return [seen[k] for k in sorted(seen)]

    # ---- discovery side -------------------------------------------------------------------------
    async def apply_snapshot(self, endpoints: list[EndpointInfo]) -> None:
        """Discovery sink: add new engines (probed at once), drop missing ones, update readiness."""
        self.snapshots_seen += 1
        current = {e.name: e for e in endpoints}
        for name in list(self._engines):
            engine = self._engines[name]
            info = current.get(name)
            if info is None or info.url.rstrip("/") != engine.url:
                del self._engines[name]
                engine.ready = False  # for the requests still on it (a stream that stalls is continued)
                self._metrics.forget_engine(name)
                for hook in self.on_engine_left:
                    hook(engine)
                log.info("engine %s left", name)
        for name, info in current.items():
            engine = self._engines.get(name)
            if engine is None:
                engine = self._new_engine(info)
                for joined in self.on_engine_joined:
                    joined(engine)
                self._engines[name] = engine
                log.info("engine %s joined at %s", name, info.url)
                self._spawn_probe(engine)
            engine.ready = info.ready
            engine.kv_events_endpoint, engine.kv_replay_endpoint = info.kv_events, info.kv_replay
            engine.role = info.role or ROLE_BOTH
        self._rebuild()

    def configure(
        self,
        *,
        failure_threshold: int,
        success_threshold: int,
        breaker_failures: int,
        breaker_open_seconds: float,
        stale_after: float,
        check_interval: float,
    ) -> None:
        """New limits (hot reload), for the engines known now as for those that join later: their
        breakers keep their state and count, and judge the next outcome by the new thresholds."""
        self.failure_threshold = failure_threshold
        self.success_threshold = success_threshold
        self.breaker_failures = breaker_failures
        self.breaker_open_seconds = breaker_open_seconds
        self.stale_after = stale_after
        self.check_interval = check_interval
        for engine in self._engines.values():
            engine.breaker.failure_threshold = breaker_failures
            engine.breaker.open_seconds = breaker_open_seconds
            engine.stale_after = stale_after

    def set_static_models(self, static_models: dict[str, tuple[str, ...]]) -> None:
        """A reload's ``static_models`` (engine URL -> models): engines known now serve their new
        ones at once, beside what their ``/v1/models`` said; engines that join later get theirs then."""
        self.static_models = static_models
        changed = False
        for engine in self._engines.values():
            models = static_models.get(engine.url, ())
            if models != engine.static_models:
                engine.static_models = models
                engine.models = frozenset(c["id"] for c in engine.model_cards) | frozenset(models)
                changed = True
        if changed:
            self._rebuild()

    def _new_engine(self, info: EndpointInfo) -> Engine:
        url = info.url.rstrip("/")
        gauge = self._metrics.circuit_breaker_state.labels(info.name)
        gauge.set(0)
        breaker = CircuitBreaker(
            self.breaker_failures, self.breaker_open_seconds, on_change=lambda s, g=gauge: g.set(int(s))
        )
        try:
            kind = kind_named(info.kind)
        except ValueError:
            log.warning("engine %s: unknown engine kind %r; taken for %s", info.name, info.kind, DEFAULT_KIND)
            kind = kind_named(DEFAULT_KIND)
        return Engine(
            info.name, url, breaker, self.static_models.get(url, ()), stale_after=self.stale_after, kind=kind
        )

    def _spawn_probe(self, engine: Engine) -> None:
        task = asyncio.ensure_future(self.probe(engine))
        self._probe_tasks.add(task)
        task.add_done_callback(self._probe_tasks.discard)

    # ---- health ---------------------------------------------------------------------------------
    async def probe(self, engine: Engine) -> bool:
        """Active check: fetch ``/v1/models``; updates thresholds, models and the index."""
        changed = engine.models_changed
        try:
            cards = await self._fetch_models(engine)
        except Exception as exc:  # noqa: BLE001 - any failure is a failed check
            self.record_check(engine, ok=False, error=f"{type(exc).__name__}: {exc}"[:200])
            return False
        if engine.models_changed == changed:  # else older than a load or unload the router made since
            self._learn_models(engine, cards)
        self.record_check(engine, ok=True)
        if self._engines.get(engine.name) is engine:
            for hook in self.on_models_learned:
                try:
                    hook(engine)
                except Exception:  # noqa: BLE001 - a hook's bug must not fail the health check
                    log.exception("models-learned hook %r failed", hook)
        return True

    async def check_all(self) -> None:
        """One active health-check round over every engine, concurrently."""
        engines = list(self._engines.values())
        if engines:
            await asyncio.gather(*(self.probe(e) for e in engines))

    async def run_health_checks(self) -> None:
        """Check every engine every :attr:`check_interval` seconds, and unhealthy ones every
        :data:`RECOVERY_INTERVAL` in between, until cancelled. The interval is read at every tick
        (at most :data:`RECOVERY_INTERVAL` apart), so a reload's new one takes effect within one."""
        ticks = 0
        while True:
            interval = self.check_interval
            tick = min(interval, RECOVERY_INTERVAL)
            every = max(1, round(interval / tick))  # ticks per full round
            await asyncio.sleep(tick)
            ticks += 1
            try:
                if ticks % every == 0:
                    await self.check_all()
                else:
                    down = [e for e in self._engines.values() if not e.healthy]
                    if down:
                        await asyncio.gather(*(self.probe(e) for e in down))
            except Exception:  # pragma: no cover - never let the loop die
                log.exception("health-check round failed")

    # ---- liveness from the metrics scrapes (every second, so faster than the health checks) ---------
    def engine_answered(self, engine: Engine) -> None:
        """A scrape was answered: an engine that had gone silent is live again (its breaker closes)."""
        if engine.silent_scrapes >= HANG_AFTER_SILENT_SCRAPES:
            log.info("engine %s answers again", engine.name)
            engine.breaker.success()
        engine.silent_scrapes = 0

    def engine_silent(self, engine: Engine) -> None:
        """A scrape timed out. A busy engine still answers its metrics (vLLM's API server is not its
        engine core), so a few in a row mean a hang: the breaker opens and new requests go elsewhere;
        requests already there wait for it (their own timeout applies)."""
        engine.silent_scrapes += 1
        if engine.silent_scrapes >= HANG_AFTER_SILENT_SCRAPES:
            if engine.breaker.state is not BreakerState.OPEN:
                log.warning(
                    "engine %s silent for %d scrapes: circuit opened", engine.name, engine.silent_scrapes
                )
            engine.breaker.trip()

    def engine_unreachable(self, engine: Engine) -> None:
        """A scrape's connection was refused: nothing listens there any more."""
        self.eject(engine, "connect_error")

    def record_check(self, engine: Engine, *, ok: bool, error: str | None = None) -> None:
        engine.last_check = time.monotonic()
        if engine.name not in self._engines or self._engines[engine.name] is not engine:
            return  # left while the probe was running
        if ok:
            engine.successes += 1
            engine.failures = 0
            engine.last_error = None
            if not engine.healthy and (not engine.ever_healthy or engine.successes >= self.success_threshold):
                engine.healthy = True
                engine.ever_healthy = True
                engine.ejected_reason = None
                log.info("engine %s healthy", engine.name)
                self._rebuild()
                for healthy in self.on_engine_healthy:
                    healthy(engine)
        else:
            engine.failures += 1
            engine.successes = 0
            engine.last_error = error
            if engine.healthy and engine.failures >= self.failure_threshold:
                engine.healthy = False
                engine.ejected_reason = "health_check"
                log.warning("engine %s unhealthy: %s", engine.name, error)
                self._rebuild()

    def eject(self, engine: Engine, reason: str) -> None:
        """Passive check: a connection error takes the engine out at once; active checks bring it back."""
        engine.successes = 0
        engine.last_error = reason
        if engine.healthy:
            engine.healthy = False
            engine.ejected_reason = reason
            log.warning("engine %s ejected: %s", engine.name, reason)
            self._rebuild()

    def _learn_models(self, engine: Engine, cards: Iterable[dict[str, Any]]) -> None:
        if engine.kind.fixed_models:  # it serves what it was given; its answer was only a health probe
            return
        kept: list[dict[str, Any]] = []
        for card in cards:
            if isinstance(card, dict) and isinstance(card.get("id"), str):
                kept.append(_kept_fields(card))
                if len(kept) >= MAX_MODELS_PER_ENGINE:
                    break
        models = frozenset(c["id"] for c in kept) | frozenset(engine.static_models)
        engine.model_cards = tuple(kept)
        if models != engine.models:
            engine.models = models
            self._rebuild()

    def learn_adapter(self, engine: Engine, card: dict[str, Any]) -> None:
        """The router loaded an adapter there: routable at once, not only after the next probe."""
        if card["id"] in engine.models:
            return
        engine.model_cards = (*engine.model_cards, _kept_fields(card))
        engine.models = engine.models | {card["id"]}
        engine.models_changed += 1
        self._rebuild()

    def forget_adapter(self, engine: Engine, name: str) -> None:
        """The router unloaded an adapter there (the next probe confirms it)."""
        if name not in engine.models or name in engine.static_models:
            return
        engine.model_cards = tuple(c for c in engine.model_cards if c["id"] != name)
        engine.models = engine.models - {name}
        engine.models_changed += 1
        self._rebuild()

    def refresh_soon(self, engines: Iterable[Engine]) -> None:
        """Re-probe engines now (e.g. after a LoRA adapter was loaded) instead of at the next round."""
        for engine in engines:
            self._spawn_probe(engine)

    # ---- index ----------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        by_model: dict[str, list[Engine]] = {}
        prefill_by_model: dict[str, list[Engine]] = {}
        sleeping_by_model: dict[str, list[Engine]] = {}
        known: set[str] = set()
        healthy = 0
        asleep = 0
        for engine in self._engines.values():
            known.update(engine.models)
            alive = engine.ready and engine.healthy  # an engine asleep is healthy, not a candidate
            ok = alive and not engine.sleeping
            healthy += alive
            asleep += alive and engine.sleeping
            routed = prefill_by_model if engine.role == ROLE_PREFILL else by_model
            for model in engine.models:
                if ok:
                    routed.setdefault(model, []).append(engine)
                elif alive:
                    sleeping_by_model.setdefault(model, []).append(engine)
                self._metrics.engine_healthy.labels(engine.name, model).set(1 if alive else 0)
        series = {(e.name, m) for e in self._engines.values() for m in e.models}
        for stale in self._health_series - series:
            try:
                self._metrics.engine_healthy.remove(*stale)
            except KeyError:
                pass
        self._health_series = series
        self._by_model = {m: tuple(es) for m, es in by_model.items()}
        self._prefill_by_model = {m: tuple(es) for m, es in prefill_by_model.items()}
        self._sleeping_by_model = {m: tuple(es) for m, es in sleeping_by_model.items()}
        self._metrics.engines_sleeping.set(asleep)
        self._known_models = frozenset(known)
        self._healthy_count = healthy
        self.changed.set()
        self.changed = asyncio.Event()
        for fn in self.on_rebuilt:
            fn()

    async def wait_probes(self) -> None:
        """Wait for the probes already started (new engines, refreshes)."""
        while self._probe_tasks:
            await asyncio.gather(*list(self._probe_tasks), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._probe_tasks):
            task.cancel()
        if self._probe_tasks:
            await asyncio.gather(*self._probe_tasks, return_exceptions=True)


__all__ = ["EngineRegistry", "BreakerState"]
