"""The engine registry, circuit breaker and scraper parsing, driven directly (no HTTP)."""

from __future__ import annotations

import pytest

from tests.router.helpers import wait_for
from vllm_stack.engines.circuit import BreakerState, CircuitBreaker
from vllm_stack.engines.discovery.base import EndpointInfo
from vllm_stack.engines.discovery.static import StaticDiscovery, endpoint_name
from vllm_stack.engines.engine import Engine
from vllm_stack.engines.registry import EngineRegistry
from vllm_stack.metrics import RouterMetrics
from vllm_stack.telemetry.scraper import parse_engine_metrics


class FakeModels:
    """Answers /v1/models per engine name; a name in ``down`` raises like an unreachable engine."""

    def __init__(self) -> None:
        self.models: dict[str, list[dict]] = {}
        self.down: set[str] = set()

    async def __call__(self, engine: Engine) -> list[dict]:
        if engine.name in self.down:
            raise ConnectionRefusedError("down")
        return self.models.get(engine.name, [{"id": "m", "parent": None, "root": "m"}])


def registry(fake: FakeModels, **kw) -> tuple[EngineRegistry, RouterMetrics]:  # noqa: ANN003
    metrics = RouterMetrics()
    return EngineRegistry(fake, metrics, failure_threshold=2, success_threshold=2, **kw), metrics


async def settle(reg: EngineRegistry) -> None:
    await reg.wait_probes()  # the probes spawned by apply_snapshot


async def test_snapshot_diff_add_remove_and_readiness() -> None:
    fake = FakeModels()
    reg, metrics = registry(fake)
    await reg.apply_snapshot([EndpointInfo("a", "http://a:1"), EndpointInfo("b", "http://b:1")])
    await settle(reg)
    assert [e.name for e in reg.candidates("m")] == ["a", "b"]
    assert (
        metrics.registry.get_sample_value("vllm_stack_router_engine_healthy", {"engine": "a", "model": "m"})
        == 1
    )
    await reg.apply_snapshot([EndpointInfo("b", "http://b:1", ready=False)])
    assert reg.candidates("m") == ()
    assert reg.get("a") is None
    assert (
        metrics.registry.get_sample_value("vllm_stack_router_engine_healthy", {"engine": "a", "model": "m"})
        is None
    )
    assert reg.is_known("m")  # b still serves it, just not ready: 503, not 404


async def test_models_and_lora_adapters_are_learned() -> None:
    fake = FakeModels()
    fake.models["a"] = [{"id": "base", "parent": None, "max_model_len": 99}, {"id": "ad", "parent": "base"}]
    reg, _ = registry(fake)
    await reg.apply_snapshot([EndpointInfo("a", "http://a:1")])
    await settle(reg)
    assert reg.candidates("ad")[0].name == "a"
    assert reg.base_models() == ["base"]
    assert [c["id"] for c in reg.model_cards()] == ["ad", "base"]


async def test_failure_and_success_thresholds_and_passive_ejection() -> None:
    fake = FakeModels()
    reg, _ = registry(fake)
    await reg.apply_snapshot([EndpointInfo("a", "http://a:1")])
    await settle(reg)
    engine = reg.get("a")
    assert engine is not None and engine.healthy  # first success is enough for a new engine
    fake.down.add("a")
    await reg.check_all()
    assert engine.healthy  # one failure < threshold 2
    await reg.check_all()
    assert not engine.healthy and reg.candidates("m") == ()
    fake.down.clear()
    await reg.check_all()
    assert not engine.healthy  # needs 2 successes to come back
    await reg.check_all()
    assert engine.healthy
    reg.eject(engine, "connect_error")  # passive: at once
    assert not engine.healthy and engine.ejected_reason == "connect_error"
    await reg.check_all()
    await reg.check_all()
    assert engine.healthy  # automatic recovery


def test_circuit_breaker_states() -> None:
    now = [0.0]
    states = []
    cb = CircuitBreaker(3, 5.0, on_change=states.append, clock=lambda: now[0])
    for _ in range(2):
        cb.failure()
    assert cb.state is BreakerState.CLOSED
    cb.success()
    for _ in range(3):
        cb.failure()
    assert cb.state is BreakerState.OPEN and not cb.available()
    now[0] = 5.0
    assert cb.available()
    cb.acquire()
    assert cb.state is BreakerState.HALF_OPEN and not cb.available()  # one probe at a time
    cb.failure()
    assert cb.state is BreakerState.OPEN
    now[0] = 10.0
    cb.acquire()
    cb.success()
    assert cb.state is BreakerState.CLOSED
    assert states == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.CLOSED,
    ]


def test_parse_engine_metrics_sums_over_model_names() -> None:
    text = """# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 2.0
vllm:num_requests_running{engine="0",model_name="b"} 1.0
vllm:num_requests_waiting{engine="0",model_name="a"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="a"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="a"} 40.0
vllm:num_requests_running_other 7
"""
    t = parse_engine_metrics(text, now=1.0)
    assert (t.running, t.waiting, t.kv_cache_usage, t.prefix_cache_queries, t.prefix_cache_hits) == (
        3,
        4,
        0.25,
        100,
        40,
    )
    with pytest.raises(ValueError):
        parse_engine_metrics("# nothing\n")


async def test_static_discovery_reports_and_updates() -> None:
    import asyncio

    disc = StaticDiscovery(["http://127.0.0.1:8001/", "http://h:8002"])
    seen: list[list[EndpointInfo]] = []

    async def sink(endpoints: list[EndpointInfo]) -> None:
        seen.append(endpoints)

    task = asyncio.ensure_future(disc.run(sink))
    await wait_for(lambda: len(seen) == 1, what="the first snapshot")
    disc.update(["http://h:8002"])
    await wait_for(lambda: len(seen) == 2, what="the updated snapshot")
    task.cancel()
    assert [[e.name for e in s] for s in seen] == [["127.0.0.1:8001", "h:8002"], ["h:8002"]]
    assert seen[0][0].url == "http://127.0.0.1:8001"
    assert endpoint_name("http://x") == "x:80"
