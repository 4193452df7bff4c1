"""LoRA adapter routing over stub engines: the registry, tiers, placement, single-flight loads,
eviction, weighted model names. Stub engines stand in for vLLM where a test needs what a real one
cannot do on demand (slow or failing loads, exact slot counts); the same behaviours run against real
engines in test_lora_engines.py."""

from __future__ import annotations

import asyncio
import collections

import httpx
import pytest

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import http, metric_value, running_router, stubs, wait_for
from vllm_stack.config import ConfigError
from vllm_stack.engines.adapters import AdapterCatalog
from vllm_stack.json_depth import MAX_JSON_DEPTH

BASE = "stub-model"


def adapter(name: str, tier: str = "warm", base: str = BASE) -> dict[str, str]:
    return {"name": name, "source": f"/adapters/{name}", "base_model": base, "tier": tier}


def engine_of(r: httpx.Response) -> str:
    return r.headers["x-stub-engine"]


async def complete(h: httpx.AsyncClient, model: str, **extra: object) -> httpx.Response:
    return await h.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1, **extra})


async def test_a_registered_adapter_loaded_nowhere_is_listed_loaded_on_demand_and_then_stays() -> None:
    a, b = StubEngine("a", [BASE], max_loras=2), StubEngine("b", [BASE], max_loras=2)
    async with stubs(a, b) as urls, running_router(urls, lora_adapters=[adapter("ad1")]) as (url, router):
        await wait_for(lambda: all(e.max_loras == 2 for e in router.registry.engines()), what="slots scraped")
        async with http(url) as h:
            cards = {m["id"]: m for m in (await h.get("/v1/models")).json()["data"]}
            assert cards["ad1"]["parent"] == BASE and cards["ad1"]["root"] == "/adapters/ad1"
            first = await complete(h, "ad1")
            assert first.status_code == 200, first.text
            assert first.json()["model"] == "ad1"
            # affinity: every later request goes to the engine that has it, and nothing is loaded again
            later = [engine_of(await complete(h, "ad1")) for _ in range(10)]
        assert set(later) == {engine_of(first)}
        assert a.lora_loads + b.lora_loads == ["ad1"]
        assert metric_value(router, "vllm_stack_router_adapter_loads_total", tier="warm", outcome="ok") == 1
        assert metric_value(router, "vllm_stack_router_adapter_placements_total", outcome="held") == 10


async def test_twenty_concurrent_requests_wait_for_one_load_and_a_leaving_client_does_not_cancel_it() -> None:
    engines = [StubEngine(n, [BASE], max_loras=2) for n in ("a", "b")]
    for e in engines:
        e.behaviour.lora_load_delay_s = 0.5
    async with stubs(*engines) as urls, running_router(urls, lora_adapters=[adapter("ad1")]) as (url, router):
        await wait_for(lambda: all(e.max_loras for e in router.registry.engines()), what="slots scraped")
        async with http(url) as h:
            leaver = asyncio.ensure_future(complete(h, "ad1"))
            await wait_for(lambda: any(e.lora_loads for e in engines), what="the adapter's load under way")
            leaver.cancel()  # the first waiter leaves while the load runs
            results = await asyncio.gather(*(complete(h, "ad1") for _ in range(20)))
        assert [r.status_code for r in results] == [200] * 20
        assert len({engine_of(r) for r in results}) == 1
        assert sum(len(e.lora_loads) for e in engines) == 1


async def test_full_engines_unload_the_least_recently_used_idle_adapter_cold_before_warm() -> None:
    a, b = StubEngine("a", [BASE], max_loras=2), StubEngine("b", [BASE], max_loras=2)
    specs = [adapter("w1"), adapter("c1", "cold"), adapter("w2"), adapter("c2", "cold"), adapter("new")]
    async with stubs(a, b) as urls, running_router(urls, lora_adapters=specs) as (url, router):
        await wait_for(lambda: all(e.max_loras for e in router.registry.engines()), what="slots scraped")
        async with http(url) as h:
            for name in ("w1", "c1", "w2", "c2"):  # four slots, filled
                assert (await complete(h, name)).status_code == 200
            assert sorted(a.cards) + sorted(b.cards) != []
            assert {len(e.cards) for e in (a, b)} == {3}  # base + 2 adapters each
            r = await complete(h, "new")
            assert r.status_code == 200
        holder = a if engine_of(r) == "a" else b
        assert "new" in holder.cards and len(holder.cards) == 3
        gone = {"w1", "c1", "w2", "c2"} - set(a.cards) - set(b.cards)
        assert len(gone) == 1 and gone.pop().startswith("c")  # a cold one went, not a warm one
        assert metric_value(router, "vllm_stack_router_adapter_unloads_total", tier="cold") == 1
        assert metric_value(router, "vllm_stack_router_adapter_placements_total", outcome="evict") == 1


