"""Sleeping engines against real vLLM engines (CPU build, the session's chat engines, which run with
``VLLM_SERVER_DEV_MODE=1``): what vLLM 0.32's CPU build answers of its sleep endpoints, through the router.

The CPU build refuses ``--enable-sleep-mode`` at start, yet with the development endpoints on it serves
``/sleep``: its scheduler pauses and ``/is_sleeping`` says true, while its CPU worker frees nothing ("sleep
mode is not supported on CPU, ignore it"). So the router's whole round runs on a real engine here (its
state from the engine's own answers and gauge, a request that wakes it), and a refusal (a level vLLM
rejects) comes back with the engine's status and words, never a 500. Each test wakes what it put to
sleep: the engines are shared.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.router.helpers import http, metric_value, running_router, wait_for

pytestmark = pytest.mark.engine

MODEL = "tiny-llama"


@pytest.fixture
def awake_after(engines) -> Iterator[None]:  # noqa: ANN001
    """Wake, after the test, every session engine it may have put to sleep."""
    yield
    for engine in engines:
        httpx.post(engine.url + "/wake_up", timeout=30)


async def test_a_real_engine_sleeps_is_skipped_and_is_woken_by_a_request(engines, awake_after) -> None:  # noqa: ANN001
    async with running_router(engines.urls[:1]) as (url, router):
        engine = router.registry.engines()[0]
        async with http(url) as h:
            r = await h.get("/is_sleeping", params={"id": engine.engine_id})
            assert (r.status_code, r.json()) == (200, {"is_sleeping": False})
            r = await h.post("/sleep", params={"id": engine.engine_id, "level": "1"})
            assert (r.status_code, r.json()) == (200, {"status": "success"}), r.text
            assert (await h.get("/is_sleeping", params={"id": engine.engine_id})).json() == {
                "is_sleeping": True
            }
            assert engine.sleeping and engine.healthy and not router.registry.candidates(MODEL)
            # the real engine's own gauge says so too (the scrape keeps it asleep, not awake)
            await wait_for(
                lambda: engine.telemetry is not None and engine.telemetry.sleep_level == 1,
                within=10,
                what="a scrape of the engine's vllm:engine_sleep_state at level 1",
            )
            assert engine.sleeping
            r = await h.post(
                "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2}, timeout=60
            )
            assert r.status_code == 200, r.text
            assert not engine.sleeping
            assert (await h.get("/is_sleeping", params={"id": engine.engine_id})).json() == {
                "is_sleeping": False
            }
            assert metric_value(router, "vllm_stack_router_engine_wakeups_total", outcome="woken") == 1


async def test_a_real_engines_refusal_comes_back_with_its_status(engines, awake_after) -> None:  # noqa: ANN001
    async with running_router(engines.urls[:1]) as (url, router):
        engine = router.registry.engines()[0]
        async with http(url) as h:
            r = await h.post("/sleep", params={"id": engine.engine_id, "level": "3"})  # vLLM: 0 <= level <= 2
        # the engine's own answer to the same request, whatever status this vLLM gives (0.32: 400)
        async with http(engines[0].url) as d:
            direct = await d.post("/sleep", params={"level": "3"})
        assert direct.status_code >= 400 and r.status_code == direct.status_code, (direct.text, r.text)
        error = r.json()["error"]
        assert (
            error["code"] == "engine_refused" and f"Engine {engine.name} refused /sleep" in error["message"]
        )
        assert not engine.sleeping
