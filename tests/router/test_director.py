"""The director and the plugin framework through the router's public surfaces: a YAML ``scheduling``
section, a plugin registry given to ``build_router``, HTTP requests to stub engines (uvicorn apps that
speak the engine's HTTP API; no vLLM needed for what is tested here), ``/engines`` and the metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import FAST, http, logged, running_router, serving, stubs, wait_for
from vllm_stack.app import build_router
from vllm_stack.config import ConfigError
from vllm_stack.engines.engine import Engine
from vllm_stack.errors import ERROR_MARKER
from vllm_stack.scheduling.framework import RequestContext, Role
from vllm_stack.scheduling.plugins import builtin_registry
from vllm_stack.scheduling.registry import Parameters, PluginContext, PluginRegistry

MSG = [{"role": "user", "content": "hi"}]
BODY = {"model": "stub-model", "messages": MSG, "max_tokens": 2}


# ---- plugins defined here, outside the package: a new strategy is one class and its registration ------
class LastEnginePicker:
    """Picks the candidate whose name sorts last: a strategy no built-in has."""

    type_name = "test-last-engine-picker"
    roles = (Role.PICKER,)

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> LastEnginePicker:
        return cls(name)

    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]:
        return max(engines, key=lambda e: e.name), "last_engine"


class RequestIndex:
    """Reload-proof state: requests seen per engine (drops an engine that leaves)."""

    def __init__(self) -> None:
        self.by_engine: dict[str, int] = {}

    def forget_engine(self, name: str) -> None:
        self.by_engine.pop(name, None)


class IndexingTracker:
    """A response-complete plugin keeping its counts in the router's plugin state."""

    type_name = "test-indexing-tracker"
    roles = (Role.RESPONSE_COMPLETE,)

    def __init__(self, name: str, index: RequestIndex) -> None:
        self.name = name
        self.index = index

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> IndexingTracker:
        return cls(name, context.state.get((cls.type_name, name), RequestIndex))

    def response_complete(self, ctx: RequestContext, completion: Any) -> None:  # noqa: ANN401
        if completion.engine is not None:
            by = self.index.by_engine
            by[completion.engine.name] = by.get(completion.engine.name, 0) + 1


class ContextRecorder:
    """A response-complete hook keeping the request contexts it is told of."""

    type_name = "test-context-recorder"
    roles = (Role.RESPONSE_COMPLETE,)
    seen: list[RequestContext] = []  # noqa: RUF012 - the test reads what the hook saw

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> ContextRecorder:
        return cls(name)

    def response_complete(self, ctx: RequestContext, completion: Any) -> None:  # noqa: ANN401
        ContextRecorder.seen.append(ctx)


class PromptLengthScorer:
    """Reads what the ``prompt-length`` prepare-data plugin left in the cycle state."""

    type_name = "test-prompt-length-scorer"
    roles = (Role.SCORER,)
    seen: list[int] = []  # noqa: RUF012 - the test reads what the scorer saw

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> PromptLengthScorer:
        return cls(name)

    def score(self, ctx: RequestContext, engines: Sequence[Engine]) -> list[float]:
        PromptLengthScorer.seen.append(ctx.cycle["prompt-length"])
        return [1.0] * len(engines)


class GatedPreRequest:
    """An asynchronous pre-request hook: the request waits on a future the test controls."""

    type_name = "test-gated-pre-request"
    roles = (Role.PRE_REQUEST,)

    def __init__(self, name: str) -> None:
        self.name = name
        self.futures: list[asyncio.Future[None]] = []

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> GatedPreRequest:
        return cls(name)

    def pre_request(self, ctx: RequestContext, engine: Engine) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.futures.append(future)
        return future


def registry_with(*plugins: type) -> PluginRegistry:
    registry = builtin_registry()
    for plugin in plugins:
        registry.register(plugin)
    return registry


def scheduling(*plugins: dict[str, Any], profile: list[Any]) -> dict[str, Any]:
    return {"plugins": list(plugins), "schedulingProfiles": [{"name": "custom", "plugins": profile}]}


def write_config(path: Path, backends: Sequence[str], sched: dict[str, Any], **extra: Any) -> str:
    path.write_text(yaml.safe_dump({"static-backends": list(backends), "scheduling": sched, **extra}))
    return str(path)


