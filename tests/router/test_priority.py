"""Request priority over stub engines: classes from a header, the body or the configuration, who may
raise them, the description's critical/sheddable chains, the queue (wait, dispatch on room, timeout,
client leaving, full), scale from zero. Stub engines stand in for vLLM where a test needs figures a
real engine cannot be made to publish on demand (an exact queue length or KV usage); the same paths
run against real engines in test_priority_engines.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import pytest

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import http, metric_value, running_router, stubs, wait_for
from vllm_stack.app import Router
from vllm_stack.config import ConfigError, load_config
from vllm_stack.engines.engine import Engine

BASE = "stub-model"
CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
PRIO = "x-request-priority"


def engine_of(r: httpx.Response) -> str:
    return r.headers["x-stub-engine"]


def last_body(engine: StubEngine) -> dict[str, object]:
    return json.loads(engine.seen[-1].body)


def by_url(router: Router, url: str) -> Engine:
    return next(e for e in router.registry.engines() if e.url == url)


async def figures(router: Router, urls: list[str], stubs_: list[StubEngine]) -> None:
    for url, stub in zip(urls, stubs_, strict=True):
        engine = by_url(router, url)
        await wait_for(
            lambda e=engine, s=stub: (
                (t := e.fresh_telemetry()) is not None
                and t.waiting == s.waiting
                and t.kv_cache_usage == s.kv_cache_usage
            ),
            what=f"{stub.name} scraped",
        )


async def test_the_descriptions_example_a_critical_request_for_lora_x_goes_to_pod_a() -> None:
    """Pod A (queue 6, KV 85%, X loaded), B (queue 4, KV 75%), C (queue 7, KV 60%): a critical
    request for LoRA-X keeps all three (queue < 50), LoRA affinity keeps A, A is chosen. A sheddable
    request goes only where KV < 80% and queue < 5 (B), and is shed once B is saturated too."""
    a, b, c = (StubEngine(n, [BASE], max_loras=2) for n in "abc")
    a.add_model("lora-x", parent=BASE)
    (a.waiting, a.kv_cache_usage), (b.waiting, b.kv_cache_usage), (c.waiting, c.kv_cache_usage) = (
        (6, 0.85),
        (4, 0.75),
        (7, 0.60),
    )
    lora = [{"name": "lora-x", "source": "/adapters/lora-x", "base_model": BASE, "criticality": "critical"}]
    async with stubs(a, b, c) as urls, running_router(urls, lora_adapters=lora) as (url, router):
        await figures(router, urls, [a, b, c])
        async with http(url) as h:
            for _ in range(5):
                r = await h.post("/v1/chat/completions", json={**CHAT, "model": "lora-x"})
                assert r.status_code == 200, r.text
                assert engine_of(r) == "a"
            assert b.lora_loads == [] and c.lora_loads == []
            shed = {**CHAT}
            for _ in range(3):
                r = await h.post("/v1/chat/completions", json=shed, headers={PRIO: "sheddable"})
                assert r.status_code == 200 and engine_of(r) == "b"
            b.kv_cache_usage = 0.8
            await figures(router, urls, [a, b, c])
            r = await h.post("/v1/chat/completions", json=shed, headers={PRIO: "sheddable"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "engines_saturated"
            assert r.headers["retry-after"] == "1"
            # the base model is standard: raising a request of it to critical needs a priority key
            r = await h.post("/v1/chat/completions", json=CHAT, headers={PRIO: "critical"})
            assert r.status_code == 403
    decisions = metric_value(
        router, "vllm_stack_router_routing_decisions_total", strategy="critical", reason="round_robin"
    )
    assert decisions >= 5


async def test_critical_requests_take_the_least_queue_then_the_least_kv_cache() -> None:
    a, b, c = (StubEngine(n, [BASE]) for n in "abc")
    (a.waiting, a.kv_cache_usage), (b.waiting, b.kv_cache_usage), (c.waiting, c.kv_cache_usage) = (
        (3, 0.2),
        (2, 0.5),
        (2, 0.4),
    )
    critical = [{"name": BASE, "criticality": "critical"}]
    async with stubs(a, b, c) as urls, running_router(urls, models=critical) as (url, router):
        await figures(router, urls, [a, b, c])
        async with http(url) as h:
            seen = {engine_of(await h.post("/v1/chat/completions", json=CHAT)) for _ in range(4)}
        assert seen == {"c"}  # queue 2 ties B and C; C has the lower KV usage
        # A queue of 50 or more leaves none for a critical request: it waits (and times out here)
        for s in (a, b, c):
            s.waiting = 60
        await figures(router, urls, [a, b, c])
        router.director.settings = dataclasses.replace(router.director.settings, queue_timeout=0.5)
        async with http(url) as h:
            r = await h.post("/v1/chat/completions", json=CHAT)
        # its engines are busy, not gone: 429 (back off), with the reason llm-d's clients read
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"
        assert r.headers["x-llm-d-request-dropped-reason"] == "queue_timeout" and r.headers["retry-after"]
        assert (
            metric_value(
                router,
                "vllm_stack_router_queue_exits_total",
                model=BASE,
                outcome="timeout",
                **{"class": "critical"},
            )
            == 1
        )


async def test_priority_comes_from_the_header_the_body_or_the_model_and_only_priority_keys_raise_it() -> None:
    a = StubEngine("a", [BASE])
    models = [{"name": BASE, "criticality": "sheddable", "engine_priority": True}]
    environ = {"VLLM_STACK_PRIORITY_API_KEYS": "boss-key"}
    async with (
        stubs(a) as urls,
        running_router(urls, environ=environ, models=models) as (url, _),
        http(url) as h,
    ):
        # the model's default (sheddable, -1) reaches the engine in vLLM's sense (lower first): 1
        assert (await h.post("/v1/chat/completions", json=CHAT)).status_code == 200
        assert last_body(a)["priority"] == 1
        assert last_body(a)["messages"] == CHAT["messages"]  # the rest of the body as it was
        # lower is anyone's; higher needs a priority key
        r = await h.post("/v1/chat/completions", json=CHAT, headers={PRIO: "-7"})
        assert r.status_code == 200 and last_body(a)["priority"] == 7
        for header in ("standard", "critical", "0", "3"):
            r = await h.post("/v1/chat/completions", json=CHAT, headers={PRIO: header})
            assert r.status_code == 403 and r.json()["error"]["code"] == "priority_not_allowed", header
        r = await h.post("/v1/chat/completions", json={**CHAT, "priority": -3})  # vLLM's field: a raise
        assert r.status_code == 403
        r = await h.post("/v1/chat/completions", json={**CHAT, "priority": 9})  # vLLM's field: lower
        assert r.status_code == 200 and last_body(a)["priority"] == 9
        boss = {PRIO: "critical", "authorization": "Bearer boss-key"}
        r = await h.post("/v1/chat/completions", json=CHAT, headers=boss)
        assert r.status_code == 200 and last_body(a)["priority"] == -1
        r = await h.post("/v1/chat/completions", json=CHAT, headers={**boss, "authorization": "Bearer other"})
        assert r.status_code == 403
        for bad_header in ("urgent", "1e9", "99999999999"):
            r = await h.post("/v1/chat/completions", json=CHAT, headers={PRIO: bad_header})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_priority", bad_header
        for bad_body in ("high", 1.5, True, 10**12):
            r = await h.post("/v1/chat/completions", json={**CHAT, "priority": bad_body})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_priority", bad_body


async def test_engines_without_priority_scheduling_get_the_body_as_sent() -> None:
    a = StubEngine("a", [BASE])
    async with stubs(a) as urls, running_router(urls) as (url, _), http(url) as h:
        sent = json.dumps({**CHAT, "n": 1}, separators=(", ", ": ")).encode()
        r = await h.post(
            "/v1/chat/completions",
            content=sent,
            headers={PRIO: "sheddable", "content-type": "application/json"},
        )
        assert r.status_code == 200 and a.seen[-1].body == sent


async def test_a_queued_request_leaves_the_moment_a_request_on_its_engine_ends() -> None:
    """Between scrapes, the router's own in-flight count moves the queue estimate: one request ending
    on a saturated engine lets one waiting request go, without waiting for the next scrape."""
    a = StubEngine("a", [BASE])
    a.behaviour.delay_s = 1.0
    async with stubs(a) as urls, running_router(urls, engine_scrape_interval=60) as (url, router):
        engine = router.registry.engines()[0]
        async with http(url) as h:
            slow = asyncio.create_task(h.post("/v1/chat/completions", json=CHAT, headers={PRIO: "-1"}))
            await wait_for(lambda: engine.in_flight == 1, what="slow request in flight")
            a.waiting = 5
            await router.scraper.scrape(engine)  # the engine says 5 wait, one of them the router's
            waiting = asyncio.create_task(h.post("/v1/chat/completions", json=CHAT))
            await wait_for(lambda: router.queue.length == 1, what="request queued")
            assert metric_value(router, "vllm_stack_router_queue_length", model=BASE) == 1
            a.behaviour.delay_s = 0.0
            assert (await slow).status_code == 200
            r = await asyncio.wait_for(waiting, 5)  # the next scrape is a minute away
            assert r.status_code == 200
        assert router.queue.length == 0
        assert (
            metric_value(
                router,
                "vllm_stack_router_queue_exits_total",
                model=BASE,
                outcome="dispatched",
                **{"class": "standard"},
            )
            == 1
        )


async def test_a_client_that_leaves_the_queue_is_removed_and_a_full_queue_answers_429() -> None:
    a = StubEngine("a", [BASE])
    a.waiting = 9
    async with stubs(a) as urls, running_router(urls, queue_max_per_model=1) as (url, router):
        await figures(router, urls, [a])
        async with http(url) as h:
            with pytest.raises(httpx.ReadTimeout):
                await h.post("/v1/chat/completions", json=CHAT, timeout=0.5)
            await wait_for(lambda: router.queue.length == 0, what="the client's request removed")
            assert (
                metric_value(
                    router,
                    "vllm_stack_router_queue_exits_total",
                    model=BASE,
                    outcome="client_closed",
                    **{"class": "standard"},
                )
                == 1
            )
            first = asyncio.create_task(h.post("/v1/chat/completions", json=CHAT))
            await wait_for(lambda: router.queue.length == 1, what="one waiting")
            r = await h.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
            a.waiting = 0
            assert (await asyncio.wait_for(first, 5)).status_code == 200
        assert a.aborted == 0 and a.completed == 1  # nothing sent for the requests that left


async def test_scale_from_zero_a_configured_model_without_engines_waits_and_is_counted_as_itself() -> None:
    a = StubEngine("a", [BASE])
    models = [BASE, "cold-model"]
    async with stubs(a) as urls, running_router(urls, models=models, queue_timeout=0.5) as (url, router):
        async with http(url) as h:
            r = await h.post("/v1/chat/completions", json={**CHAT, "model": "cold-model"})
            # no engine at all: 503, the same reason
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"
            assert r.headers["x-llm-d-request-dropped-reason"] == "queue_timeout" and r.headers["retry-after"]
            assert (
                metric_value(
                    router,
                    "vllm_stack_router_requests_total",
                    model="cold-model",
                    engine="none",
                    status="503",
                )
                == 1
            )
            r = await h.post("/v1/chat/completions", json={**CHAT, "model": "no-such-model"})
            assert r.status_code == 404  # not configured: still unknown
            router.director.settings = dataclasses.replace(router.director.settings, queue_timeout=30)
            waiting = asyncio.create_task(
                h.post("/v1/chat/completions", json={**CHAT, "model": "cold-model"})
            )
            await wait_for(
                lambda: metric_value(router, "vllm_stack_router_queue_length", model="cold-model") == 1,
                what="queued for the cold model",
            )
            a.add_model("cold-model")  # its engine is up: the next probe learns it
            r = await asyncio.wait_for(waiting, 10)
            assert r.status_code == 200 and engine_of(r) == "a"


async def test_priority_off_routes_as_before_and_the_queue_can_be_turned_off() -> None:
    a = StubEngine("a", [BASE])
    a.waiting = 9
    async with stubs(a) as urls:
        async with running_router(urls, routing_logic="leastloaded", priority_scheduling=False) as (
            url,
            router,
        ):
            await figures(router, urls, [a])
            async with http(url) as h:
                r = await h.post("/v1/chat/completions", json=CHAT, headers={PRIO: "sheddable"})
            assert r.status_code == 200  # no saturation filter: a saturated engine still gets it
            assert list(router.scheduler.profiles) == ["leastloaded"]
        async with running_router(urls, routing_logic="leastloaded", queue_max_per_model=0) as (url, router):
            await figures(router, urls, [a])
            assert list(router.scheduler.profiles) == ["leastloaded", "critical"]
            async with http(url) as h:
                r = await h.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 429 and r.json()["error"]["code"] == "engines_saturated"


def test_bad_priority_settings_are_refused_at_load() -> None:
    base = {"static_backends": "http://127.0.0.1:1"}
    for bad in (
        {"models": [{"name": "m", "criticality": "urgent"}]},
        {"models": [{"name": "m", "engine_priority": "yes"}]},
        {"models": [{"criticality": "critical"}]},
        {"models": [{"name": "m", "tier": "hot"}]},
        {"saturation_max_kv_cache_usage": 0},
        {"queue_timeout": 0},
        {"queue_max_per_model": -1},
    ):
        with pytest.raises(ConfigError):
            load_config({**base, **bad}, environ={})
    config = load_config({**base, "models": "a,b"}, environ={})
    assert config.models == ("a", "b")


async def test_critical_headroom_learns_the_engines_slots_and_keeps_one_for_critical_requests() -> None:
    a = StubEngine("a", [BASE])
    a.running, a.waiting = 3, 2  # it runs 3 at once: others wait
    async with (
        stubs(a) as urls,
        running_router(urls, critical_reserve_slots=1, queue_timeout=0.5) as (url, router),
    ):
        engine = router.registry.engines()[0]
        await wait_for(lambda: engine.running_slots == 3, what="slots learned from a scrape")
        a.running, a.waiting = 2, 0  # two there now: 3 slots less the reserve of 1 are taken
        await figures(router, urls, [a])
        assert (await router_describe(url))["running_slots"] == 3
        async with http(url) as h:
            r = await h.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"
            r = await h.post("/v1/chat/completions", json=CHAT, headers={PRIO: "sheddable"})
            assert r.status_code == 429
        a.running = 1
        await figures(router, urls, [a])
        async with http(url) as h:
            assert (await h.post("/v1/chat/completions", json=CHAT)).status_code == 200


async def router_describe(url: str) -> dict[str, object]:
    async with http(url) as h:
        return (await h.get("/engines")).json()["engines"][0]
