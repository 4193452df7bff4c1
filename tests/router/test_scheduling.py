"""Scheduling plugins and profiles, each tested alone on in-memory engines (no HTTP)."""

from __future__ import annotations

import collections
import random
import time

import pytest

from vllm_stack.config import RouterConfig
from vllm_stack.engines.circuit import CircuitBreaker
from vllm_stack.engines.engine import Engine, EngineTelemetry
from vllm_stack.engines.load import engine_loads
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.framework import RequestContext, Scheduler
from vllm_stack.scheduling.plugins.circuit_breaker_filter import CircuitBreakerFilter
from vllm_stack.scheduling.plugins.consistent_hash_picker import ConsistentHashPicker, session_key
from vllm_stack.scheduling.plugins.power_of_two_picker import PowerOfTwoPicker
from vllm_stack.scheduling.profiles import build_scheduler


def make_engines(n: int) -> list[Engine]:
    out = []
    for i in range(n):
        e = Engine(f"e{i}", f"http://10.0.0.{i}:8000", CircuitBreaker(2, 10.0))
        e.healthy = True
        out.append(e)
    return out


def scheduler(logic: str, **kw) -> tuple[Scheduler, RouterMetrics]:  # noqa: ANN003
    cfg = RouterConfig(static_backends=("http://x:1",), routing_logic=logic, **kw)
    metrics = RouterMetrics()
    return build_scheduler(cfg, metrics), metrics


def pick(s: Scheduler, ctx: RequestContext, engines: list[Engine]) -> Engine | None:
    """The engine the scheduler chose (None when it chose none)."""
    return s.schedule(ctx, engines).engine


def test_round_robin_is_even() -> None:
    s, metrics = scheduler("roundrobin")
    engines = make_engines(3)
    picks = collections.Counter(pick(s, RequestContext("m"), engines).name for _ in range(300))
    assert picks == {"e0": 100, "e1": 100, "e2": 100}
    assert (
        metrics.registry.get_sample_value(
            "vllm_stack_router_routing_decisions_total", {"strategy": "roundrobin", "reason": "round_robin"}
        )
        == 300
    )


def test_random_uses_every_engine() -> None:
    s, _ = scheduler("random")
    engines = make_engines(3)
    picks = collections.Counter(pick(s, RequestContext("m"), engines).name for _ in range(300))
    assert set(picks) == {"e0", "e1", "e2"} and min(picks.values()) > 50


def test_least_loaded_uses_in_flight_and_fresh_queue() -> None:
    s, _ = scheduler("leastloaded")
    engines = make_engines(3)
    engines[0].in_flight, engines[1].in_flight, engines[2].in_flight = 5, 1, 3
    assert pick(s, RequestContext("m"), engines).name == "e1"
    now = time.monotonic()
    for e, waiting in zip(engines, (0, 10, 0), strict=True):
        e.telemetry = EngineTelemetry(0, waiting, 0.1, None, None, now)
    assert [round(x) for x in engine_loads(engines)] == [5, 11, 3]
    assert pick(s, RequestContext("m"), engines).name == "e2"


def test_stale_telemetry_is_unknown_not_zero() -> None:
    engines = make_engines(2)
    engines[0].in_flight, engines[1].in_flight = 1, 2
    old = time.monotonic() - 60
    engines[0].telemetry = EngineTelemetry(0, 100, None, None, None, old)  # stale: would say 101
    engines[1].telemetry = EngineTelemetry(0, 0, None, None, None, time.monotonic())
    assert engines[0].fresh_telemetry() is None
    assert engine_loads(engines) == [1.0, 2.0]  # queue term dropped for everyone, not zeroed for one


def test_least_loaded_ties_rotate() -> None:
    s, _ = scheduler("leastloaded")
    engines = make_engines(2)
    picks = collections.Counter(pick(s, RequestContext("m"), engines).name for _ in range(10))
    assert picks == {"e0": 5, "e1": 5}


def test_power_of_two_prefers_the_lighter_of_two() -> None:
    engines = make_engines(2)
    engines[0].in_flight = 10
    picker = PowerOfTwoPicker(random.Random(1))
    assert all(picker.pick(RequestContext("m"), engines, None)[0].name == "e1" for _ in range(20))


def test_session_affinity_is_sticky() -> None:
    s, _ = scheduler("session")
    engines = make_engines(4)
    for key in ("alice", "bob", "carol"):
        first = pick(s, RequestContext("m", session_key=key), engines)
        assert all(pick(s, RequestContext("m", session_key=key), engines) is first for _ in range(10))


def test_session_keys_spread_over_engines() -> None:
    s, _ = scheduler("session")
    engines = make_engines(4)
    picks = collections.Counter(
        pick(s, RequestContext("m", session_key=f"user-{i}"), engines).name for i in range(400)
    )
    assert len(picks) == 4 and min(picks.values()) > 50


