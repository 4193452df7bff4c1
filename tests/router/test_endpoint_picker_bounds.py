"""The endpoint picker's bounds on what a gateway holds (issue 44), over stub engines.

Streams that go silent while their request arrives (before any message, after the headers, in the middle
of a body) are answered 408 and give back their body budget; at the stream cap a stalled one gives way to
a new stream; a picked request whose answer never comes has its engine booking released; gateway
connections are capped and idle ones closed. And what the picker answers before any pick: a body before
any headers (never picked, 401 with client keys), a path the router would not proxy (404/405), a client's
invalid ``x-request-id`` (replaced, not passed on beside the new one).

Timeouts are set short so each test ends as soon as the picker acts; every wait is on a condition (a
read, a metric, the budget), bounded by a deadline that only a failure reaches.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from vllm_stack_dev.testbed.extproc_driver import exchange

from tests.router.helpers import metric_value, wait_for
from tests.router.test_endpoint_picker import BODY, HEADERS, picker
from vllm_stack.app import Router
from vllm_stack.extproc import wire
from vllm_stack.request_id import valid_request_id

DEADLINE = 10.0  # seconds any single wait may take before the test fails
#: An HTTP/2 client's connection preface and an empty SETTINGS frame: a connection a gateway opened.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@contextlib.asynccontextmanager
async def stream(target: str) -> AsyncIterator[grpc.aio.StreamStreamCall]:
    """One ext_proc stream, written and read by the test message by message."""
    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process(timeout=60)
        try:
            yield call
        finally:
            call.cancel()


def headers(pairs: list[tuple[str, str]] = HEADERS, end: bool = False) -> wire.ProcessingRequest:
    return wire.ProcessingRequest(
        request_headers=wire.pb.HttpHeaders(headers=wire.header_map(pairs), end_of_stream=end)
    )


def body(data: bytes, end: bool) -> wire.ProcessingRequest:
    return wire.ProcessingRequest(request_body=wire.pb.HttpBody(body=data, end_of_stream=end))


async def read(call: grpc.aio.StreamStreamCall) -> wire.ProcessingResponse:
    answer = await asyncio.wait_for(call.read(), DEADLINE)
    assert answer is not grpc.aio.EOF
    return answer


def streams(router: Router, outcome: str) -> float:
    return metric_value(router, "vllm_stack_router_ext_proc_streams_total", outcome=outcome)


def refusal(answer: wire.ProcessingResponse) -> tuple[int, str]:
    """(status, error code) of an ImmediateResponse."""
    assert answer.WhichOneof("response") == "immediate_response", answer
    immediate = answer.immediate_response
    return immediate.status.code, orjson.loads(immediate.body)["error"]["code"]


async def test_a_stream_silent_while_its_request_arrives_is_answered_408_and_its_budget_freed() -> None:
    """Silent before any message, after its headers, and in the middle of its body: each is ended with
    408 once the idle timeout passes, and the body's share of the budget is given back."""
    async with (
        picker(ext_proc_idle_timeout=0.5) as (target, router, _, _),
        stream(target) as nothing,
        stream(target) as headers_only,
        stream(target) as half_body,
    ):
        await headers_only.write(headers())
        await half_body.write(headers())
        await half_body.write(body(b"x" * 500, end=False))
        service = router.picker_server.service
        await wait_for(lambda: service.buffered == 500, what="the half body gathered")
        for call in (nothing, headers_only, half_body):
            assert refusal(await read(call)) == (408, "request_timeout")
            assert await asyncio.wait_for(call.read(), DEADLINE) is grpc.aio.EOF
        assert service.buffered == 0
        assert streams(router, "idle_timeout") == 3
        assert all(e.in_flight == 0 for e in router.registry.engines())
        ok = await exchange(target, HEADERS, orjson.dumps(BODY))  # the picker still picks
        assert ok.kinds == ["request_headers", "request_body"]


