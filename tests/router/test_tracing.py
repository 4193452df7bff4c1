"""Tracing in the router, with the OpenTelemetry SDK's in-memory exporter in place of OTLP.

What is checked here: the span tree of plain, streamed and retried requests, the W3C context sent
upstream (each leg's own span as the parent), a client's ``traceparent`` continued, the TTFT
exemplar in the OpenMetrics exposition, the trace id in the access log, and that with tracing off
OpenTelemetry is never imported. The same trees with real vLLM engines and a real collector, the
engines' own spans joined, are ``tests/tracing`` (engine tier).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tests.fakes.stub_engine import StubBehaviour, StubEngine
from tests.router.helpers import FAST, http, serving, stubs, wait_for
from vllm_stack.app import Router, build_router

ROOT = Path(__file__).resolve().parents[2]
BODY = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_PARENT = "b7ad6b7169203331"


@contextlib.asynccontextmanager
async def traced_router(
    urls: list[str], **cli: Any
) -> AsyncIterator[tuple[str, Router, InMemorySpanExporter]]:  # noqa: ANN401
    exporter = InMemorySpanExporter()
    router = build_router(
        {**FAST, "static_backends": ",".join(urls), "routing_logic": "roundrobin", **cli},
        environ={},
        span_exporter=exporter,
    )
    async with serving(router) as url:
        await wait_for(lambda: router.registry.healthy_count >= len(urls), what="healthy engines")
        yield url, router, exporter


def _flush(router: Router) -> None:
    assert router.tracer is not None
    router.tracer.provider.force_flush()


def _by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def _traceparent(seen_headers: dict[str, str]) -> tuple[str, str]:
    version, trace_id, span_id, flags = seen_headers["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    return trace_id, span_id


async def _spans_of_one_request(router: Router, exporter: InMemorySpanExporter) -> tuple[ReadableSpan, ...]:
    def ended() -> bool:
        _flush(router)
        return any(s.kind is SpanKind.SERVER for s in exporter.get_finished_spans())

    await wait_for(ended, what="the server span")
    return exporter.get_finished_spans()


async def test_a_plain_request_is_one_trace_whose_leg_is_the_engines_parent() -> None:
    engine = StubEngine("a", ["stub-model"])
    async with stubs(engine) as urls, traced_router(urls) as (url, router, exporter), http(url) as h:
        r = await h.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "trace-1"})
        assert r.status_code == 200
        spans = await _spans_of_one_request(router, exporter)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert server.name == "POST /v1/chat/completions" and server.parent is None
    attributes = server.attributes or {}
    assert attributes["gen_ai.request.model"] == "stub-model"
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["http.response.status_code"] == 200
    assert attributes["gen_ai.request.stream"] is False
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (5, 4)
    assert attributes["vllm_stack.request_id"] == "trace-1"
    (schedule,) = _by_name(spans, "schedule")
    (leg,) = _by_name(spans, "upstream")
    trace_id = server.context.trace_id
    for child in (schedule, leg):
        assert child.context.trace_id == trace_id and child.parent is not None
        assert child.parent.span_id == server.context.span_id
    assert (schedule.attributes or {})["vllm_stack.reason"] == "round_robin"
    assert (schedule.attributes or {})["vllm_stack.engine"] == router.registry.engines()[0].name
    assert leg.kind is SpanKind.CLIENT and (leg.attributes or {})["http.response.status_code"] == 200
    # the engine got the leg's span as its parent, and no header of the client's
    sent_trace, sent_parent = _traceparent(engine.seen[-1].headers)
    assert sent_trace == format(trace_id, "032x") and sent_parent == format(leg.context.span_id, "016x")


async def test_a_clients_traceparent_is_continued_and_replaced_upstream() -> None:
    engine = StubEngine("a", ["stub-model"])
    client_parent = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
    async with stubs(engine) as urls, traced_router(urls) as (url, router, exporter), http(url) as h:
        r = await h.post("/v1/chat/completions", json=BODY, headers={"traceparent": client_parent})
        assert r.status_code == 200
        spans = await _spans_of_one_request(router, exporter)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    assert format(server.context.trace_id, "032x") == CLIENT_TRACE
    assert server.parent is not None and format(server.parent.span_id, "016x") == CLIENT_PARENT
    seen = engine.seen[-1]
    assert [k for k, _ in seen.header_list].count("traceparent") == 1
    sent_trace, sent_parent = _traceparent(seen.headers)
    assert sent_trace == CLIENT_TRACE and sent_parent != CLIENT_PARENT


async def test_a_retried_request_has_a_leg_span_per_attempt_and_the_failed_one_says_why() -> None:
    failing = StubEngine("a", ["stub-model"], behaviour=StubBehaviour(fail_statuses=[503]))
    good = StubEngine("b", ["stub-model"])
    async with stubs(failing, good) as urls, traced_router(urls) as (url, router, exporter), http(url) as h:
        for _ in range(2):  # round robin: one of the two requests starts on the failing engine
            r = await h.post("/v1/chat/completions", json=BODY)
            assert r.status_code == 200
        await wait_for(
            lambda: _flush(router) or len(_by_name(exporter.get_finished_spans(), "upstream")) == 3,
            what="three leg spans",
        )
        spans = exporter.get_finished_spans()
    retried = [s for s in _by_name(spans, "upstream") if s.status.status_code is StatusCode.ERROR]
    assert len(retried) == 1
    (failed,) = retried
    assert (failed.attributes or {})["vllm_stack.leg.error"] == "retried after 503"
    assert (failed.attributes or {})["http.response.status_code"] == 503
    same_trace = [s for s in _by_name(spans, "upstream") if s.context.trace_id == failed.context.trace_id]
    assert sorted((s.attributes or {})["vllm_stack.attempt"] for s in same_trace) == [1, 2]
    assert len(_by_name(spans, "schedule")) == 3  # a decision per attempt


async def test_a_streamed_request_marks_its_ttft_bucket_with_its_trace_id(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="vllm_stack.director.request")
    engine = StubEngine("a", ["stub-model"])
    async with (
        stubs(engine) as urls,
        traced_router(urls, access_log=True) as (url, router, exporter),
        http(url) as h,
    ):
        r = await h.post("/v1/chat/completions", json={**BODY, "stream": True})
        assert r.status_code == 200
        spans = await _spans_of_one_request(router, exporter)
        (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
        trace_id = format(server.context.trace_id, "032x")
        assert (server.attributes or {})["gen_ai.request.stream"] is True
        openmetrics = await h.get(
            "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
        )
        assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
        ttft = [
            line
            for line in openmetrics.text.splitlines()
            if line.startswith("vllm_stack_router_ttft_seconds_bucket")
        ]
        assert any(f'# {{trace_id="{trace_id}"}}' in line for line in ttft), ttft
        plain = await h.get("/metrics")  # the text format has no exemplars
        assert "trace_id" not in plain.text and plain.headers["content-type"].startswith("text/plain")
    assert any(f"trace_id={trace_id}" in m for m in caplog.messages), caplog.messages


@pytest.mark.parametrize("load_status", [200, 404])
async def test_an_adapter_load_is_a_span_of_its_request(load_status: int) -> None:
    """The load the lora-affinity plugin waits for (its pre-request hook) is a child span naming the
    adapter and the engine; a failed load marks it with the refusal."""
    engine = StubEngine("a", ["stub-model"], max_loras=2)
    engine.behaviour.lora_load_status = load_status
    adapter = {"name": "ad1", "source": "/adapters/ad1", "base_model": "stub-model", "tier": "warm"}
    async with stubs(engine) as urls, traced_router(urls, lora_adapters=[adapter]) as (url, router, exporter):
        async with http(url) as h:
            r = await h.post("/v1/completions", json={"model": "ad1", "prompt": "x", "max_tokens": 1})
            assert r.status_code == (200 if load_status == 200 else 502)
        spans = await _spans_of_one_request(router, exporter)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    (load,) = _by_name(spans, "pre_request")
    assert load.parent is not None and load.parent.span_id == server.context.span_id
    attributes = load.attributes or {}
    assert (
        attributes["vllm_stack.plugin"] == "lora-affinity-filter"
        and attributes["vllm_stack.adapter"] == "ad1"
    )
    assert attributes["vllm_stack.engine"] == router.registry.engines()[0].name
    if load_status == 200:
        assert load.status.status_code is StatusCode.UNSET and len(_by_name(spans, "upstream")) == 1
    else:
        assert attributes["vllm_stack.refused"] == "adapter_unavailable"
        assert load.status.status_code is StatusCode.ERROR and not _by_name(spans, "upstream")


async def test_a_request_that_waits_in_the_queue_has_a_queue_span_and_the_decision_that_ended_it() -> None:
    """A configured model with no engine yet (scale from zero): the request waits in its queue until
    the engine serves the model; the queue span ends ``dispatched`` and a schedule span follows it."""
    engine = StubEngine("a", ["stub-model"])
    async with (
        stubs(engine) as urls,
        traced_router(urls, models=["stub-model", "cold-model"]) as (url, router, exporter),
    ):
        async with http(url) as h:
            waiting = asyncio.create_task(
                h.post("/v1/chat/completions", json={**BODY, "model": "cold-model"})
            )
            await wait_for(lambda: router.queue.length == 1, what="the request queued")
            engine.add_model("cold-model")  # the next probe learns it: the queue is kicked
            r = await asyncio.wait_for(waiting, 10)
            assert r.status_code == 200
        spans = await _spans_of_one_request(router, exporter)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    (queue,) = _by_name(spans, "queue")
    assert queue.parent is not None and queue.parent.span_id == server.context.span_id
    assert (queue.attributes or {})["vllm_stack.queue.outcome"] == "dispatched"
    decisions = sorted(_by_name(spans, "schedule"), key=lambda s: s.start_time or 0)
    assert [(d.attributes or {})["vllm_stack.reason"] for d in decisions][0] == "no_candidate"
    assert "vllm_stack.engine" in (decisions[-1].attributes or {})
    assert (queue.end_time or 0) <= (decisions[-1].end_time or 0)


async def test_a_request_the_sampler_drops_makes_no_span_and_tells_the_engine_so() -> None:
    """At ratio 0 nothing is kept, but the leg still sends the trace context with the sampled flag
    off, so that the engine's parent-based sampler drops its spans too; a client's sampled parent is
    followed whatever the ratio."""
    engine = StubEngine("a", ["stub-model"])
    async with stubs(engine) as urls, traced_router(urls, trace_sample_ratio=0.0) as (url, router, exporter):
        async with http(url) as h:
            assert (await h.post("/v1/chat/completions", json={**BODY, "stream": True})).status_code == 200
            _flush(router)
            assert exporter.get_finished_spans() == ()
            assert int(engine.seen[-1].headers["traceparent"].rsplit("-", 1)[1], 16) & 1 == 0
            metrics = await h.get(
                "/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"}
            )
            assert "trace_id" not in metrics.text
            parent = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
            r = await h.post("/v1/chat/completions", json=BODY, headers={"traceparent": parent})
            assert r.status_code == 200
        spans = await _spans_of_one_request(router, exporter)
    assert {format(s.context.trace_id, "032x") for s in spans} == {CLIENT_TRACE}


async def test_admission_is_a_span_and_a_refusal_marks_it() -> None:
    """An admission plugin (one request in flight per engine): the first request's admission span is
    clean, the second, refused while the first is in flight, says why."""
    engine = StubEngine("a", ["stub-model"], behaviour=StubBehaviour(delay_s=1.0))
    scheduling = {
        "plugins": [
            {"type": "max-in-flight-admission", "parameters": {"per_engine": 1}},
            {"type": "round-robin-picker"},
        ],
        "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "round-robin-picker"}]}],
    }
    async with stubs(engine) as urls, traced_router(urls, scheduling=scheduling) as (url, router, exporter):
        async with http(url) as h:
            first = asyncio.create_task(
                h.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "in"})
            )
            await wait_for(lambda: engine.running == 1, what="the first request at the engine")
            refused = await h.post("/v1/chat/completions", json=BODY, headers={"x-request-id": "out"})
            assert refused.status_code == 429 and (await first).status_code == 200
        await wait_for(
            lambda: _flush(router) or len(_by_name(exporter.get_finished_spans(), "admission")) == 2,
            what="two admission spans",
        )
        spans = exporter.get_finished_spans()
    servers = {(s.attributes or {})["vllm_stack.request_id"]: s for s in spans if s.kind is SpanKind.SERVER}
    admissions = {
        request_id: [a for a in _by_name(spans, "admission") if a.context.trace_id == server.context.trace_id]
        for request_id, server in servers.items()
    }
    (admitted,), (turned_away,) = admissions["in"], admissions["out"]
    assert admitted.status.status_code is StatusCode.UNSET and "vllm_stack.refused" not in (
        admitted.attributes or {}
    )
    assert (turned_away.attributes or {})["vllm_stack.refused"] == "overloaded"
    assert turned_away.status.status_code is StatusCode.ERROR
    assert (servers["out"].attributes or {})["http.response.status_code"] == 429


async def test_a_request_s_warnings_name_its_request_and_trace(caplog: pytest.LogCaptureFixture) -> None:
    """An engine that breaks its stream: the router's warning says which request and which trace."""
    caplog.set_level("WARNING", logger="vllm_stack.relay.leg")
    engine = StubEngine("a", ["stub-model"], behaviour=StubBehaviour(break_after_chunks=2))
    async with stubs(engine) as urls, traced_router(urls) as (url, router, exporter), http(url) as h:
        with contextlib.suppress(Exception):  # the answer is cut: the client sees a broken stream
            await h.post(
                "/v1/chat/completions", json={**BODY, "stream": True}, headers={"x-request-id": "cut-1"}
            )
        spans = await _spans_of_one_request(router, exporter)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    trace_id = format(server.context.trace_id, "032x")
    assert any(f"(request cut-1, trace_id={trace_id})" in m for m in caplog.messages), caplog.messages