async def test_an_adapter_with_requests_running_is_never_unloaded() -> None:
    """Not even when this router has none in flight: the engine's running_lora_adapters decides
    (another router replica's request)."""
    e = StubEngine("a", [BASE], max_loras=1)
    async with (
        stubs(e) as urls,
        running_router(urls, lora_adapters=[adapter("c1", "cold"), adapter("c2", "cold")]) as (
            url,
            router,
        ),
    ):
        await wait_for(lambda: router.registry.engines()[0].max_loras == 1, what="slots scraped")
        async with http(url) as h:
            assert (await complete(h, "c1")).status_code == 200
            e.running_by_model["c1"] += 1  # someone else's request runs c1 there
            engine = router.registry.engines()[0]
            await wait_for(
                lambda: (t := engine.fresh_telemetry()) is not None and "c1" in (t.running_adapters or ()),
                what="c1 scraped as running there",
            )
            r = await complete(h, "c2")
            assert r.status_code == 200
        assert "c1" in e.cards and "c2" in e.cards  # loaded beyond the slots rather than unloading c1
        assert (
            metric_value(router, "vllm_stack_router_adapter_placements_total", outcome="over_capacity") == 1
        )


async def test_a_failed_load_is_a_clear_error_for_every_waiter_and_the_next_request_tries_again() -> None:
    e = StubEngine("a", [BASE], max_loras=2)
    e.behaviour.lora_load_status = 404
    async with stubs(e) as urls, running_router(urls, lora_adapters=[adapter("ad1")]) as (url, _):
        async with http(url) as h:
            results = await asyncio.gather(*(complete(h, "ad1") for _ in range(5)))
            for r in results:
                assert r.status_code == 502, r.text
                err = r.json()["error"]
                assert err["code"] == "adapter_load_failed" and "No adapter found" in err["message"]
            e.behaviour.lora_load_status = 200
            assert (await complete(h, "ad1")).status_code == 200


async def test_unknown_adapter_is_404_and_unknown_base_of_a_registered_one_is_404() -> None:
    async with stubs(StubEngine("a", [BASE], max_loras=2)) as urls:
        async with (
            running_router(urls, lora_adapters=[adapter("orphan", base="nope")]) as (url, _),
            http(url) as h,
        ):
            r = await complete(h, "no-such-adapter")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await complete(h, "orphan")
            assert r.status_code == 404 and "nope" in r.json()["error"]["message"]


async def test_hot_adapters_are_loaded_on_every_engine_and_again_after_a_restart() -> None:
    a, b = StubEngine("a", [BASE], max_loras=2), StubEngine("b", [BASE], max_loras=2)
    async with (
        stubs(a, b) as urls,
        running_router(urls, lora_adapters=[adapter("hot1", "hot")]) as (_, router),
    ):
        await wait_for(lambda: "hot1" in a.cards and "hot1" in b.cards, what="hot adapter everywhere")
        del a.cards["hot1"]  # the engine restarted: it lists no adapter
        await wait_for(lambda: "hot1" in a.cards, what="hot adapter back")
        assert a.lora_loads == ["hot1", "hot1"] and b.lora_loads == ["hot1"]
        assert len(router.registry.candidates("hot1")) == 2


async def test_a_hot_adapter_is_never_the_one_unloaded() -> None:
    e = StubEngine("a", [BASE], max_loras=2)
    specs = [adapter("hot1", "hot"), adapter("c1", "cold"), adapter("c2", "cold")]
    async with stubs(e) as urls, running_router(urls, lora_adapters=specs) as (url, router), http(url) as h:
        await wait_for(
            lambda: "hot1" in e.cards and router.registry.engines()[0].max_loras, what="hot loaded"
        )
        for name in ("c1", "c2", "c1", "c2"):
            assert (await complete(h, name)).status_code == 200
        assert "hot1" in e.cards and len(e.cards) == 3


async def test_weighted_model_name_splits_exactly_and_a_session_keeps_its_target() -> None:
    a = StubEngine("a", ["v1", "v2"])
    weighted = {"chat": [{"model": "v1", "weight": 90}, {"model": "v2", "weight": 10}]}
    async with stubs(a) as urls, running_router(urls, weighted_models=weighted) as (url, _), http(url) as h:
        cards = {m["id"] for m in (await h.get("/v1/models")).json()["data"]}
        assert {"chat", "v1", "v2"} <= cards
        counts = collections.Counter()
        for _ in range(1000):
            r = await complete(h, "chat")
            counts[r.json()["model"]] += 1
        assert counts == {"v1": 900, "v2": 100}
        seen = [s for s in a.seen if s.path == "/v1/completions"]
        assert all(b'"model":"chat"' not in s.body for s in seen)  # the engine gets the target's name
        for user in ("alice", "bob", "carol"):
            models = {(await complete(h, "chat", user=user)).json()["model"] for _ in range(10)}
            assert len(models) == 1