async def _try_pick(target: str, router: Router) -> wire.ProcessingResponse | None:
    """One request on a new stream: the picker's first answer, or None when the picker refused the
    stream as full (counted ``refused``; the client may see the refusal as its own write failing, or,
    when the refusal came before its next write, as that write finding the call over)."""
    refused = streams(router, "refused")
    async with stream(target) as call:
        try:
            await call.write(headers())
            await call.write(body(orjson.dumps(BODY), end=True))
            return await read(call)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            assert streams(router, "refused") == refused + 1
            return None


async def test_at_the_stream_cap_a_stalled_request_gives_way_to_a_new_stream() -> None:
    """Three streams that sent headers and stalled fill a picker capped at three; a new request is
    still picked (once they have been silent a moment), the longest silent stream answered 408 in its
    place and the others kept."""
    async with picker(max_connections=3, ext_proc_idle_timeout=60) as (target, router, _, _):
        async with stream(target) as a, stream(target) as b, stream(target) as c:
            slots = router.picker_server.service.slots
            for count, call in enumerate((a, b, c), 1):  # one after the other: a is the longest silent
                await call.write(headers())
                await wait_for(
                    lambda count=count: sum(e.heard_headers for e in slots.waiting) == count,
                    what=f"{count} streams waiting for their bodies",
                )
            picked = None
            async with asyncio.timeout(DEADLINE):
                while picked is None:  # refused until the stalled ones have been silent long enough
                    picked = await _try_pick(target, router)
            assert picked.WhichOneof("response") == "request_headers"
            assert streams(router, "evicted") == 1
            assert refusal(await read(a)) == (408, "request_timeout")
            assert len(slots.waiting) == 2  # b and c still wait for their bodies


async def test_a_body_before_any_headers_is_never_picked() -> None:
    """With client keys, a stream that skips its headers gets 401 (the key check it skipped); without,
    400. Nothing is booked either way."""
    data = orjson.dumps(BODY)
    async with picker(environ={"VLLM_STACK_API_KEYS": "k1"}) as (target, router, _, _):
        async with stream(target) as call:
            await call.write(body(data, end=True))
            assert refusal(await read(call)) == (401, "invalid_api_key")
        assert streams(router, "picked") == 0
        assert all(e.in_flight == 0 for e in router.registry.engines())
    async with picker() as (target, router, _, _), stream(target) as call:
        await call.write(body(data, end=True))
        assert refusal(await read(call)) == (400, "headers_missing")
        assert streams(router, "picked") == 0


async def test_an_answer_that_never_comes_releases_the_engine_booking() -> None:
    """Picked, then nothing from the gateway: after the answer timeout the booking is released, counted,
    and the stream ended with DEADLINE_EXCEEDED (nothing can be answered in the middle of an answer)."""
    async with picker(ext_proc_answer_timeout=0.5) as (target, router, _, _), stream(target) as call:
        await call.write(headers())
        await call.write(body(orjson.dumps(BODY), end=True))
        picked = await read(call)
        assert picked.WhichOneof("response") == "request_headers"
        assert (await read(call)).WhichOneof("response") == "request_body"
        endpoint = wire.destination_of(picked)[0]
        assert sum(e.in_flight for e in router.registry.engines()) == 1
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(call.read(), DEADLINE)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "ext_proc_answer_timeout" in (ended.value.details() or "")  # not the client's deadline
        assert all(e.in_flight == 0 for e in router.registry.engines())
        assert streams(router, "answer_timeout") == 1
        counted = metric_value(
            router,
            "vllm_stack_router_requests_total",
            model="stub-model",
            engine=endpoint,
            status="answer_timeout",
        )
        assert counted == 1