@contextlib.asynccontextmanager
async def router_from(path: str, plugins: PluginRegistry, healthy: int):  # noqa: ANN201
    router = build_router(FAST, path, environ={}, plugins=plugins)
    async with serving(router) as url:
        await wait_for(lambda: router.registry.healthy_count >= healthy, what="healthy engines")
        yield url, router


# ---- tests -------------------------------------------------------------------------------------------------
async def test_a_plugin_registered_by_the_test_suite_routes_requests(tmp_path: Path) -> None:
    a, b = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    async with stubs(a, b) as urls:
        sched = scheduling(
            {"type": "circuit-breaker-filter"},
            {"name": "last", "type": "test-last-engine-picker"},
            profile=[{"pluginRef": "circuit-breaker-filter"}, {"pluginRef": "last"}],
        )
        path = write_config(tmp_path / "r.yaml", urls, sched)
        async with router_from(path, registry_with(LastEnginePicker), 2) as (url, router), http(url) as h:
            last = max(router.registry.engines(), key=lambda e: e.name)
            for _ in range(5):
                r = await h.post("/v1/chat/completions", json=BODY)
                assert r.status_code == 200
            expected = a if last.url.rstrip("/") == urls[0].rstrip("/") else b
            assert len(expected.seen) == 5
            doc = (await h.get("/engines")).json()
            assert doc["scheduling"]["profiles"]["custom"]["picker"] == "last"
            assert doc["scheduling"]["plugins"]["last"] == "test-last-engine-picker"


def test_configuration_errors_name_the_problem(tmp_path: Path) -> None:
    cases = [
        (scheduling({"type": "no-such-type"}, profile=["no-such-type"]), "unknown type 'no-such-type'"),
        (scheduling({"type": "round-robin-picker"}, profile=["missing"]), "no plugin named 'missing'"),
        (
            scheduling(
                {"type": "max-score-picker", "parameters": {"reasn": "x"}}, profile=["max-score-picker"]
            ),
            "unknown parameters",
        ),
        (
            scheduling(
                {"type": "round-robin-picker"},
                {"type": "random-picker"},
                profile=["round-robin-picker", "random-picker"],
            ),
            "more than one picker",
        ),
        ({"plugins": [{"type": "round-robin-picker"}]}, "schedulingProfiles"),
    ]
    for i, (sched, message) in enumerate(cases):
        path = write_config(tmp_path / f"r{i}.yaml", ["http://127.0.0.1:9"], sched)
        with pytest.raises(ConfigError, match=message):
            build_router(FAST, path, environ={})
    with pytest.raises(ConfigError, match="routing_logic must be one of"):
        build_router({**FAST, "static_backends": "http://127.0.0.1:9", "routing_logic": "nope"}, environ={})


async def test_plugin_state_survives_a_reload_and_goes_with_its_plugin_or_engine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    async with stubs(a, b) as urls:
        tracked = scheduling(
            {"type": "circuit-breaker-filter"},
            {"type": "round-robin-picker"},
            {"name": "idx", "type": "test-indexing-tracker"},
            profile=["circuit-breaker-filter", "round-robin-picker"],
        )
        path = write_config(tmp_path / "r.yaml", urls, tracked)
        async with router_from(path, registry_with(IndexingTracker), 2) as (url, router), http(url) as h:
            for _ in range(3):
                assert (await h.post("/v1/chat/completions", json=BODY)).status_code == 200
            old_scheduler = router.scheduler
            state = router.plugin_state.get(("test-indexing-tracker", "idx"), RequestIndex)
            assert sum(state.by_engine.values()) == 3
            # A reload (another setting changes): every plugin is rebuilt, the index carries over.
            write_config(tmp_path / "r.yaml", urls, tracked, retries=1)
            await wait_for(
                lambda: router.config.retries == 1 and router.scheduler is not old_scheduler, what="reload"
            )
            assert (await h.post("/v1/chat/completions", json=BODY)).status_code == 200
            assert router.plugin_state.get(("test-indexing-tracker", "idx"), RequestIndex) is state
            assert sum(state.by_engine.values()) == 4
            # The rotation went on across the reload (its position is plugin state too): 2 + 2, where
            # a rotation restarted at the first engine would have made it 3 + 1.
            assert sorted((len(a.seen), len(b.seen))) == [2, 2]
            # An engine that leaves is purged from every plugin's state.
            write_config(tmp_path / "r.yaml", urls[:1], tracked, retries=1)
            await wait_for(lambda: len(router.registry.engines()) == 1, what="engine b gone")
            assert set(state.by_engine) == {router.registry.engines()[0].name}
            # A reload without the plugin drops its state; a rejected reload keeps everything.
            bad = scheduling({"type": "no-such-type"}, profile=["no-such-type"])
            write_config(tmp_path / "r.yaml", urls[:1], bad, retries=1)
            await wait_for(logged(caplog, "config reload rejected"), what="the bad reload rejected")
            assert ("test-indexing-tracker", "idx") in set(router.plugin_state)
            write_config(tmp_path / "r.yaml", urls[:1], None, retries=0)
            await wait_for(lambda: router.config.retries == 0, what="reload without the tracker")
            assert ("test-indexing-tracker", "idx") not in set(router.plugin_state)


