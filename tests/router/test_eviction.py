"""Eviction of in-flight sheddable requests (vllm_stack.director.eviction): which request is chosen,
never a standard or critical one, only while every engine is full, off by default; then the whole path
over stub engines (a started stream ends with an error event, a non-streamed one gets 503 with the
reason header). On a real engine (its slot freed): test_eviction_engines.py."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import metric_value, running_router, stubs, wait_for
from vllm_stack.config import load_config
from vllm_stack.director.eviction import Evictor, choose
from vllm_stack.engines.circuit import CircuitBreaker
from vllm_stack.engines.engine import Engine, EngineTelemetry
from vllm_stack.metrics import RouterMetrics
from vllm_stack.tenants.declaration import TenantTable

BASE = "stub-model"


def engine(name: str, waiting: float, age: float = 0.0) -> Engine:
    e = Engine(name, f"http://{name}", CircuitBreaker(), stale_after=3.0)
    e.telemetry = EngineTelemetry(
        running=4, waiting=waiting, kv_cache_usage=0.1, prefix_cache_queries=None, prefix_cache_hits=None,
        scraped_at=time.monotonic() - age, in_flight=0,
    )  # fmt: skip
    return e


class Req:
    """An in-flight request as eviction sees it."""

    def __init__(self, name: str, priority: int, on: Engine | None, begun: bool = True) -> None:
        self.name = name
        self._priority = priority
        self.on = on
        self.begun = begun
        self.evicted = False
        self.tenant = "batch-team"  # undeclared: counted as "other"

    @property
    def priority(self) -> int:
        return self._priority

    def eviction_engine(self) -> Engine | None:
        return self.on

    def answer_begun(self) -> bool:
        return self.begun

    def evict(self, message: str) -> bool:
        self.evicted = True
        self.on = None
        return True


class Registry:
    def __init__(self, engines: list[Engine]) -> None:
        self.engines = tuple(engines)

    def candidates(self, model: str) -> tuple[Engine, ...]:
        return self.engines


def test_the_youngest_with_its_answer_begun_is_chosen_on_the_critical_requests_engine() -> None:
    a, b = engine("a", 1), engine("b", 1)
    old, mid, young_waiting, young_b = (
        Req("old", -1, a),
        Req("mid", -1, a),
        Req("young-not-begun", -1, a, begun=False),
        Req("young-on-b", -1, b),
    )
    order = [old, mid, young_waiting, young_b]  # the order their legs started
    assert choose(order, a) is mid  # begun beats younger-but-waiting; b's is not on a
    assert choose(order, None) is young_b  # from the router's queue: any engine
    assert choose([old, young_waiting], b) is None
    assert choose([young_waiting], a) is young_waiting  # none begun: the youngest of the rest


def test_never_a_standard_or_critical_request() -> None:
    a = engine("a", 1)
    assert choose([Req("std", 0, a), Req("crit", 5, a)], a) is None
    assert choose([Req("shed", -1, a), Req("std", 0, a), Req("crit", 5, a)], a).name == "shed"


def test_one_is_evicted_per_waiting_critical_request_and_only_when_every_engine_is_full() -> None:
    a, b = engine("a", 1), engine("b", 0)
    metrics = RouterMetrics()
    evictor = Evictor(Registry([a, b]), metrics, TenantTable)  # type: ignore[arg-type]
    first, second = Req("first", -1, a), Req("second", -1, a)
    evictor.track("m", first)
    evictor.track("m", second)
    assert not evictor.for_waiting("m", a, waited=5.0, after=2.0)  # b has room: nothing evicted
    b.telemetry = engine("b", 2).telemetry
    assert not evictor.for_waiting("m", a, waited=1.0, after=2.0)  # not waited long enough
    assert not evictor.for_waiting("other", a, waited=5.0, after=2.0)  # no sheddable work there
    assert evictor.for_waiting("m", a, waited=5.0, after=2.0)
    assert (first.evicted, second.evicted) == (False, True)  # one, the youngest
    evictor.forget("m", second)
    assert evictor.tracked("m") == 1
    sample = metrics.registry.get_sample_value
    assert sample("vllm_stack_router_tenant_rejections_total", {"tenant": "other", "reason": "evicted"}) == 1
    stale = engine("b", 2, age=10.0)  # figures unknown: not full, nothing evicted on a guess
    evictor.registry = Registry([a, stale])  # type: ignore[assignment]
    assert not evictor.for_waiting("m", a, waited=5.0, after=2.0) and not first.evicted


def test_eviction_is_off_by_default() -> None:
    config = load_config({"static_backends": "http://e:8000"})
    assert config.eviction_enabled is False and config.eviction_after == 2.0


CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60}


async def _eviction_scene(eviction: bool, stream: bool) -> tuple[list[str], httpx.Response | None, dict]:
    """One stub engine that streams slowly; a sheddable request in flight (streamed or not), then the
    engine reported full and a streamed critical request held there past ``eviction_after``. Returns
    the sheddable request's SSE lines (or its response), and facts."""
    stub = StubEngine("a", [BASE])
    stub.behaviour.token_delay_s = 0.1
    settings = {"models": [{"name": BASE, "criticality": "critical"}], "engine_scrape_interval": 0.2}
    if eviction:
        settings |= {"eviction_enabled": True, "eviction_after": 0.5}
    async with stubs(stub) as urls, running_router(urls, **settings) as (url, router):
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            shed_lines: list[str] = []
            shed_response: list[httpx.Response] = []

            async def sheddable() -> None:
                headers = {"x-request-priority": "sheddable"}
                if stream:
                    async with client.stream(
                        "POST", "/v1/chat/completions", json=CHAT | {"stream": True}, headers=headers
                    ) as r:
                        async for line in r.aiter_lines():
                            if line:
                                shed_lines.append(line)
                else:
                    shed_response.append(
                        await client.post("/v1/chat/completions", json=CHAT, headers=headers)
                    )

            if not stream:  # a non-streamed answer is held by the engine until it is whole
                stub.behaviour.delay_s = 6.0
            shed = asyncio.create_task(sheddable())
            await wait_for(lambda: stub.running == 1, what="the sheddable request running on the stub")
            if stream:
                await wait_for(lambda: len(shed_lines) >= 2, what="the sheddable stream's first events")
            stub.waiting = 3  # the engine is full: requests wait there
            stub.behaviour.delay_s = 3.0  # the critical request waits for its first token
            engine_ = router.registry.engines()[0]
            await wait_for(
                lambda: (t := engine_.fresh_telemetry()) is not None and t.waiting == 3,
                what="the full engine scraped",
            )
            crit = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "stream": True})
            await asyncio.wait_for(shed, 30)
            facts = {
                "critical_status": crit.status_code,
                "evicted": metric_value(
                    router, "vllm_stack_router_tenant_rejections_total", tenant="default", reason="evicted"
                ),
                "tracked": router.director.evictor.tracked(BASE),
                "stub_running": stub.running,
            }
            return shed_lines, (shed_response[0] if shed_response else None), facts


async def test_a_started_stream_is_ended_with_an_error_event_and_the_critical_request_is_served() -> None:
    lines, _, facts = await _eviction_scene(eviction=True, stream=True)
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert error["code"] == "evicted" and "evicted" in error["message"]
    assert "data: [DONE]" not in lines  # the error event ends the stream (as a broken stream's does)
    assert facts["critical_status"] == 200 and facts["evicted"] == 1 and facts["tracked"] == 0


async def test_a_non_streamed_sheddable_request_is_answered_503_with_the_reason_header() -> None:
    _, response, facts = await _eviction_scene(eviction=True, stream=False)
    assert response is not None and response.status_code == 503
    assert response.headers["x-llm-d-request-dropped-reason"] == "evicted"
    assert response.headers["retry-after"] == "1"
    assert response.json()["error"]["code"] == "evicted"
    assert facts["critical_status"] == 200 and facts["evicted"] == 1


async def test_with_eviction_off_the_sheddable_stream_runs_to_its_end() -> None:
    lines, _, facts = await _eviction_scene(eviction=False, stream=True)
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    assert facts["critical_status"] == 200 and facts["evicted"] == 0 and facts["tracked"] == 0
