"""The relay and the router's own server beyond plain proxying: TLS engines, graceful stop, pooled
connections of engines that leave, per-event stream metrics (stub engines, no real vLLM needed)."""

from __future__ import annotations

import asyncio
import subprocess

import pytest

from tests.fakes.raw_engine import raw_engine
from tests.fakes.stub_engine import StubBehaviour, StubEngine, serve
from tests.router.helpers import FAST, client, http, metric_value, running_router, stubs, wait_for
from vllm_stack.app import build_router
from vllm_stack.engines.discovery.base import EndpointInfo
from vllm_stack.relay.leg import chunked_end
from vllm_stack.server import RouterServer

MSG = [{"role": "user", "content": "hi"}]


async def started_server(engine_url: str, shutdown_grace: float) -> RouterServer:
    """A started router server over one engine, once the engine is healthy (the test stops it)."""
    router = build_router({**FAST, "static_backends": engine_url}, environ={})
    server = RouterServer(router, "127.0.0.1", 0, shutdown_grace=shutdown_grace)
    await server.start()
    await wait_for(lambda: router.registry.healthy_count == 1)
    return server


@pytest.fixture
def self_signed(tmp_path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1, made with the openssl command line."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert)]
        + ["-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    return str(cert), str(key)


async def test_https_engine_is_proxied_over_tls(self_signed) -> None:
    """Engines behind TLS, verified against engine_ca_file: health checks, streams and plain answers."""
    engine = StubEngine("tls", ["stub-model"])
    async with serve(engine, tls=self_signed) as url:
        assert url.startswith("https://")
        async with running_router([url], engine_ca_file=self_signed[0]) as (router_url, _):
            c = client(router_url)
            done = await c.chat.completions.create(model="stub-model", messages=MSG, max_tokens=3)
            assert done.choices[0].message.content == "tok " * 3
            stream = await c.chat.completions.create(
                model="stub-model", messages=MSG, max_tokens=4, stream=True
            )
            assert [chunk.choices[0].delta.content async for chunk in stream] == [f"t{i} " for i in range(4)]
    assert engine.completed == 2


async def test_stop_lets_a_running_stream_finish_and_refuses_new_connections() -> None:
    """SIGTERM semantics: the listener closes at once, an answer under way completes (within the
    grace period), its connection is closed after it, and only then does the router stop."""
    engine = StubEngine("slow", ["stub-model"], StubBehaviour(token_delay_s=0.1))
    async with stubs(engine) as urls:
        server = await started_server(urls[0], shutdown_grace=10.0)
        port = server.port
        async with http(server.url) as h:
            async with h.stream(
                "POST",
                "/v1/chat/completions",
                json={"model": "stub-model", "messages": MSG, "stream": True, "max_tokens": 10},
            ) as resp:
                stopping = asyncio.ensure_future(server.stop())
                await wait_for(lambda: server.draining, what="the stop under way (listener closed)")
                with pytest.raises(OSError):
                    await asyncio.open_connection("127.0.0.1", port)
                assert not stopping.done()
                lines = [line async for line in resp.aiter_lines() if line.startswith("data:")]
        await asyncio.wait_for(stopping, 10)
        assert not server.connections
    assert len(lines) == 11 and lines[-1] == "data: [DONE]"
    assert engine.completed == 1 and engine.aborted == 0


async def test_stop_cuts_what_outlives_the_grace_period() -> None:
    """A stream longer than the grace period is cut when it ends, and the engine aborts it."""
    engine = StubEngine("slow", ["stub-model"], StubBehaviour(token_delay_s=0.2))
    async with stubs(engine) as urls:
        server = await started_server(urls[0], shutdown_grace=0.5)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        body = b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":50}'
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body)
        )
        await reader.readuntil(b"data:")
        await asyncio.wait_for(server.stop(), 5)
        rest = await asyncio.wait_for(reader.read(), 5)  # EOF: the connection was closed
        assert b"[DONE]" not in rest
        writer.close()
        await wait_for(lambda: engine.aborted == 1, what="the engine to abort the cut stream")


async def test_an_engine_that_leaves_has_its_pooled_connections_closed(two_stubs) -> None:
    """Pods come and go: the idle keep-alive connections to a departed engine do not linger."""
    engines, urls = two_stubs
    async with running_router(urls) as (url, router):
        c = client(url)
        for _ in range(4):
            await c.chat.completions.create(model="stub-model", messages=MSG, max_tokens=1)
        assert all(router.pools.idle_connections(u) >= 1 for u in urls)
        keep = next(e for e in router.registry.engines() if e.url == urls[0])
        await router.registry.apply_snapshot([EndpointInfo(keep.name, keep.url)])
        assert router.pools.idle_connections(urls[1]) == 0
        assert router.pools.idle_connections(urls[0]) >= 1
        for _ in range(2):  # the remaining engine still serves, over its pooled connection
            await c.chat.completions.create(model="stub-model", messages=MSG, max_tokens=1)
        assert engines[0].completed >= 4