async def test_each_reason_for_no_engine_is_one_error() -> None:
    """no candidate -> 503; all filtered (breakers open) -> 503; all saturated -> 429 for a sheddable
    request, a wait in the queue and 429 queue_timeout for a standard one (its model has an engine: it
    was busy), with llm-d's dropped-reason header; all with the marker."""
    a = StubEngine("a", ["stub-model"])
    async with stubs(a) as urls:
        sched = scheduling(
            {"type": "circuit-breaker-filter"},
            {"type": "saturation-filter", "parameters": {"max_waiting": 4}},
            {"type": "round-robin-picker"},
            profile=["circuit-breaker-filter", "saturation-filter", "round-robin-picker"],
        )
        async with (
            running_router(urls, scheduling=sched, retries=0, queue_timeout=1) as (url, router),
            http(url) as h,
        ):
            assert (await h.post("/v1/chat/completions", json=BODY)).status_code == 200
            a.waiting = 9  # the engine's own queue, scraped every 0.2 s
            engine = router.registry.engines()[0]
            await wait_for(
                lambda: (t := engine.fresh_telemetry()) is not None and t.waiting == 9, what="scrape"
            )
            r = await h.post("/v1/chat/completions", json=BODY, headers={"x-request-priority": "sheddable"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "engines_saturated"
            assert r.headers["retry-after"] == "1" and r.headers[ERROR_MARKER.decode()] == "engines_saturated"
            r = await h.post("/v1/chat/completions", json=BODY)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"
            assert r.headers["retry-after"] == "1" and r.headers[ERROR_MARKER.decode()] == "queue_timeout"
            assert r.headers["x-llm-d-request-dropped-reason"] == "queue_timeout"
            a.waiting = 0
            await wait_for(lambda: engine.fresh_telemetry().waiting == 0, what="scrape")
            for _ in range(10):
                engine.breaker.failure()
            r = await h.post("/v1/chat/completions", json=BODY)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_engine"
            a.healthy = False
            await wait_for(lambda: router.registry.healthy_count == 0, what="engine unhealthy")
            r = await h.post("/v1/chat/completions", json=BODY)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_engine"
            assert r.headers["retry-after"] == "1"
        decisions = router.metrics.registry.get_sample_value
        for reason in ("all_saturated", "all_filtered", "no_candidate"):
            assert decisions(
                "vllm_stack_router_routing_decisions_total", {"strategy": "custom", "reason": reason}
            ), reason


async def test_admission_pre_request_and_response_complete_hooks() -> None:
    """The built-in examples: max-in-flight-admission, upstream-headers, request-tracker."""
    a = StubEngine("a", ["stub-model"])
    a.behaviour.token_delay_s = 0.05
    async with stubs(a) as urls:
        sched = scheduling(
            {"type": "circuit-breaker-filter"},
            {"type": "max-in-flight-admission", "parameters": {"per_engine": 1}},
            {
                "type": "upstream-headers",
                "parameters": {"headers": {"x-team": "blue"}, "engine_header": "x-routed-to"},
            },
            {"type": "request-tracker"},
            profile=["circuit-breaker-filter"],
        )
        router = build_router({**FAST, "static_backends": urls[0], "scheduling": sched}, environ={})
        async with serving(router) as url, http(url) as h:
            await wait_for(lambda: router.registry.healthy_count == 1, what="healthy engine")
            engine = router.registry.engines()[0]
            body = {**BODY, "stream": True, "max_tokens": 20}
            async with h.stream("POST", "/v1/chat/completions", json=body) as slow:
                assert slow.status_code == 200
                # admission: one request in flight per engine is the limit
                r = await h.post("/v1/chat/completions", json=BODY)
                assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
                assert r.headers["retry-after"] == "1"
                _ = [line async for line in slow.aiter_lines()]
            r = await h.post("/v1/chat/completions", json=BODY)
            assert r.status_code == 200
            # pre-request: the engine received the plugin's headers, naming itself
            seen = a.seen[-1].headers
            assert seen["x-team"] == "blue" and seen["x-routed-to"] == engine.name
            # response-complete: the tracker counted the two answered requests (not the refused one)
            await wait_for(lambda: engine.completions.completed == 2, what="tracked completions")
            doc = (await h.get("/engines")).json()["engines"][0]["completions"]
            assert doc["completed"] == 2 and doc["ttft_seconds"] is not None and doc["duration_seconds"] > 0


async def test_prepare_data_reaches_the_scorers() -> None:
    """The built-in prompt-length plugin leaves the body's size in the cycle state for a scorer."""
    a, b = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    PromptLengthScorer.seen.clear()
    async with stubs(a, b) as urls:
        sched = scheduling(
            {"type": "prompt-length"},
            {"type": "test-prompt-length-scorer"},
            profile=["test-prompt-length-scorer"],
        )
        router = build_router(
            {**FAST, "static_backends": ",".join(urls), "scheduling": sched},
            environ={},
            plugins=registry_with(PromptLengthScorer),
        )
        async with serving(router) as url, http(url) as h:
            await wait_for(lambda: router.registry.healthy_count == 2, what="healthy engines")
            content = httpx.Request("POST", "/", json=BODY).content
            assert (await h.post("/v1/chat/completions", content=content)).status_code == 200
            assert PromptLengthScorer.seen == [len(content)]


async def test_an_awaiting_stage_resumes_and_a_client_leaving_cancels_it() -> None:
    a = StubEngine("a", ["stub-model"])
    async with stubs(a) as urls:
        sched = scheduling(
            {"type": "round-robin-picker"},
            {"name": "gate", "type": "test-gated-pre-request"},
            profile=["round-robin-picker"],
        )
        router = build_router(
            {**FAST, "static_backends": urls[0], "scheduling": sched},
            environ={},
            plugins=registry_with(GatedPreRequest),
        )
        async with serving(router) as url, http(url) as h:
            await wait_for(lambda: router.registry.healthy_count == 1, what="healthy engine")
            gate = router._scheduling.plugins["gate"]  # noqa: SLF001 - the test's own plugin instance
            engine = router.registry.engines()[0]
            # 1. the request waits on the hook's future, then goes on when it resolves
            task = asyncio.ensure_future(h.post("/v1/chat/completions", json=BODY))
            await wait_for(lambda: len(gate.futures) == 1, what="hook called")
            # Nothing may happen while the future is pending; 0.2 s is many times what a request takes
            # to reach the stub in this loop (a few ms), so a director that did not wait would have sent it.
            await asyncio.sleep(0.2)
            assert not task.done() and not a.seen and engine.in_flight == 1
            gate.futures[0].set_result(None)
            assert (await task).status_code == 200 and len(a.seen) == 1
            # 2. the client leaves while the hook is pending: the future is cancelled, nothing is sent
            reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
            payload = httpx.Request("POST", "/", json=BODY).content
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(payload), payload)
            )
            await writer.drain()
            await wait_for(lambda: len(gate.futures) == 2, what="hook called again")
            writer.close()
            await wait_for(lambda: gate.futures[1].cancelled(), what="the hook's future cancelled")
            await wait_for(lambda: engine.in_flight == 0, what="in-flight settled")
            assert len(a.seen) == 1 and engine.breaker.available()


