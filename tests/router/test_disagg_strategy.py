"""Disaggregation as a scheduling strategy: the decider runs before the prefill profile picks, and the
whole strategy (decode profile, decider, prefill profile) is declared in the scheduling YAML like any
other; a configuration written before that (a profile named ``prefill`` and no decider) still works.
Stub engines as in test_disagg.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import http, metric_value, running_router, stubs
from tests.router.test_disagg import DISAGG, body, free_port, lmcache_settings, pd_settings
from vllm_stack.config import ConfigError, load_config
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.profiles import build_scheduler

DECISIONS = "vllm_stack_router_routing_decisions_total"


def prefill_decisions(router: Any) -> float:  # noqa: ANN401 - the running router
    return sum(
        metric_value(router, DECISIONS, strategy="prefill", reason=reason)
        for reason in ("prefix_miss", "prefix_spread", "prefix_hit", "prefix_partial", "round_robin")
    )


async def test_a_decode_only_request_runs_no_prefill_pick() -> None:
    """The decider decides before the prefill profile runs: a request served decode-only leaves no
    routing decision of the prefill profile (nor, test_disagg.py shows, index blocks or shares) on
    the prefill pool; one served disaggregated leaves exactly one.

    Fails on the design before (the prefill profile picked, then the decider ran, then the pick's
    claims were dropped): the decision was counted for a prefill that never ran.
    """
    prefill, decode = StubEngine("P"), StubEngine("D")
    settings = pd_settings(disagg_min_uncached_tokens=4096)
    async with stubs(prefill, decode) as urls, running_router(urls, **settings) as (url, router):
        async with http(url) as c:
            r = await c.post("/v1/chat/completions", json=body())
            assert r.status_code == 200 and r.json()["engine"] == "D"
        assert not prefill.seen
        assert metric_value(router, DISAGG, model="stub-model", outcome="short") == 1
        assert prefill_decisions(router) == 0
        engine = next(e for e in router.registry.engines() if e.role == "prefill")
        assert engine.in_flight == 0 and engine.prefill_tokens == 0
    async with stubs(prefill, decode) as urls, running_router(urls, **pd_settings()) as (url, router):
        async with http(url) as c:
            r = await c.post("/v1/chat/completions", json=body())
            assert r.status_code == 200
        assert len(prefill.seen) == 1 and prefill_decisions(router) == 1


async def test_lmcache_decides_the_decode_engine_first_and_a_decode_only_request_stays_there() -> None:
    """With LMCache's protocol the prefill request names the decode engine, so the decode profile runs
    first; when the decider then says decode-only, the request goes to that engine, scheduled once.

    Kills: in ``director/prefill_stage.py`` ``begin``, returning False instead of ``start_decode``
    (the decode profile would decide twice).
    """
    prefill, decode = StubEngine("P"), StubEngine("D")
    settings = lmcache_settings(free_port(), disagg_min_uncached_tokens=4096, priority_scheduling=False)
    async with stubs(prefill, decode) as urls, running_router(urls, **settings) as (url, router):
        async with http(url) as c:
            r = await c.post("/v1/chat/completions", json=body())
            assert r.status_code == 200 and r.json()["engine"] == "D"
        assert not prefill.seen and len(decode.seen) == 1
        assert metric_value(router, DISAGG, model="stub-model", outcome="short") == 1
        decided = metric_value(router, DECISIONS, strategy="disaggregated_prefill", reason="least_loaded")
        assert decided == 1 and prefill_decisions(router) == 0


#: A disaggregated strategy written in the YAML, as any other: a least-loaded decode profile, a
#: round-robin prefill profile over two prefill engines, a decider that always wants a prefill leg.
YAML_STRATEGY: dict[str, Any] = {
    "plugins": [
        {"type": "circuit-breaker-filter"},
        {"type": "least-loaded-scorer"},
        {"type": "max-score-picker"},
        {"name": "spread", "type": "round-robin-picker"},
        {"name": "always", "type": "uncached-tokens-decider", "parameters": {"min_uncached_tokens": 0}},
        {
            "type": "pd-profile-handler",
            "parameters": {"decode": "decode", "prefill": "warm", "decider": "always"},
        },
    ],
    "schedulingProfiles": [
        {
            "name": "decode",
            "plugins": [
                {"pluginRef": "circuit-breaker-filter"},
                {"pluginRef": "least-loaded-scorer"},
                {"pluginRef": "max-score-picker"},
            ],
        },
        {"name": "warm", "plugins": [{"pluginRef": "circuit-breaker-filter"}, {"pluginRef": "spread"}]},
    ],
}


async def test_a_disaggregated_strategy_is_declared_in_the_scheduling_yaml() -> None:
    first, second, decode = StubEngine("P1"), StubEngine("P2"), StubEngine("D")
    settings = {"scheduling": YAML_STRATEGY, "static_roles": "prefill,prefill,decode"}
    async with stubs(first, second, decode) as urls, running_router(urls, **settings) as (url, router):
        async with http(url) as c:
            for _ in range(4):
                r = await c.post("/v1/chat/completions", json=body("hi"))  # short: the decider says yes
                assert r.status_code == 200 and r.json()["engine"] == "D"
        assert len(first.seen) == len(second.seen) == 2  # the prefill profile's round-robin
        assert len(decode.seen) == 4
        assert metric_value(router, DISAGG, model="stub-model", outcome="disaggregated") == 4
        assert metric_value(router, DECISIONS, strategy="warm", reason="round_robin") == 4


async def test_a_configuration_from_before_the_pd_handler_keeps_disaggregating() -> None:
    """A scheduling section with a profile named ``prefill`` and its own handler, no decider: the
    prefill step is that profile behind the router's ``disagg_min_uncached_tokens``."""
    legacy = {
        "plugins": [
            {"type": "circuit-breaker-filter"},
            {"type": "round-robin-picker"},
            {"type": "prefix-cache-picker"},
            {"type": "single-profile-handler", "parameters": {"profile": "whole"}},
        ],
        "schedulingProfiles": [
            {"name": "whole", "plugins": [{"pluginRef": "round-robin-picker"}]},
            {"name": "prefill", "plugins": [{"pluginRef": "prefix-cache-picker"}]},
        ],
    }
    prefill, decode = StubEngine("P"), StubEngine("D")
    for threshold, sent in ((64, 1), (4096, 0)):
        settings = pd_settings(scheduling=legacy, disagg_min_uncached_tokens=threshold)
        settings.pop("routing_logic")
        prefill.seen.clear()
        async with stubs(prefill, decode) as urls, running_router(urls, **settings) as (url, router):
            async with http(url) as c:
                r = await c.post("/v1/chat/completions", json=body())
                assert r.status_code == 200 and r.json()["engine"] == "D"
            assert len(prefill.seen) == sent
            assert router.scheduler.disaggregation.decider.min_uncached_tokens == threshold


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"prefill": "nope"}, "no scheduling profile named 'nope'"),
        ({"decode": "warm", "prefill": "warm"}, "cannot be the prefill profile"),
        ({"decode": "decode", "prefill": "warm", "decider": "spread"}, "no decider plugin named 'spread'"),
    ],
)
def test_a_pd_handler_naming_what_is_not_there_is_refused(parameters: dict[str, str], message: str) -> None:
    plugins = [p for p in YAML_STRATEGY["plugins"] if p["type"] != "pd-profile-handler"]
    raw = {**YAML_STRATEGY, "plugins": [*plugins, {"type": "pd-profile-handler", "parameters": parameters}]}
    config = load_config(
        {"static_backends": "http://a:1,http://b:1", "static_roles": "prefill,decode", "scheduling": raw}
    )
    with pytest.raises(ConfigError, match=message):
        build_scheduler(config, RouterMetrics())