def test_session_bounded_load_caps_an_engine() -> None:
    """No engine takes more than ceil((1 + e) x mean) in-flight requests, even if every key maps to it."""
    eps = 0.25
    picker = ConsistentHashPicker("session", session_key, eps)
    engines = make_engines(4)
    for _ in range(100):  # one hot session, requests stay in flight
        e, _reason = picker.pick(RequestContext("m", session_key="hot"), engines, None)
        e.in_flight += 1
    loads = [e.in_flight for e in engines]
    assert max(loads) <= -(-(1 + eps) * 100 // 4) + 1, loads
    reasons = set()
    for e in engines:
        e.in_flight = 0
    e, reason = picker.pick(RequestContext("m", session_key="hot"), engines, None)
    reasons.add(reason)
    assert reason == "session_hit"


def test_session_without_key_falls_back_to_least_in_flight() -> None:
    s, metrics = scheduler("session")
    engines = make_engines(2)
    engines[0].in_flight = 3
    assert pick(s, RequestContext("m"), engines).name == "e1"
    assert (
        metrics.registry.get_sample_value(
            "vllm_stack_router_routing_decisions_total", {"strategy": "session", "reason": "session_no_key"}
        )
        == 1
    )


def test_session_mapping_is_stable_across_instances() -> None:
    """Router replicas must agree: hashing does not depend on PYTHONHASHSEED or instance state."""
    engines = make_engines(5)
    a = ConsistentHashPicker("session", session_key)
    b = ConsistentHashPicker("session", session_key)
    for i in range(50):
        ctx = RequestContext("m", session_key=f"k{i}")
        assert a.pick(ctx, engines, None)[0] is b.pick(ctx, engines, None)[0]


def test_session_removal_moves_only_that_engines_keys() -> None:
    picker = ConsistentHashPicker("session", session_key)
    engines = make_engines(5)
    before = {
        i: picker.pick(RequestContext("m", session_key=f"k{i}"), engines, None)[0].name for i in range(300)
    }
    fewer = [e for e in engines if e.name != "e2"]
    after = {
        i: picker.pick(RequestContext("m", session_key=f"k{i}"), fewer, None)[0].name for i in range(300)
    }
    moved = [i for i in before if before[i] != after[i]]
    assert all(before[i] == "e2" for i in moved)


def test_prefixaware_groups_equal_prefixes() -> None:
    s, _ = scheduler("prefixaware")
    engines = make_engines(4)
    doc = b'[{"role":"system","content":"You are a long shared system prompt"}'
    first = pick(s, RequestContext("m", prefix=doc), engines)
    assert all(pick(s, RequestContext("m", prefix=doc), engines) is first for _ in range(5))


def test_circuit_breaker_filter_and_retry_exclusion() -> None:
    engines = make_engines(3)
    engines[0].breaker.failure()
    engines[0].breaker.failure()  # threshold 2: open
    kept = CircuitBreakerFilter().filter(RequestContext("m"), engines)
    assert [e.name for e in kept] == ["e1", "e2"]
    s, _ = scheduler("roundrobin")
    ctx = RequestContext("m", excluded={"e1"})
    assert {pick(s, ctx, engines).name for _ in range(4)} == {"e2"}
    ctx.excluded.add("e2")
    assert pick(s, ctx, engines) is None


@pytest.mark.parametrize("logic", ["roundrobin", "random", "leastloaded", "p2c", "session", "prefixaware"])
def test_every_profile_picks_a_candidate(logic: str) -> None:
    s, _ = scheduler(logic)
    engines = make_engines(3)
    assert pick(s, RequestContext("m", session_key="k", prefix=b"p"), engines) in engines
    assert pick(s, RequestContext("m"), engines[:1]) is engines[0]


def test_profiles_per_model_and_the_reason_when_none_is_picked() -> None:
    """The model profile handler runs each model's profile; an empty result says why."""
    from vllm_stack.scheduling.config import build_scheduling
    from vllm_stack.scheduling.framework import Reason
    from vllm_stack.scheduling.plugins import builtin_registry
    from vllm_stack.scheduling.registry import PluginState

    raw = {
        "plugins": [
            {"type": "circuit-breaker-filter"},
            {"type": "saturation-filter", "parameters": {"max_waiting": 1}},
            {"type": "round-robin-picker"},
            {"name": "sticky", "type": "consistent-hash-picker", "parameters": {"key": "session"}},
            {
                "type": "model-profile-handler",
                "parameters": {"profiles": {"chat": "affinity"}, "default": "spread"},
            },
        ],
        "schedulingProfiles": [
            {
                "name": "spread",
                "plugins": ["circuit-breaker-filter", "saturation-filter", "round-robin-picker"],
            },
            {"name": "affinity", "plugins": ["circuit-breaker-filter", "sticky"]},
        ],
    }
    metrics = RouterMetrics()
    s = build_scheduling(raw, builtin_registry(), PluginState(), metrics).scheduler
    engines = make_engines(3)
    chat = [s.schedule(RequestContext("chat", session_key="u"), engines) for _ in range(6)]
    assert {r.profile for r in chat} == {"affinity"} and len({r.engine.name for r in chat}) == 1
    other = [s.schedule(RequestContext("embed"), engines) for _ in range(6)]
    assert {r.profile for r in other} == {"spread"} and len({r.engine.name for r in other}) == 3
    assert s.schedule(RequestContext("embed"), []).reason == Reason.NO_CANDIDATE
    ctx = RequestContext("embed", excluded={e.name for e in engines})
    assert s.schedule(ctx, engines).reason == Reason.ALL_FILTERED
    for e in engines:
        e.telemetry = EngineTelemetry(0, 5, None, None, None, time.monotonic())
    result = s.schedule(RequestContext("embed"), engines)
    assert (result.engine, result.reason) == (None, Reason.ALL_SATURATED)
    for e in engines:
        for _ in range(3):
            e.breaker.failure()
    assert s.schedule(RequestContext("chat", session_key="u"), engines).reason == Reason.ALL_FILTERED