async def test_the_prefill_a_picker_books_is_released_at_the_first_token_or_the_end() -> None:
    """``prefixaware`` books each request's uncached prompt tokens on its engine
    (``Engine.prefill_tokens``, the work its cost weighs); the director releases them when the first
    streamed token arrives, when a plain answer ends, and when the client leaves before either."""
    a = StubEngine("a", ["stub-model"])
    a.behaviour.delay_s = 0.4
    a.behaviour.token_delay_s = 0.1
    content = [{"role": "user", "content": "a prompt long enough for several blocks " * 40}]
    body = {"model": "stub-model", "messages": content, "max_tokens": 4}
    async with stubs(a) as urls:
        router = build_router(
            {**FAST, "static_backends": urls[0], "routing_logic": "prefixaware"}, environ={}
        )
        async with serving(router) as url, http(url) as h:
            await wait_for(lambda: router.registry.healthy_count == 1, what="healthy engine")
            engine = router.registry.engines()[0]

            # 1. streamed: booked until the first token, released while the answer goes on
            async def first_event() -> None:
                async with h.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                    lines = r.aiter_lines()
                    while not (await anext(lines)).startswith("data:"):
                        pass
                    await wait_for(lambda: engine.prefill_tokens == 0, what="prefill released")
                    assert engine.in_flight == 1  # the answer goes on
                    _ = [line async for line in lines]

            task = asyncio.ensure_future(first_event())
            await wait_for(lambda: engine.in_flight == 1, what="request sent")
            assert engine.prefill_tokens > 100  # before the engine's first byte (delay_s)
            await task
            # 2. a plain answer: booked until it ends (a hit now: only the partial last block)
            task = asyncio.ensure_future(h.post("/v1/chat/completions", json=body))
            await wait_for(lambda: engine.in_flight == 1, what="request sent")
            assert 0 < engine.prefill_tokens < 100
            assert (await task).status_code == 200
            assert engine.prefill_tokens == 0 and engine.in_flight == 0
            # 3. the client leaves before the answer starts
            reader, writer = await asyncio.open_connection(*url.removeprefix("http://").split(":"))
            payload = httpx.Request("POST", "/", json={**body, "messages": content * 2}).content
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(payload), payload)
            )
            await writer.drain()
            await wait_for(lambda: engine.prefill_tokens > 0, what="prefill booked")
            writer.close()
            await wait_for(lambda: engine.in_flight == 0, what="in-flight settled")
            assert engine.prefill_tokens == 0


