"""One trace per request, router to engine, read back from a real OpenTelemetry Collector.

A collector built from its published Go modules (``vllm_stack_dev.testbed.collector``) receives OTLP
from the router and from a real CPU vLLM engine started with ``--otlp-traces-endpoint``; its file
exporter's output is parsed back into spans. For a plain, a streamed, a retried and a disaggregated
request the test asserts the tree: the router's server span, its ``schedule`` and leg spans as its
children, vLLM's own ``llm_request`` span as the child of the leg that reached it, one trace id.

The retried request's first attempt goes to a stub engine (answers 503 once; a real vLLM does not
fail on demand) and its retry to the real engine. The disaggregated request runs its prefill leg and
its decode leg on the same real engine through two TCP taps (two addresses, so two engines to the
router, one prefill and one decode): without a KV connector vLLM serves both as plain requests, which
is all the trace needs (the KV hand-over has its own tests, test_disagg_engines.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from vllm_stack_dev.testbed.collector import Collector, SpanRecord
from vllm_stack_dev.testbed.engines import Engine, EngineSpec, default_cpus, launch, wait_ready

from tests.conftest import CHAT_MODEL, READY_TIMEOUT, SessionEngines
from tests.fakes.stub_engine import StubBehaviour, StubEngine
from tests.fakes.wire_tap import tapped
from tests.router.helpers import http, running_router, stubs
from vllm_stack.app import Router

pytestmark = pytest.mark.engine

ROUTER_SERVICE = "vllm-stack-router"
ENGINE_SERVICE = "vllm-engine"
LONG = " ".join(f"part {i} of a prompt long enough to be worth a prefill leg" for i in range(12))


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Collector]:
    with Collector(tmp_path_factory.mktemp("collector")) as running:
        yield running


@pytest.fixture(scope="module")
def traced_engine(
    collector: Collector, session_engines: SessionEngines, tiny_model_dir: Path, engine_logs_dir: Path
) -> Iterator[Engine]:
    """A real engine sending its spans to the collector (started once the session's engines are up)."""
    session_engines.priority_engine()  # the second wave is ready: no start contention
    spec = EngineSpec(
        tiny_model_dir,
        CHAT_MODEL,
        kv_events=False,
        enable_lora=False,
        extra_args=["--otlp-traces-endpoint", collector.grpc_endpoint],
        # vLLM's exporter batches for 5 s by default; the SDK's variable makes it send at once
        env={"OTEL_SERVICE_NAME": ENGINE_SERVICE, "OTEL_BSP_SCHEDULE_DELAY": "100"},
    )
    engine = launch(spec, name="traced", cpu=default_cpus(1)[0], log_dir=engine_logs_dir)
    try:
        wait_ready([engine], READY_TIMEOUT)
        yield engine
    finally:
        engine.stop()


@contextlib.asynccontextmanager
async def traced_router(
    backends: list[str], collector: Collector, **settings: object
) -> AsyncIterator[tuple[str, Router]]:
    async with running_router(backends, otlp_traces_endpoint=collector.grpc_endpoint, **settings) as (
        url,
        router,
    ):
        yield url, router
        assert router.tracer is not None
        router.tracer.provider.force_flush()


def _server_span(spans: list[SpanRecord], request_id: str) -> SpanRecord | None:
    found = [
        s
        for s in spans
        if s.service == ROUTER_SERVICE
        and s.kind == "server"
        and s.attributes.get("vllm_stack.request_id") == request_id
    ]
    return found[0] if found else None


def _tree(
    collector: Collector, request_id: str, legs: int, engine_spans: int
) -> tuple[SpanRecord, list[SpanRecord], list[SpanRecord]]:
    """The request's server span, its leg spans in attempt order, and the engine spans, once the
    collector holds ``legs`` legs and ``engine_spans`` vLLM spans of its trace."""

    def complete(spans: list[SpanRecord]) -> bool:
        server = _server_span(spans, request_id)
        if server is None:
            return False
        in_trace = [s for s in spans if s.trace_id == server.trace_id]
        return (
            len([s for s in in_trace if s.kind == "client"]) >= legs
            and len([s for s in in_trace if s.service == ENGINE_SERVICE]) >= engine_spans
        )

    spans = collector.wait_for(complete)
    server = _server_span(spans, request_id)
    assert server is not None
    in_trace = [s for s in spans if s.trace_id == server.trace_id]
    router_children = [s for s in in_trace if s.service == ROUTER_SERVICE and s.parent_id == server.span_id]
    leg_spans = sorted(
        (s for s in router_children if s.kind == "client"), key=lambda s: s.attributes["vllm_stack.attempt"]
    )
    assert [s for s in router_children if s.name == "schedule"], "no scheduling span"
    engine = [s for s in in_trace if s.service == ENGINE_SERVICE]
    return server, leg_spans, engine


def _engine_span_under(leg: SpanRecord, engine_spans: list[SpanRecord]) -> SpanRecord:
    children = [s for s in engine_spans if s.parent_id == leg.span_id]
    assert len(children) == 1, (leg, engine_spans)
    return children[0]


async def test_plain_and_streamed_requests_are_one_trace_down_to_the_engine(
    collector: Collector, traced_engine: Engine
) -> None:
    async with (
        tapped(traced_engine.port) as tap,
        traced_router([tap.url], collector) as (url, _),
        http(url) as h,
    ):
        for request_id, stream in (("plain-1", False), ("stream-1", True)):
            body = {
                "model": CHAT_MODEL,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4,
                "stream": stream,
            }
            r = await h.post("/v1/chat/completions", json=body, headers={"x-request-id": request_id})
            assert r.status_code == 200
    for request_id, stream in (("plain-1", False), ("stream-1", True)):
        server, legs, engine_spans = _tree(collector, request_id, legs=1, engine_spans=1)
        assert server.attributes["gen_ai.request.model"] == CHAT_MODEL
        assert server.attributes["gen_ai.request.stream"] is stream
        assert server.attributes["http.response.status_code"] == 200
        if not stream:  # a stream carries usage only when the client asks for it
            assert server.attributes["gen_ai.usage.output_tokens"] == 4
        (leg,) = legs
        assert leg.name == "upstream" and leg.attributes["http.response.status_code"] == 200
        engine = _engine_span_under(leg, engine_spans)
        assert engine.trace_id == server.trace_id


async def test_a_retried_request_shows_both_attempts_and_the_engine_under_the_second(
    collector: Collector, traced_engine: Engine
) -> None:
    """Every request the stub gets is answered 503 and retried on the real engine; round robin starts at
    least one of two requests on the stub."""
    failing = StubEngine("failing", [CHAT_MODEL], behaviour=StubBehaviour(fail_statuses=[503] * 4))
    async with stubs(failing) as stub_urls, tapped(traced_engine.port) as tap:
        async with traced_router([stub_urls[0], tap.url], collector) as (url, _), http(url) as h:
            body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": "again"}], "max_tokens": 2}
            for i in range(2):
                r = await h.post("/v1/chat/completions", json=body, headers={"x-request-id": f"retry-{i}"})
                assert r.status_code == 200
    trees = [_tree(collector, f"retry-{i}", legs=1, engine_spans=1) for i in range(2)]
    retried = [tree for tree in trees if len(tree[1]) == 2]
    assert retried, [[leg.attributes for leg in tree[1]] for tree in trees]
    for _, legs, engine_spans in trees:
        _engine_span_under(legs[-1], engine_spans)  # the engine's span is under the leg that reached it
    for _, (first, second), engine_spans in retried:
        assert first.status == "error" and first.attributes["vllm_stack.leg.error"] == "retried after 503"
        assert first.attributes["http.response.status_code"] == 503
        assert second.attributes["http.response.status_code"] == 200
        assert not [s for s in engine_spans if s.parent_id == first.span_id]


async def test_a_disaggregated_request_has_a_prefill_and_a_decode_leg_each_with_its_engine_span(
    collector: Collector, traced_engine: Engine
) -> None:
    async with tapped(traced_engine.port) as prefill, tapped(traced_engine.port) as decode:
        settings = {
            "routing_logic": "disaggregated_prefill",
            "static_roles": "prefill,decode",
            "disagg_min_uncached_tokens": 16,
        }
        async with (
            traced_router([prefill.url, decode.url], collector, **settings) as (url, _),
            http(url) as h,
        ):
            body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": LONG}], "max_tokens": 4}
            r = await h.post("/v1/chat/completions", json=body, headers={"x-request-id": "pd-1"})
            assert r.status_code == 200
    server, legs, engine_spans = _tree(collector, "pd-1", legs=2, engine_spans=2)
    assert [leg.name for leg in legs] == ["prefill", "decode"]
    for leg in legs:
        assert leg.attributes["http.response.status_code"] == 200
        _engine_span_under(leg, engine_spans)
    assert server.attributes["http.response.status_code"] == 200