async def test_an_invalid_client_request_id_is_replaced_not_passed_on() -> None:
    async with picker() as (target, _, _, _):
        for bad in ("has spaces", "x" * 200):
            ex = await exchange(target, [*HEADERS, ("x-request-id", bad)], orjson.dumps(BODY))
            assert ex.set_header_keys("request_headers").count("x-request-id") == 1
            given = ex.header("request_headers", "x-request-id")
            assert given != bad and given is not None and valid_request_id(given.encode())
        ok = await exchange(target, [*HEADERS, ("x-request-id", "req-7")], orjson.dumps(BODY))
        assert ok.set_header_keys("request_headers").count("x-request-id") == 1
        assert ok.header("request_headers", "x-request-id") == "req-7"


def _at(method: str, path: str) -> list[tuple[str, str]]:
    return [(":method", method), (":path", path), *HEADERS[2:]]


async def test_a_path_the_router_would_not_proxy_is_refused_not_picked() -> None:
    data = orjson.dumps(BODY)
    async with picker() as (target, router, _, _):
        for method, path, with_body, expected in (
            ("POST", "/v1/nope", True, (404, "not_found")),
            ("POST", "/v1/load_lora_adapter", True, (404, "not_found")),
            ("POST", "/v1/files", True, (404, "not_found")),
            ("GET", "/nope", False, (404, "not_found")),
            ("GET", "/v1/completions", False, (405, "method_not_allowed")),
            ("POST", "/v1/models", True, (405, "method_not_allowed")),
        ):
            ex = await exchange(target, _at(method, path), data if with_body else b"")
            assert ex.kinds == ["immediate_response"], (method, path)
            assert refusal(ex.answers[0]) == expected, (method, path)
        assert streams(router, "picked") == streams(router, "header_only") == 0
        assert router.picker_server.service.buffered == 0
        query = await exchange(target, _at("POST", "/v1/completions?stream=0"), data)
        assert query.kinds == ["request_headers", "request_body"]
        models = await exchange(target, _at("GET", "/v1/models"), b"")
        assert models.kinds == ["request_headers"]


async def _until_closed(reader: asyncio.StreamReader) -> None:
    while await reader.read(1 << 16):
        pass


async def test_gateway_connections_are_capped() -> None:
    """Past ext_proc_max_connections a connection is closed as it comes, those within it are kept; once
    they go, the picker is reached again."""
    async with picker(ext_proc_max_connections=4, ext_proc_idle_timeout=60) as (target, _, _, _):
        host, port = target.rsplit(":", 1)
        opened = [await asyncio.open_connection(host, int(port)) for _ in range(10)]
        for _, writer in opened:
            writer.write(H2_PREFACE)
        closed = [asyncio.ensure_future(_until_closed(reader)) for reader, _ in opened]
        try:
            await wait_for(
                lambda: sum(t.done() for t in closed) >= 6, what="the connections past the cap closed"
            )
            assert sum(t.done() for t in closed) == 6  # the 4 within it stay (idle for far less than 60 s)
        finally:
            for task in closed:
                task.cancel()
            for _, writer in opened:
                writer.close()
        picked = None
        async with asyncio.timeout(DEADLINE):
            while picked is None:  # until the picker has seen the 4 close
                with contextlib.suppress(grpc.aio.AioRpcError):
                    picked = await exchange(target, HEADERS, orjson.dumps(BODY))
        assert picked.kinds == ["request_headers", "request_body"]


async def test_idle_gateway_connections_are_closed() -> None:
    """A connection with no stream, and one that never finished its HTTP/2 preface, are closed after
    the idle timeout."""
    async with picker(ext_proc_idle_timeout=0.5) as (target, _, _, _):
        host, port = target.rsplit(":", 1)
        idle = await asyncio.open_connection(host, int(port))
        idle[1].write(H2_PREFACE)
        silent = await asyncio.open_connection(host, int(port))
        try:
            async with asyncio.timeout(DEADLINE):
                await _until_closed(idle[0])
                await _until_closed(silent[0])
        finally:
            idle[1].close()
            silent[1].close()