async def test_a_retried_request_releases_the_prefill_booked_on_the_engine_that_failed() -> None:
    """``prefixaware`` on two engines: the one holding the prompt answers 503, the request is retried on
    the other, and neither engine keeps any booked prefill afterwards."""
    a, b = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    content = [{"role": "user", "content": "a prompt long enough for several blocks " * 40}]
    body = {"model": "stub-model", "messages": content, "max_tokens": 2}
    async with stubs(a, b) as urls:
        router = build_router(
            {**FAST, "static_backends": ",".join(urls), "routing_logic": "prefixaware"}, environ={}
        )
        async with serving(router) as url, http(url) as h:
            await wait_for(lambda: router.registry.healthy_count == 2, what="healthy engines")
            assert (await h.post("/v1/chat/completions", json=body)).status_code == 200
            holder = a if a.seen else b
            holder.behaviour.fail_statuses = [503]
            r = await h.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and len(a.seen) + len(b.seen) == 3  # retried once
            assert [e.prefill_tokens for e in router.registry.engines()] == [0, 0]
            assert all(e.in_flight == 0 for e in router.registry.engines())


async def test_the_request_context_carries_what_the_request_is_and_what_was_decided(tmp_path: Path) -> None:
    """One context per request, reached by every stage: a response-complete hook finds its id (the
    client's), metric label, the deciding profile and reason, its TTFT and duration there."""
    ContextRecorder.seen.clear()
    engine = StubEngine("a", ["stub-model"])
    async with stubs(engine) as urls:
        sched = scheduling(
            {"type": "round-robin-picker"},
            {"type": "test-context-recorder"},
            profile=[{"pluginRef": "round-robin-picker"}],
        )
        path = write_config(tmp_path / "r.yaml", urls, sched)
        async with router_from(path, registry_with(ContextRecorder), 1) as (url, _), http(url) as h:
            r = await h.post(
                "/v1/chat/completions", json={**BODY, "stream": True}, headers={"x-request-id": "ctx-1"}
            )
            assert r.status_code == 200
            await wait_for(lambda: len(ContextRecorder.seen) == 1, what="the hook told")
    ctx = ContextRecorder.seen[0]
    assert (ctx.request_id, ctx.model, ctx.model_label) == (b"ctx-1", "stub-model", "stub-model")
    assert (ctx.profile, ctx.reason) == ("custom", "round_robin")
    assert ctx.ttft is not None and 0 < ctx.ttft <= ctx.duration