async def test_an_engine_that_lost_its_adapter_gets_it_loaded_again_instead_of_a_404() -> None:
    """The router's view lags the engine by up to a probe (a restart, another replica's unload)."""
    e = StubEngine("a", [BASE], max_loras=2, strict_models=True)
    async with (
        stubs(e) as urls,
        running_router(urls, lora_adapters=[adapter("ad1")], health_check_interval=30) as (
            url,
            router,
        ),
    ):
        async with http(url) as h:
            assert (await complete(h, "ad1")).status_code == 200
            del e.cards["ad1"]  # gone on the engine; the router has not probed since
            r = await complete(h, "ad1")
        assert r.status_code == 200, r.text
        assert e.lora_loads == ["ad1", "ad1"]
        assert (
            metric_value(router, "vllm_stack_router_retries_total", model="ad1", reason="adapter_missing")
            == 1
        )


async def test_a_held_adapter_behind_an_open_breaker_is_loaded_on_another_engine() -> None:
    a, b = StubEngine("a", [BASE], max_loras=2), StubEngine("b", [BASE], max_loras=2)
    async with stubs(a, b) as urls, running_router(urls, lora_adapters=[adapter("ad1")]) as (url, router):
        async with http(url) as h:
            first = await complete(h, "ad1")
            holder = router.registry.get(next(e.name for e in router.registry.engines() if "ad1" in e.models))
            holder.breaker.trip()
            r = await complete(h, "ad1")
        assert r.status_code == 200, r.text
        assert engine_of(r) != engine_of(first)
        assert "ad1" in a.cards and "ad1" in b.cards


async def test_an_engine_that_never_served_a_request_takes_a_new_adapter_before_an_eviction() -> None:
    """vLLM publishes its slot count from its first request on: a scaled-out engine must get work."""
    full, fresh = StubEngine("full", [BASE], max_loras=1), StubEngine("fresh", [BASE])
    async with (
        stubs(full) as urls,
        running_router(urls, lora_adapters=[adapter("ad1"), adapter("ad2")]) as (
            url,
            router,
        ),
    ):
        async with http(url) as h:
            assert (await complete(h, "ad1")).status_code == 200
            await wait_for(lambda: router.registry.engines()[0].max_loras == 1, what="slots scraped")
            async with stubs(fresh) as more:
                router.discovery.update([*urls, *more])
                await wait_for(lambda: router.registry.healthy_count == 2, what="the new engine")
                r = await complete(h, "ad2")
        assert engine_of(r) == "fresh"
        assert "ad1" in full.cards  # nothing was unloaded


async def test_waiters_of_a_load_on_an_engine_that_leaves_get_a_clear_error() -> None:
    a = StubEngine("a", [BASE], max_loras=2)
    a.behaviour.lora_load_delay_s = 3.0
    async with (
        stubs(a) as urls,
        running_router(urls, lora_adapters=[adapter("ad1")]) as (url, router),
        http(url) as h,
    ):
        waiting = asyncio.ensure_future(complete(h, "ad1"))
        await wait_for(lambda: bool(a.lora_loads), what="the load under way")
        router.discovery.update([])  # the engine leaves
        r = await asyncio.wait_for(waiting, 2.0)
    assert r.status_code == 502, r.text
    assert r.json()["error"]["code"] == "adapter_load_failed" and "left" in r.json()["error"]["message"]


async def test_weighted_name_rewrite_keeps_the_rest_of_the_body_as_sent() -> None:
    """Nesting at the router's depth limit and integers past 64 bits: re-encoding the whole body would
    change or refuse them (orjson writes 64-bit integers only)."""
    a = StubEngine("a", ["v1"])
    weighted = {"chat": [{"model": "v1", "weight": 1}]}
    deepest = MAX_JSON_DEPTH - 1  # the body's own object is the first level
    rest = b'"x":' + b"[" * deepest + b"]" * deepest + b',"n":123456789012345678901234567890,"f":1.50'
    async with stubs(a) as urls, running_router(urls, weighted_models=weighted) as (url, _), http(url) as h:
        r = await h.post(
            "/v1/completions",
            content=b'{"model":"chat","prompt":"x","max_tokens":1,' + rest + b"}",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 200, r.text
    body = [s for s in a.seen if s.path == "/v1/completions"][-1].body
    assert body.startswith(b'{"model":"v1",') and rest in body


@pytest.mark.parametrize(
    ("adapters", "weighted", "message"),
    [
        ([{"name": "x", "source": "/x"}], None, "base_model"),
        ([{"name": "x", "source": "/x", "base_model": "b", "tier": "lukewarm"}], None, "tier"),
        ([adapter("x"), adapter("x")], None, "twice"),
        ([], {"m": [{"model": "a", "weight": 0}]}, "weight"),
        ([], {"m": [{"model": "a", "weight": 1.5}]}, "integer"),
        ([], {"m": [{"model": "m2"}], "m2": [{"model": "a"}]}, "another weighted"),
        ([adapter("m")], {"m": [{"model": "a"}]}, "registered adapter"),
    ],
)
def test_bad_adapter_and_weighted_settings_are_refused(
    adapters: list, weighted: dict | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        AdapterCatalog.from_settings(adapters, weighted)
