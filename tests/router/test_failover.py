"""Retries, circuit breaking, mid-stream failures and client disconnects over stub engines.

Stub engines are used because these tests need an engine that fails on demand (a 503, a broken
stream); the real-engine versions (kill before responding, disconnect abort) are in test_engines.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import httpx

from tests.fakes.raw_engine import raw_engine
from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import http, metric_value, running_router, stubs, wait_for

MSG = [{"role": "user", "content": "hi"}]
BODY = {"model": "stub-model", "messages": MSG, "max_tokens": 3}


def requests_to(engine: StubEngine) -> int:
    return sum(1 for s in engine.seen if s.path == "/v1/chat/completions")


async def test_retry_on_503_goes_to_another_engine(router2) -> None:
    url, router, engines = router2
    engines[0].behaviour.fail_statuses = [503]
    async with http(url) as h:
        codes = [(await h.post("/v1/chat/completions", json=BODY)).status_code for _ in range(2)]
    assert codes == [200, 200]  # round-robin: one of the two went to engines[0] first
    assert requests_to(engines[0]) + requests_to(engines[1]) == 3  # one failed attempt, retried elsewhere
    assert metric_value(router, "vllm_stack_router_retries_total", model="stub-model", reason="503") == 1


async def test_retry_on_429(router2) -> None:
    url, router, engines = router2
    engines[1].behaviour.fail_statuses = [429]
    async with http(url) as h:
        codes = [(await h.post("/v1/chat/completions", json=BODY)).status_code for _ in range(2)]
    assert codes == [200, 200]
    assert metric_value(router, "vllm_stack_router_retries_total", model="stub-model", reason="429") == 1


async def test_when_every_engine_fails_the_last_answer_passes_through_unchanged(router2) -> None:
    url, _, engines = router2
    for e in engines:
        e.behaviour.fail_statuses = [500, 500, 500]
    async with http(url) as h:
        r = await h.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 500
    assert r.json()["error"]["message"].startswith("stub ")  # the engine's own body
    assert sum(requests_to(e) for e in engines) == 2  # no third engine to try


async def test_retry_on_connection_refused_and_passive_ejection() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    live = StubEngine("live", ["stub-model"])
    doomed = StubEngine("doomed", ["stub-model"])
    async with stubs(live) as live_urls:
        from tests.fakes.stub_engine import serve

        async with serve(doomed, port=dead_port) as doomed_url:
            cm = running_router(
                [live_urls[0], doomed_url], health_check_interval=30, engine_scrape_interval=30, retries=2
            )
            url, router = await cm.__aenter__()
        # the doomed engine is gone now, but the router still believes it healthy (no check or scrape,
        # whose refused connect would eject it too, for 30 s): the request path must find out itself
        try:
            async with http(url) as h:
                codes = [(await h.post("/v1/chat/completions", json=BODY)).status_code for _ in range(4)]
            assert codes == [200] * 4
            doomed_engine = router.registry.get(f"127.0.0.1:{dead_port}")
            assert doomed_engine is not None and not doomed_engine.healthy
            assert doomed_engine.ejected_reason == "connect_error"
            assert (
                metric_value(
                    router, "vllm_stack_router_retries_total", model="stub-model", reason="connect_error"
                )
                == 1
            )
        finally:
            await cm.__aexit__(None, None, None)


async def test_circuit_breaker_opens_then_half_open_probe_closes_it(two_stubs) -> None:
    engines, urls = two_stubs
    async with running_router(urls, retries=0, circuit_failure_threshold=2, circuit_open_seconds=2.0) as (
        url,
        router,
    ):
        bad = router.registry.get(urls[0].removeprefix("http://"))
        assert bad is not None
        engines[0].behaviour.fail_statuses = [500] * 2
        async with http(url) as h:
            for _ in range(4):  # round-robin: two of these hit the bad engine
                await h.post("/v1/chat/completions", json=BODY)
            assert bad.breaker.state.name == "OPEN"
            assert metric_value(router, "vllm_stack_router_circuit_breaker_state", engine=bad.name) == 2
            before = requests_to(engines[0])
            for _ in range(4):
                assert (await h.post("/v1/chat/completions", json=BODY)).status_code == 200
            assert requests_to(engines[0]) == before  # open: no traffic
            await wait_for(bad.breaker.available, what="the breaker's cool-down over")
            for _ in range(4):
                assert (await h.post("/v1/chat/completions", json=BODY)).status_code == 200
            assert requests_to(engines[0]) > before  # the probe went through and closed it
            assert bad.breaker.state.name == "CLOSED"
            assert metric_value(router, "vllm_stack_router_circuit_breaker_state", engine=bad.name) == 0


async def test_no_retry_after_stream_started_and_sse_error_event() -> None:
    """With stream continuation off (on, test_stream_continuation.py), a stream that began is never
    sent again: it ends with an error event."""
    a, b = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    for e in (a, b):
        e.behaviour.break_after_chunks = 2
    async with stubs(a, b) as urls, running_router(urls, stream_continuation=False) as (url, router):
        async with http(url) as h:
            async with h.stream(
                "POST", "/v1/chat/completions", json={**BODY, "stream": True, "max_tokens": 6}
            ) as r:
                assert r.status_code == 200
                lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
    assert len(lines) == 3
    assert '"error"' in lines[-1] and "mid-stream" in lines[-1]
    assert requests_to(a) + requests_to(b) == 1  # no retry once bytes reached the client
    assert (
        metric_value(
            router,
            "vllm_stack_router_requests_total",
            model="stub-model",
            engine=router.registry.engines()[0].name,
            status="upstream_error",
        )
        + metric_value(
            router,
            "vllm_stack_router_requests_total",
            model="stub-model",
            engine=router.registry.engines()[1].name,
            status="upstream_error",
        )
        == 1
    )


async def test_client_disconnect_aborts_upstream() -> None:
    engine = StubEngine("e", ["stub-model"])
    engine.behaviour.token_delay_s = 0.2
    async with stubs(engine) as urls, running_router(urls) as (url, router):
        async with httpx.AsyncClient(base_url=url) as h:
            async with h.stream(
                "POST", "/v1/chat/completions", json={**BODY, "stream": True, "max_tokens": 50}
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # leave after the first token
        await wait_for(lambda: engine.aborted == 1 and engine.running == 0, within=5, what="engine abort")
        eng = router.registry.engines()[0]
        await wait_for(lambda: eng.in_flight == 0, within=5, what="router in-flight back to 0")
        assert (
            metric_value(
                router,
                "vllm_stack_router_requests_total",
                model="stub-model",
                engine=eng.name,
                status="client_closed",
            )
            == 1
        )
        assert metric_value(router, "vllm_stack_router_in_flight_requests", engine=eng.name) == 0


async def test_client_disconnect_during_non_streaming_request_aborts_upstream() -> None:
    engine = StubEngine("e", ["stub-model"])
    engine.behaviour.delay_s = 1.0
    async with stubs(engine) as urls, running_router(urls) as (url, router):
        async with httpx.AsyncClient(base_url=url, timeout=0.3) as h:
            try:
                await h.post("/v1/chat/completions", json=BODY)
            except httpx.ReadTimeout:
                pass
        eng = router.registry.engines()[0]
        await wait_for(lambda: eng.in_flight == 0, within=5, what="router in-flight back to 0")
        assert (
            metric_value(
                router,
                "vllm_stack_router_requests_total",
                model="stub-model",
                engine=eng.name,
                status="client_closed",
            )
            == 1
        )


async def test_engine_dying_while_request_in_flight_is_retried_elsewhere() -> None:
    """A fake engine that accepts the request and then resets the connection (as a killed engine
    does) before answering: nothing reached the client, so the router retries on the other engine."""
    models = b'{"object":"list","data":[{"id":"stub-model","object":"model","parent":null}]}'
    got_post = asyncio.Event()

    async def dying_engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if data.startswith(b"POST"):
                got_post.set()
                await asyncio.sleep(0.3)
                writer.transport.abort()  # RST, no response byte
                return
            if data.startswith(b"GET /v1/models"):
                head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                writer.write(head % len(models) + models)
            else:
                writer.close()
                return

    server = await asyncio.start_server(dying_engine, "127.0.0.1", 0)
    dying_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    live = StubEngine("live", ["stub-model"])
    try:
        async with (
            stubs(live) as (live_url,),
            running_router([dying_url, live_url], health_check_interval=30) as (url, router),
        ):
            async with http(url) as h:
                r = await h.post("/v1/completions", json={"model": "stub-model", "prompt": "x"})
            assert got_post.is_set()
            assert r.status_code == 200 and r.json()["engine"] == "live"
            assert (
                metric_value(
                    router, "vllm_stack_router_retries_total", model="stub-model", reason="upstream_closed"
                )
                == 1
            )
    finally:
        server.close()


async def test_body_broken_before_anything_was_sent_is_retried() -> None:
    """Headers arrive, then the engine dies inside a non-streamed body: the router had not sent
    anything yet (it forwards a non-streamed body whole), so it retries elsewhere."""

    async def half_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        models = b'{"object":"list","data":[{"id":"stub-model","object":"model","parent":null}]}'
        while data := await reader.read(65536):
            if data.startswith(b"POST"):
                writer.write(
                    b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{"id":'
                )
                await writer.drain()
                writer.transport.abort()
                return
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            writer.write(head % len(models) + models)

    server = await asyncio.start_server(half_answer, "127.0.0.1", 0)
    broken_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    live = StubEngine("live", ["stub-model"])
    try:
        async with stubs(live) as (live_url,), running_router([broken_url, live_url]) as (url, router):
            async with http(url) as h:
                r = await h.post("/v1/completions", json={"model": "stub-model", "prompt": "x"})
            assert r.status_code == 200 and r.json()["engine"] == "live"
            assert (
                metric_value(
                    router, "vllm_stack_router_retries_total", model="stub-model", reason="upstream_broken"
                )
                == 1
            )
    finally:
        server.close()


async def test_a_poison_request_takes_no_engine_down() -> None:
    """A request after which every engine closes the connection without answering (as a request that
    crashes an engine's HTTP layer would): one 502 of the router's own after at most 1 + retries
    attempts, no engine ejected, no breaker opened, and the next 100 requests succeed. Raw-socket fake
    engines, because a real vLLM engine cannot be told to close on one request only."""
    poison_seen = 0

    async def engine(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        nonlocal poison_seen
        if b"poison" in body:
            poison_seen += 1
            return False  # closes without a byte of answer
        answer = b'{"ok":true}'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(answer), answer))
        return True

    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(raw_engine(engine)) for _ in range(3)]
        async with running_router(urls, retries=2) as (url, router), http(url) as h:
            r = await h.post("/v1/completions", json={"model": "stub-model", "prompt": "poison"})
            assert r.status_code == 502 and r.headers["x-vllm-stack-error"] == "upstream_closed", r.text
            assert r.json()["error"]["code"] == "upstream_closed"
            assert 1 <= poison_seen <= 3
            engines = router.registry.engines()
            assert all(e.healthy for e in engines), [e.describe() for e in engines]
            assert all(e.breaker.state.name == "CLOSED" for e in engines)
            codes = [
                (await h.post("/v1/completions", json={"model": "stub-model", "prompt": "x"})).status_code
                for _ in range(100)
            ]
            assert codes == [200] * 100
            assert all(e.healthy and e.breaker.state.name == "CLOSED" for e in router.registry.engines())
