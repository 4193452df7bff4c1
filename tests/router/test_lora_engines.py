"""LoRA adapter routing on real vLLM engines (CPU build) with adapters from the adapter builder.

The session's two chat engines (``--max-loras 4``, runtime LoRA updating on): on-demand loading,
affinity, a single load for 20 concurrent requests (counted in the engines' own logs), eviction at
``max_loras``, unknown adapters, and a weighted model name over 1,000 requests. Hot adapters after an
engine restart are checked in test_engine_faults.py, on the restart that file already makes.
Every adapter a test loads is unloaded again: the engines are shared.
"""

from __future__ import annotations

import asyncio
import collections
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from vllm_stack_dev.paths import cache_dir
from vllm_stack_dev.testbed.models import build_lora

from tests.router.helpers import http, metric_value, running_router, wait_for

pytestmark = pytest.mark.engine

MODEL = "tiny-llama"
NAMES = [f"ad{i}" for i in range(1, 6)]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model_dir: Path) -> dict[str, Path]:
    """Five distinct adapters (different seeds) for the tiny model."""
    return {
        name: build_lora(tiny_model_dir, cache_dir() / "models" / f"lora-{name}", seed=i)
        for i, name in enumerate(NAMES, 1)
    }


@pytest.fixture
def clean_engines(engines) -> Iterator[None]:  # noqa: ANN001
    """Unload, after the test, whatever adapter of this module it left on the shared engines."""
    yield
    for engine in engines:
        for name in NAMES:
            httpx.post(engine.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=10)


def registered(dirs: dict[str, Path], tier: str = "warm") -> list[dict[str, str]]:
    return [{"name": n, "source": str(d), "base_model": MODEL, "tier": tier} for n, d in dirs.items()]


def loads_logged(engine, name: str) -> int:  # noqa: ANN001
    text = engine.log_path.read_text(errors="replace")
    return len(re.findall(rf"Loaded new LoRA adapter: name '{name}'", text))


def adapters_on(engine) -> set[str]:  # noqa: ANN001
    cards = httpx.get(engine.url + "/v1/models", timeout=10).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


async def chat(h: httpx.AsyncClient, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **extra}
    return await h.post("/v1/chat/completions", json=body)


async def test_on_demand_load_is_single_flight_and_later_requests_stay_with_it(
    engines, adapter_dirs, clean_engines
) -> None:
    before = {e.name: loads_logged(e, "ad1") for e in engines}
    async with running_router(engines.urls, lora_adapters=registered(adapter_dirs)) as (url, router):
        async with http(url) as h:
            listed = {m["id"]: m for m in (await h.get("/v1/models")).json()["data"]}
            assert listed["ad1"]["parent"] == MODEL  # registered, loaded nowhere: listed, not a 404
            results = await asyncio.gather(*(chat(h, "ad1") for _ in range(20)))
            assert [r.status_code for r in results] == [200] * 20, results[0].text
            assert {r.json()["model"] for r in results} == {"ad1"}
            more = [await chat(h, "ad1") for _ in range(10)]
            assert all(r.status_code == 200 for r in more)
        holders = [e for e in engines if "ad1" in adapters_on(e)]
        assert len(holders) == 1  # affinity: one engine has it, nobody loaded it elsewhere
        after = {e.name: loads_logged(e, "ad1") for e in engines}
        assert sum(after.values()) - sum(before.values()) == 1, (before, after)
        assert metric_value(router, "vllm_stack_router_adapter_placements_total", outcome="held") >= 10
        r = await chat(h := http(url), "no-such-adapter")
        await h.aclose()
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_a_full_engine_unloads_its_least_recently_used_adapter(
    engines, adapter_dirs, clean_engines
) -> None:
    engine = engines[0]
    adapters = registered(adapter_dirs, tier="cold")
    async with running_router([engine.url], lora_adapters=adapters) as (url, router), http(url) as h:
        for name in NAMES[:4]:
            assert (await chat(h, name)).status_code == 200
        # vLLM publishes vllm:lora_requests_info (its slot count) from its first request on
        await wait_for(lambda: router.registry.engines()[0].max_loras == 4, what="slots scraped")
        assert adapters_on(engine) == set(NAMES[:4])
        assert (await chat(h, "ad2")).status_code == 200  # ad1 is now the least recently used
        answered, seen = time.monotonic(), router.registry.engines()[0]
        await wait_for(  # a scrape after the last answer: nothing runs or waits there any more
            lambda: (
                (t := seen.fresh_telemetry()) is not None
                and t.scraped_at > answered
                and t.running_adapters == frozenset()
                and t.waiting_adapters == frozenset()
            ),
            what="a scrape with no adapter busy there",
        )
        r = await chat(h, "ad5")
        assert r.status_code == 200, r.text
        assert adapters_on(engine) == {"ad2", "ad3", "ad4", "ad5"}
        assert metric_value(router, "vllm_stack_router_adapter_unloads_total", tier="cold") == 1
        # the unloaded one loads again on demand
        assert (await chat(h, "ad1")).status_code == 200
        assert len(adapters_on(engine)) == 4


async def test_weighted_model_name_splits_1000_requests(engines, adapter_dirs, clean_engines) -> None:
    weighted = {"canary": [{"model": MODEL, "weight": 90}, {"model": "ad1", "weight": 10}]}
    async with (
        running_router(
            engines.urls, lora_adapters=registered({"ad1": adapter_dirs["ad1"]}), weighted_models=weighted
        ) as (url, _),
        http(url) as h,
    ):
        counts: collections.Counter[str] = collections.Counter()
        gate = asyncio.Semaphore(8)

        async def one() -> None:
            async with gate:
                r = await chat(h, "canary")
                assert r.status_code == 200, r.text
                counts[r.json()["model"]] += 1

        await asyncio.gather(*(one() for _ in range(1000)))
    assert sum(counts.values()) == 1000
    assert abs(counts["ad1"] - 100) <= 30, counts  # 10% within 3 points
