"""Sleeping engines (vLLM's sleep mode, docs/sleep.md): production-stack's /sleep, /wake_up and
/is_sleeping through the router, engine ids as production-stack makes them, a sleeping engine out of the
candidates yet healthy, and a request whose engines all sleep waking one (or refused when waking is off).

The engines are stub engines behind vllm_stack_dev's sleep-mode stand-in (vLLM 0.32's CPU build cannot
sleep: see its docstring); the real CPU engine's answer is tested in tests/router/test_sleep_engines.py.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from vllm_stack_dev.testbed.sleep_mode import SleepModeEngine

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import bounded, client, http, metric_value, running_router, stubs, wait_for
from vllm_stack.engines.circuit import BreakerState
from vllm_stack.engines.engine import engine_id
from vllm_stack.engines.kinds.vllm import parse_metrics


def sleep_calls(engine: SleepModeEngine) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """The sleep and wake-up calls it got (the router also asks /is_sleeping after each)."""
    return [c for c in engine.calls if c[1] != "/is_sleeping"]


def sleepy(name: str) -> tuple[StubEngine, SleepModeEngine]:
    stub = StubEngine(name)
    return stub, SleepModeEngine(stub)


def test_engine_id_is_production_stacks_uuid5_of_the_name() -> None:
    # production-stack's Kubernetes discovery: uuid.uuid5(uuid.NAMESPACE_DNS, pod name)
    pod = "vllm-granite-deployment-vllm-7d9f8b6c5-x2x4q"
    assert engine_id(pod) == str(uuid.uuid5(uuid.NAMESPACE_DNS, pod))
    assert engine_id("10.0.0.1:8000") == "8cf609b8-d039-53c8-a46e-4eab68648684"  # static: host:port


def test_scrape_reads_vllms_sleep_gauge() -> None:
    base = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
    gauge = 'vllm:engine_sleep_state{{engine="0",model_name="m",sleep_state="{}"}} {}\n'
    awake = base + gauge.format("awake", 1.0) + gauge.format("weights_offloaded", 0.0)
    level2 = base + gauge.format("awake", 0.0) + gauge.format("discard_all", 1.0)
    assert parse_metrics(awake).sleep_level == 0
    assert parse_metrics(level2).sleep_level == 2
    assert parse_metrics(base).sleep_level is None  # not published: unknown, the state is left as it is


async def test_sleep_wake_and_ask_through_the_router() -> None:
    (a, sa), (b, sb) = sleepy("a"), sleepy("b")
    async with stubs(sa, sb) as urls, running_router(urls) as (url, router):
        ea = next(e for e in router.registry.engines() if e.url == urls[0])
        async with http(url) as h:
            listed = (await h.get("/engines")).json()["engines"]
            assert {e["engine_id"] for e in listed} == {engine_id(e["name"]) for e in listed}
            assert (await h.get("/is_sleeping", params={"id": ea.engine_id})).json() == {"is_sleeping": False}

            r = await h.post(f"/sleep?id={ea.engine_id}&level=2&mode=wait")
            assert (r.status_code, r.json()) == (200, {"status": "success"})
            assert sleep_calls(sa)[-1] == (
                "POST",
                "/sleep",
                [("level", "2"), ("mode", "wait")],
            )  # id is the router's
            # applied from the call's answer at once, not at the next scrape
            assert ea.sleeping and ea.sleep_level == 2
            assert ea not in router.registry.candidates("stub-model")
            assert ea.healthy and ea.breaker.state is BreakerState.CLOSED  # asleep is not unhealthy
            assert metric_value(router, "vllm_stack_router_engines_sleeping") == 1
            assert (
                metric_value(router, "vllm_stack_router_engine_healthy", engine=ea.name, model="stub-model")
                == 1
            )
            assert (await h.get("/is_sleeping", params={"id": ea.engine_id})).json() == {"is_sleeping": True}
            shown = next(e for e in (await h.get("/engines")).json()["engines"] if e["name"] == ea.name)
            assert (shown["sleeping"], shown["sleep_level"], shown["healthy"]) == (True, 2, True)
            assert [m["id"] for m in (await h.get("/v1/models")).json()["data"]] == ["stub-model"]

            c = client(url)
            for _ in range(4):
                await c.chat.completions.create(
                    model="stub-model", messages=[{"role": "user", "content": "x"}]
                )
            assert (a.completed, b.completed) == (0, 4)  # none to the sleeping engine

            r = await h.post(f"/wake_up?id={ea.engine_id}&tags=weights&tags=kv_cache")
            assert (r.status_code, r.json()) == (200, {"status": "success"})
            assert sleep_calls(sa)[-1] == ("POST", "/wake_up", [("tags", "weights"), ("tags", "kv_cache")])
            assert not ea.sleeping and ea in router.registry.candidates("stub-model")
            assert metric_value(router, "vllm_stack_router_engines_sleeping") == 0


async def test_an_engine_asleep_behind_the_routers_back_leaves_the_candidates_at_its_scrape() -> None:
    (_, sa), (_, sb) = sleepy("a"), sleepy("b")
    async with stubs(sa, sb) as urls, running_router(urls) as (_, router):
        ea = next(e for e in router.registry.engines() if e.url == urls[0])
        sa.sleep_now(1)
        await wait_for(lambda: ea.sleeping, what="the scrape to see engine a asleep")
        assert ea not in router.registry.candidates("stub-model") and ea.healthy
        sa.wake_now()
        await wait_for(lambda: not ea.sleeping, what="the scrape to see engine a awake")
        assert ea in router.registry.candidates("stub-model")


async def test_a_request_whose_engines_all_sleep_wakes_one_and_is_served() -> None:
    stub, sa = sleepy("a")
    async with stubs(sa) as urls, running_router(urls) as (url, router):
        engine = router.registry.engines()[0]
        async with http(url) as h:
            assert (await h.post(f"/sleep?id={engine.engine_id}")).status_code == 200
        answer = await bounded(
            client(url).chat.completions.create(
                model="stub-model", messages=[{"role": "user", "content": "x"}]
            ),
            10,
            "the request that wakes the sleeping engine",
        )
        assert answer.choices and stub.completed == 1
        assert not sa.sleeping and not engine.sleeping
        assert ("POST", "/wake_up", []) in sa.calls
        assert metric_value(router, "vllm_stack_router_engine_wakeups_total", outcome="woken") == 1


async def test_with_waking_off_a_request_whose_engines_all_sleep_is_refused_clearly() -> None:
    stub, sa = sleepy("a")
    async with stubs(sa) as urls, running_router(urls, wake_sleeping_engines=False) as (url, router):
        engine = router.registry.engines()[0]
        async with http(url) as h:
            assert (await h.post(f"/sleep?id={engine.engine_id}")).status_code == 200
            r = await h.post("/v1/completions", json={"model": "stub-model", "prompt": "x"})
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "engine_sleeping" and "/wake_up?id=" in error["message"]
        assert sa.sleeping and stub.completed == 0 and ("POST", "/wake_up", []) not in sa.calls


def without_dev_mode(stub: StubEngine) -> Callable[..., Awaitable[None]]:
    """``stub`` answering the sleep paths as vLLM's server does without ``VLLM_SERVER_DEV_MODE``: 404."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:  # noqa: ANN401
        if scope["type"] == "http" and scope["path"] in ("/sleep", "/wake_up", "/is_sleeping"):
            body = b'{"detail":"Not Found"}'
            await send(
                {
                    "type": "http.response.start",
                    "status": 404,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await stub(scope, receive, send)

    return app


async def test_ids_are_checked_and_an_engines_refusal_comes_back_with_its_status() -> None:
    async with stubs(without_dev_mode(StubEngine("plain"))) as urls, running_router(urls) as (url, router):
        engine = router.registry.engines()[0]
        async with http(url) as h:
            r = await h.post("/sleep")
            assert (
                r.status_code == 400
                and r.json()["error"]["message"] == "Invalid request: missing target Engine Id."
            )
            r = await h.post("/sleep?id=nope")
            assert r.status_code == 400 and r.json()["error"]["message"] == "Engine with Id nope not found."
            r = await h.post(f"/sleep?id={engine.engine_id}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "engine_refused"
            assert "VLLM_SERVER_DEV_MODE" in r.json()["error"]["message"]
            assert not engine.sleeping


async def test_admin_key_with_admin_keys_client_key_with_client_keys_open_without_keys() -> None:
    _, sa = sleepy("a")
    env = {"VLLM_STACK_ADMIN_API_KEYS": "admin-key", "VLLM_STACK_API_KEYS": "client-key"}
    async with stubs(sa) as urls, running_router(urls, environ=env) as (url, router):
        engine = router.registry.engines()[0]
        async with http(url) as h:
            for key in (None, "client-key"):
                headers = {"authorization": f"Bearer {key}"} if key else {}
                r = await h.get(f"/is_sleeping?id={engine.engine_id}", headers=headers)
                assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
            r = await h.get(
                f"/is_sleeping?id={engine.engine_id}", headers={"authorization": "Bearer admin-key"}
            )
            assert r.status_code == 200
    async with stubs(sa) as urls, running_router(urls, environ={"VLLM_STACK_API_KEYS": "k"}) as (url, router):
        engine = router.registry.engines()[0]
        async with http(url) as h:  # client keys, no admin keys: a client key, as every other route
            for method, path in (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
                r = await h.request(method, f"{path}?id={engine.engine_id}")
                assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_key"), path
            assert sleep_calls(sa) == []
            keyed = {"authorization": "Bearer k"}
            assert (await h.post(f"/sleep?id={engine.engine_id}", headers=keyed)).status_code == 200
            assert (await h.post(f"/wake_up?id={engine.engine_id}", headers=keyed)).status_code == 200
    async with stubs(sa) as urls, running_router(urls) as (url, router):
        engine = router.registry.engines()[0]
        async with http(url) as h:  # no keys at all: open, as production-stack's
            assert (await h.post(f"/sleep?id={engine.engine_id}")).status_code == 200
            assert (await h.post(f"/wake_up?id={engine.engine_id}")).status_code == 200


async def test_waking_is_one_call_per_engine_for_many_waiting_requests() -> None:
    stub, sa = sleepy("a")
    async with stubs(sa) as urls, running_router(urls) as (url, router):
        engine = router.registry.engines()[0]
        sa.sleep_now(1)
        await wait_for(lambda: engine.sleeping, what="the scrape to see the engine asleep")
        c = client(url)
        answers = await bounded(
            asyncio.gather(*(c.completions.create(model="stub-model", prompt="x") for _ in range(5))),
            10,
            "five requests waiting for one wake-up",
        )
        assert len(answers) == 5 and stub.completed == 5
        assert [c for c in sleep_calls(sa) if c[1] == "/wake_up"] == [("POST", "/wake_up", [])]


async def test_with_the_queue_off_nothing_can_wait_for_a_wake_up_and_the_error_says_so() -> None:
    stub, sa = sleepy("a")
    async with stubs(sa) as urls, running_router(urls, queue_max_per_model=0) as (url, router):
        engine = router.registry.engines()[0]
        async with http(url) as h:
            assert (await h.post(f"/sleep?id={engine.engine_id}")).status_code == 200
            r = await h.post("/v1/completions", json={"model": "stub-model", "prompt": "x"})
        assert r.status_code == 503
        error = r.json()["error"]
        assert error["code"] == "engine_sleeping" and "queue is off" in error["message"]
        assert stub.completed == 0


async def test_a_level_that_is_not_a_number_is_400_and_one_vllm_lacks_is_never_noted() -> None:
    _, sa = sleepy("a")
    async with stubs(sa) as urls, running_router(urls) as (url, router):
        engine = router.registry.engines()[0]
        async with http(url) as h:
            for raw in ("%C2%B2", "", "1.5", "-1"):  # "²" passes str.isdigit, then int() raised: a 502
                r = await h.post(f"/sleep?id={engine.engine_id}&level={raw}")
                assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_sleep_level"), raw
            assert sleep_calls(sa) == []  # refused by the router, nothing sent
            r = await h.post(f"/sleep?id={engine.engine_id}&level=99999")  # vLLM's own refusal, passed back
            assert (r.status_code, r.json()["error"]["code"]) == (422, "engine_refused")
            assert (engine.sleeping, engine.sleep_level) == (False, 0)


async def test_with_waking_off_a_configured_model_is_refused_at_once_not_queued() -> None:
    """The chart lists every modelSpec in ``models``; such a model still gets the immediate 503, not
    the queue's timeout (60 s) for an engine nothing wakes."""
    stub, sa = sleepy("a")
    settings = {"wake_sleeping_engines": False, "models": ["stub-model"]}
    async with stubs(sa) as urls, running_router(urls, **settings) as (url, router):
        engine = router.registry.engines()[0]
        async with http(url) as h:
            assert (await h.post(f"/sleep?id={engine.engine_id}")).status_code == 200
            r = await bounded(
                h.post("/v1/completions", json={"model": "stub-model", "prompt": "x"}),
                5,
                "the immediate 503 for a configured model whose engines all sleep",
            )
        assert (r.status_code, r.json()["error"]["code"]) == (503, "engine_sleeping")
        assert sa.sleeping and stub.completed == 0


def failing_wake_up(engine: SleepModeEngine, calls: list[str]) -> Callable[..., Awaitable[None]]:
    """``engine`` whose ``/wake_up`` fails (500), each call noted in ``calls``."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:  # noqa: ANN401
        if scope["type"] == "http" and scope["path"] == "/wake_up":
            calls.append(scope["path"])
            await send({"type": "http.response.start", "status": 500, "headers": []})
            await send({"type": "http.response.body", "body": b"cannot wake"})
            return
        await engine(scope, receive, send)

    return app


async def test_a_failed_wake_up_is_tried_again_at_most_once_per_retry_interval() -> None:
    _, sa = sleepy("a")
    calls: list[str] = []
    async with (
        stubs(failing_wake_up(sa, calls)) as urls,
        running_router(urls, queue_timeout=0.2) as (url, router),
    ):
        engine = router.registry.engines()[0]
        async with http(url) as h:
            assert (await h.post(f"/sleep?id={engine.engine_id}")).status_code == 200
            for _ in range(3):  # each waits for a wake-up that failed: the queue's timeout answers it
                r = await h.post("/v1/completions", json={"model": "stub-model", "prompt": "x"})
                assert (r.status_code, r.json()["error"]["code"]) == (503, "queue_timeout")
            assert calls == ["/wake_up"]  # one call, not one per request
            assert metric_value(router, "vllm_stack_router_engine_wakeups_total", outcome="failed") == 1
            router.sleep.retry_after = 0.0  # the interval over: the next request tries again
            r = await h.post("/v1/completions", json={"model": "stub-model", "prompt": "x"})
            assert r.status_code == 503 and len(calls) >= 2
