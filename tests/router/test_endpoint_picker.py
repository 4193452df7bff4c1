"""The router as an endpoint picker (ext_proc v3) and as a gateway asking one, over stub engines.

The protocol as a gateway sees it (message order, header and metadata keys, the body back, errors as
ImmediateResponses, the subset hint, the response passed back and the engine's books settled), then
gateway mode: a router asking our picker, fail-open and fail-closed when the picker is down, and a
picker's refusal passed to the client. The same against the upstream picker and real engines is the
cluster tier's ``tests/cluster/test_inference_extension.py``.
"""

from __future__ import annotations

import contextlib
import gc
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
import pytest
from vllm_stack_dev.testbed.extproc_driver import exchange

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import http, metric_value, running_router, stubs, wait_for
from vllm_stack.app import Router

BODY = {"model": "stub-model", "prompt": "hello there", "max_tokens": 3}
HEADERS = [
    (":method", "POST"),
    (":path", "/v1/completions"),
    (":authority", "gw"),
    ("content-type", "application/json"),
    ("hi", "mom"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.asynccontextmanager
async def picker(
    engines: int | list[StubEngine] = 2, **settings: Any
) -> AsyncIterator[tuple[str, Router, list[StubEngine], list[str]]]:  # noqa: ANN401
    """Our endpoint picker (a router with ext_proc on) over stub engines: (host:port, router, engines, urls)."""
    stub_engines = (
        engines
        if isinstance(engines, list)
        else [StubEngine(f"e{i}", ["stub-model"]) for i in range(engines)]
    )
    port = _free_port()
    async with (
        stubs(*stub_engines) as urls,
        running_router(urls, host="127.0.0.1", ext_proc_port=port, **settings) as (_, router),
    ):
        yield f"127.0.0.1:{router.picker_server.port}", router, stub_engines, urls


async def test_a_pick_answers_headers_then_the_body_back_then_passes_the_answer_back() -> None:
    async with picker() as (target, router, _, urls):
        body = orjson.dumps(BODY)
        answer = b'{"id":"x","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'
        ex = await exchange(
            target,
            [*HEADERS, ("x-request-id", "pick-1")],
            body,
            chunk=7,
            response=([(":status", "200"), ("content-type", "application/json")], [answer[:10], answer[10:]]),
        )
        assert ex.kinds == [
            "request_headers",
            "request_body",
            "response_headers",
            "response_body",
            "response_body",
        ]
        assert ex.endpoint in {u.removeprefix("http://") for u in urls}
        keys = ex.set_header_keys("request_headers")
        assert {"x-gateway-destination-endpoint", "content-length", "hi", "x-request-id"} <= set(keys)
        assert ex.header("request_headers", "content-length") == str(len(body))
        assert ex.metadata_keys() == {"envoy.lb": ["x-gateway-destination-endpoint"]}
        listed = wire_list(ex)
        assert listed[0] == ex.endpoint and len(listed) == 2  # the other engine as the fallback
        assert ex.first("request_headers").request_headers.response.clear_route_cache
        assert ex.body("request_body") == body
        assert ex.header("response_headers", "x-went-into-resp-headers") == "true"
        assert ex.body("response_body") == answer
        engine = ex.endpoint
        await wait_for(
            lambda: (
                metric_value(
                    router,
                    "vllm_stack_router_requests_total",
                    model="stub-model",
                    engine=engine,
                    status="200",
                )
                == 1
            ),
            what="the request counted once its answer ended",
        )
        assert all(e.in_flight == 0 for e in router.registry.engines())  # the booking was settled


def wire_list(ex: Any) -> list[str]:  # noqa: ANN401
    from vllm_stack.extproc import wire

    return wire.destination_of(ex.first("request_headers"))[1]


async def test_the_subset_hint_restricts_the_pick() -> None:
    async with picker() as (target, _, _, urls):
        only = urls[1].removeprefix("http://")
        for _ in range(4):
            ex = await exchange(target, HEADERS, orjson.dumps(BODY), subset=[only])
            assert ex.endpoint == only
        ex = await exchange(target, HEADERS, orjson.dumps(BODY), subset=["10.9.9.9:8000"])
        assert ex.kinds == ["immediate_response"]
        assert ex.answers[0].immediate_response.status.code == 503


async def test_errors_are_immediate_responses_with_the_routers_error_body() -> None:
    async with picker(max_body_bytes=1000) as (target, router, _, _):
        unknown = await exchange(target, HEADERS, orjson.dumps({**BODY, "model": "nope"}))
        assert unknown.kinds == ["immediate_response"]
        refusal = unknown.answers[0].immediate_response
        assert refusal.status.code == 404
        assert orjson.loads(refusal.body)["error"]["code"] == "model_not_found"
        bad = await exchange(target, HEADERS, b"{not json")
        assert bad.answers[0].immediate_response.status.code == 400
        big = await exchange(target, HEADERS, orjson.dumps({**BODY, "prompt": "x" * 2000}), chunk=500)
        assert big.kinds == ["immediate_response"] and big.answers[0].immediate_response.status.code == 413
        assert router.picker_server.service.buffered == 0  # nothing held after the refusals


async def test_a_stream_that_ends_after_the_pick_releases_the_engine() -> None:
    async with picker() as (target, router, _, _):
        ex = await exchange(target, HEADERS, orjson.dumps(BODY))  # closed after the pick, no answer
        assert ex.kinds == ["request_headers", "request_body"]
        await wait_for(
            lambda: all(e.in_flight == 0 for e in router.registry.engines()), what="the booking released"
        )
        await wait_for(
            lambda: (
                metric_value(
                    router,
                    "vllm_stack_router_requests_total",
                    model="stub-model",
                    engine=ex.endpoint,
                    status="client_closed",
                )
                == 1
            ),
            what="the request counted as closed",
        )


async def test_an_ended_stream_leaves_no_cycle_for_the_garbage_collector() -> None:
    """A stream's exchange, request and task are freed when the stream ends, not at the next collection:
    each stream's few dozen objects kept alive until then made every collection longer
    (picker_cost_profile.md). The router's own requests: test_no_reference_cycles.py."""
    answer = b'{"id":"x","choices":[]}'
    async with picker() as (target, router, _, _):
        open_streams = router.picker_server.service.slots.open
        enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable stays in gc.garbage
        try:
            await exchange(target, HEADERS, orjson.dumps(BODY))  # closed after the pick
            await exchange(target, HEADERS, orjson.dumps(BODY), response=([(":status", "200")], [answer]))
            await wait_for(lambda: not open_streams, what="both streams ended on the picker's side")
            gc.collect()
            cyclic = {type(o).__name__ for o in gc.garbage} & {"Exchange", "PickedRequest", "RequestContext"}
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            if enabled:
                gc.enable()
        assert not cyclic


async def test_a_header_only_request_gets_an_engine_at_once() -> None:
    async with picker() as (target, _, _, urls):
        ex = await exchange(target, [(":method", "GET"), (":path", "/v1/models")], b"")
        assert ex.kinds == ["request_headers"]
        assert ex.endpoint in {u.removeprefix("http://") for u in urls}


async def test_gateway_mode_routes_through_our_picker() -> None:
    async with picker(routing_logic="session", session_key="x-user") as (target, epp, engines, urls):
        async with running_router(urls, endpoint_picker=f"grpc://{target}") as (url, gateway), http(url) as h:
            for user in ("a", "b", "a", "a"):
                r = await h.post(
                    "/v1/completions", json=BODY, headers={"x-user": user, "authorization": "Bearer secret"}
                )
                assert r.status_code == 200, r.text
            assert (
                metric_value(gateway, "vllm_stack_router_endpoint_picker_requests_total", outcome="picked")
                == 4
            )
            # session affinity decided by the picker: user a's three requests went to one engine
            await wait_for(
                lambda: (
                    sum(
                        metric_value(
                            epp,
                            "vllm_stack_router_requests_total",
                            model="stub-model",
                            engine=e.address,
                            status="200",
                        )
                        for e in epp.registry.engines()
                    )
                    == 4
                ),
                what="the picker saw 4 answers end",
            )
            counts = sorted(sum(1 for s in e.seen if s.path == "/v1/completions") for e in engines)
            assert counts in ([1, 3], [0, 4])


async def test_gateway_mode_fails_open_or_closed_when_the_picker_is_down() -> None:
    dead = _free_port()
    engine = StubEngine("e", ["stub-model"])
    async with stubs(engine) as urls:
        async with (
            running_router(urls, endpoint_picker=f"grpc://127.0.0.1:{dead}", endpoint_picker_timeout=0.5) as (
                url,
                gateway,
            ),
            http(url) as h,
        ):
            r = await h.post("/v1/completions", json=BODY)
            assert r.status_code == 200  # scheduled here
            assert (
                metric_value(gateway, "vllm_stack_router_endpoint_picker_requests_total", outcome="error")
                + metric_value(gateway, "vllm_stack_router_endpoint_picker_requests_total", outcome="timeout")
                == 1
            )
        async with (
            running_router(
                urls,
                endpoint_picker=f"grpc://127.0.0.1:{dead}",
                endpoint_picker_timeout=0.5,
                endpoint_picker_fail_open=False,
            ) as (url, _),
            http(url) as h,
        ):
            r = await h.post("/v1/completions", json=BODY)
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "endpoint_picker_unavailable"


async def test_gateway_mode_passes_the_pickers_refusal_to_the_client() -> None:
    """The picker's ImmediateResponse (here its body limit, lower than the gateway's) is the answer."""
    async with picker(max_body_bytes=100) as (target, _, _, urls):
        async with running_router(urls, endpoint_picker=f"grpc://{target}") as (url, gateway), http(url) as h:
            r = await h.post("/v1/completions", json={**BODY, "prompt": "y" * 300})
            assert r.status_code == 413
            assert r.json()["error"]["code"] == "body_too_large"
            assert (
                metric_value(gateway, "vllm_stack_router_endpoint_picker_requests_total", outcome="immediate")
                == 1
            )


def test_the_pickers_refusal_keeps_the_headers_it_set() -> None:
    """Envoy passes an ImmediateResponse's headers to the client: so does gateway mode, e.g. llm-d's flow
    control's ``x-llm-d-request-dropped-reason`` on its 429 (its body is text), but not the framing
    headers the router writes itself."""
    from vllm_stack.director.request import _picker_refusal

    refusal = _picker_refusal(
        429,
        b"inference error: ResourceExhausted - request rejected: saturated",
        [("x-llm-d-request-dropped-reason", "rejected-saturated"), ("retry-after", "2"),
         ("content-type", "text/plain"), ("content-length", "64"), (":status", "429")],
    )  # fmt: skip
    assert refusal.status == 429 and refusal.code == "endpoint_picker_refused"
    assert refusal.message.startswith("inference error: ResourceExhausted")
    assert refusal.headers == [
        (b"x-llm-d-request-dropped-reason", b"rejected-saturated"),
        (b"retry-after", b"2"),
    ]


async def test_client_api_keys_are_checked_on_the_headers() -> None:
    """With client keys configured, a gateway request without one is refused before its body is gathered."""
    async with picker(environ={"VLLM_STACK_API_KEYS": "k1"}) as (target, router, _, _):
        refused = await exchange(target, HEADERS, orjson.dumps(BODY))
        assert refused.kinds == ["immediate_response"]
        assert refused.answers[0].immediate_response.status.code == 401
        assert orjson.loads(refused.answers[0].immediate_response.body)["error"]["code"] == "invalid_api_key"
        allowed = await exchange(target, [*HEADERS, ("authorization", "Bearer k1")], orjson.dumps(BODY))
        assert allowed.kinds == ["request_headers", "request_body"]
        assert router.picker_server.service.buffered == 0


async def test_one_message_over_one_mib_is_refused_by_grpc() -> None:
    """Bodies come in chunks; one message is bounded whatever the body limit (no 2 MiB header block)."""
    async with picker(max_body_bytes=8 << 20) as (target, router, _, _):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await exchange(target, HEADERS, b"x" * (2 << 20))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        chunked = await exchange(
            target, HEADERS, orjson.dumps({**BODY, "prompt": "y" * (2 << 20)}), chunk=64 << 10
        )
        assert chunked.kinds[0] == "request_headers"
        assert router.picker_server.service.buffered == 0


async def test_the_endpoint_the_gateway_reports_as_served_gets_the_books() -> None:
    """The gateway used a fallback (``x-gateway-destination-endpoint-served``): the request is counted
    on the engine that served it, and nothing stays booked on the one picked."""
    async with picker() as (target, router, _, urls):
        answer = b'{"id":"x","choices":[]}'
        picked, other = (u.removeprefix("http://") for u in urls)
        ex = await exchange(
            target,
            HEADERS,
            orjson.dumps(BODY),
            subset=[picked],
            response=([(":status", "200")], [answer]),
            served=other,
        )
        assert ex.endpoint == picked
        await wait_for(
            lambda: (
                metric_value(
                    router, "vllm_stack_router_requests_total", model="stub-model", engine=other, status="200"
                )
                == 1
            ),
            what="the request counted on the engine that served it",
        )
        assert all(e.in_flight == 0 for e in router.registry.engines())


async def test_gateway_mode_reports_the_engine_that_served_after_a_retry() -> None:
    """Our gateway retries on the picker's fallback and tells the picker which engine served."""
    async with picker() as (target, epp, engines, urls):
        engines[0].behaviour.fail_statuses = [503]  # its first request fails
        async with running_router(urls, endpoint_picker=f"grpc://{target}") as (url, _), http(url) as h:
            for _ in range(2):  # round-robin picks: one of the two is picked on engines[0]
                r = await h.post("/v1/completions", json=BODY)
                assert r.status_code == 200, r.text
        seen = [sum(1 for s in e.seen if s.path == "/v1/completions") for e in engines]
        assert seen == [1, 2]  # the failed attempt, then both answers from the other engine
        other = urls[1].removeprefix("http://")
        await wait_for(
            lambda: (
                metric_value(
                    epp, "vllm_stack_router_requests_total", model="stub-model", engine=other, status="200"
                )
                == 2
            ),
            what="both answers counted by the picker on the engine that served them",
        )
        assert all(e.in_flight == 0 for e in epp.registry.engines())


async def test_lora_affinity_loads_the_adapter_on_the_picked_engine_before_the_answer() -> None:
    """The picker runs lora-affinity's awaited pre-request hook: the adapter is loaded on the engine it
    names before the gateway hears the name, and later requests for it are named the same engine."""
    engines = [StubEngine(name, ["stub-model"], max_loras=2) for name in ("a", "b")]
    adapter = {"name": "ad1", "source": "/adapters/ad1", "base_model": "stub-model", "tier": "warm"}
    async with picker(engines, lora_adapters=[adapter]) as (target, router, _, _):
        await wait_for(lambda: all(e.max_loras == 2 for e in router.registry.engines()), what="slots scraped")
        body = orjson.dumps({**BODY, "model": "ad1"})
        first = await exchange(target, HEADERS, body)
        assert first.kinds == ["request_headers", "request_body"]
        loaded = [e for e in engines if e.lora_loads == ["ad1"]]
        assert len(loaded) == 1 and sum(len(e.lora_loads) for e in engines) == 1
        later = {(await exchange(target, HEADERS, body)).endpoint for _ in range(5)}
        assert later == {first.endpoint}
        assert sum(len(e.lora_loads) for e in engines) == 1


async def test_a_weighted_model_name_is_sent_back_as_its_target() -> None:
    engines = [StubEngine("a", ["v1", "v2"])]
    weighted = {"chat": [{"model": "v1", "weight": 50}, {"model": "v2", "weight": 50}]}
    async with picker(engines, weighted_models=weighted) as (target, _, _, _):
        ex = await exchange(target, HEADERS, orjson.dumps({**BODY, "model": "chat", "user": "alice"}))
        sent = orjson.loads(ex.body("request_body"))
        assert sent["model"] in {"v1", "v2"}
        assert ex.header("request_headers", "content-length") == str(len(ex.body("request_body")))