async def test_stream_metrics_count_every_event() -> None:
    """TTFT once per stream; ITL once per event after the first (per token, not per socket read)."""
    engine = StubEngine("e", ["stub-model"], StubBehaviour(token_delay_s=0.01))
    async with stubs(engine) as urls, running_router(urls) as (url, router):
        stream = await client(url).chat.completions.create(
            model="stub-model", messages=MSG, max_tokens=6, stream=True
        )
        assert len([chunk async for chunk in stream]) == 6
        ttft = metric_value(router, "vllm_stack_router_ttft_seconds_count", model="stub-model")
        itl = metric_value(router, "vllm_stack_router_itl_seconds_count", model="stub-model")
        assert ttft == 1
        assert itl == 6  # 6 token events + [DONE] = 7 events, 6 gaps


async def test_connections_beyond_the_limit_get_503_and_are_closed(two_stubs) -> None:
    """A connection flood cannot grow memory: past max_connections new ones get a 503 and a close,
    and the held ones keep working."""
    _, urls = two_stubs
    async with running_router(urls, max_connections=3) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        held = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
        reader, writer = await asyncio.open_connection(host, int(port))
        answer = await asyncio.wait_for(reader.read(), 5)  # answered and closed without a request
        assert answer.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in answer
        writer.close()
        r, w = held[0]
        w.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert (await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 200 ")
        for _, w in held:
            w.close()


async def test_an_engine_sending_an_endless_head_is_cut_not_buffered() -> None:
    """Memory stays bounded even against a broken engine: a response head that never ends is refused
    (502) instead of being buffered without limit. The fake engine answers its model list normally,
    so the router sees it healthy, and streams header lines forever to a chat request."""

    async def engine(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(10_000):  # 10 MB of headers if nobody stops it
            writer.write(b"x-filler: " + b"y" * 1000 + b"\r\n")
            await writer.drain()
        return False

    async with raw_engine(engine) as url:
        async with running_router([url], retries=0) as (router_url, _), http(router_url) as h:
            r = await h.post("/v1/chat/completions", json={"model": "stub-model", "messages": MSG})
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "upstream_broken"
        assert "too large" in r.json()["error"]["message"]


async def test_pipelined_bodies_beyond_one_body_limit_wait_and_are_all_answered() -> None:
    """Memory per connection stays bounded under pipelining: once the queued bodies reach the body
    limit the router stops reading, and reads on as the queue drains, answering everything in order."""
    engine = StubEngine("e", ["stub-model"], StubBehaviour(token_delay_s=0.05))
    async with stubs(engine) as urls, running_router(urls, max_body_bytes=2000) as (url, router):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        requests = []
        for i in range(6):  # ~1.5 KB each: three of them already pass the 2,000-byte limit
            body = b'{"model":"stub-model","prompt":"%s","max_tokens":2,"stream":true,"user":"%d"}' % (
                b"x" * 1450,
                i,
            )
            requests.append(
                b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"x-request-id: pipe-%d\r\ncontent-length: %d\r\n\r\n%b" % (i, len(body), body)
            )
        writer.write(b"".join(requests))
        ids = []
        for _ in range(6):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200 ")
            ids.append(head.lower().split(b"x-request-id: ")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readuntil(b"data: [DONE]\n\n\r\n0\r\n\r\n"), 10)
        writer.close()
    assert ids == [b"pipe-%d" % i for i in range(6)]


def test_chunked_end_finds_where_a_chunked_body_ends() -> None:
    """The end of a chunked body is found exactly, trailers included, whatever follows it."""
    body = b"5\r\nhello\r\n0\r\nx-t: 1\r\n\r\n"
    assert chunked_end(body) == len(body)
    assert chunked_end(body + b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n") == len(body)
    assert chunked_end(body + b"XXXX") == len(body)
    assert chunked_end(b"5\r\nhel") is None  # not ended yet
    assert chunked_end(b"lo\r\n0\r\n\r\n") is None  # starts inside a chunk: cannot be told


async def test_bytes_past_a_stream_that_cannot_be_placed_end_it() -> None:
    """Issue 29: an engine's stream whose last read starts inside a chunk and carries a second
    answer after the last chunk: where the answer ends cannot be told from that read, so none of it
    is forwarded; the client's connection is closed (no smuggled answer reaches it) and the upstream
    connection is not pooled."""
    forwarded = asyncio.Event()

    async def answer(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        writer.write(b"e\r\ndata: [DO")
        await writer.drain()
        await forwarded.wait()  # the router forwarded the first part: the rest is a read of its own
        writer.write(b"NE]\n\n\r\n0\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        return True

    async with (
        raw_engine(answer) as engine_url,
        running_router([engine_url], health_check_interval=30) as (url, router),
    ):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        body = b'{"model":"stub-model","stream":true,"messages":[{"role":"user","content":"h"}]}'
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        got = await asyncio.wait_for(reader.readuntil(b"data: [DO"), 5)
        forwarded.set()
        got += await asyncio.wait_for(reader.read(), 5)  # until the router closes
        writer.close()
        assert got.startswith(b"HTTP/1.1 200 OK") and got.count(b"HTTP/1.1") == 1, got
        assert b"NE]" not in got, got
        assert router.pools.idle_connections(engine_url) == 0