async def test_an_unknown_model_is_traced_too() -> None:
    engine = StubEngine("a", ["stub-model"])
    async with stubs(engine) as urls, traced_router(urls) as (url, router, exporter), http(url) as h:
        r = await h.post("/v1/chat/completions", json={**BODY, "model": "nope"})
        assert r.status_code == 404
        spans = await _spans_of_one_request(router, exporter)
    (server,) = spans
    assert (server.attributes or {})["http.response.status_code"] == 404


def test_with_tracing_off_opentelemetry_is_never_imported() -> None:
    """Requests served by a router without an OTLP endpoint: no OpenTelemetry module is loaded."""
    code = textwrap.dedent(
        """
        import asyncio, sys
        import httpx
        from tests.fakes.stub_engine import StubEngine
        from tests.router.helpers import FAST, serving, stubs, wait_for
        from vllm_stack.app import build_router

        async def main():
            async with stubs(StubEngine("a", ["stub-model"])) as urls:
                router = build_router({**FAST, "static_backends": urls[0]}, environ={})
                async with serving(router) as url:
                    await wait_for(lambda: router.registry.healthy_count >= 1)
                    async with httpx.AsyncClient(base_url=url) as h:
                        body = {"model": "stub-model", "messages": [{"role": "user", "content": "x"}]}
                        for stream in (False, True):
                            r = await h.post("/v1/chat/completions", json={**body, "stream": stream})
                            assert r.status_code == 200, r.text
                        assert (await h.get("/metrics")).status_code == 200
            loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry") or m == "vllm_stack.tracing.otel")
            print("LOADED", loaded)

        asyncio.run(main())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LOADED []" in out.stdout, out.stdout
