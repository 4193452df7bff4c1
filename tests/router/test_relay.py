"""The relay and the router's own server beyond plain proxying: TLS engines, graceful stop, pooled
connections of engines that leave, per-event stream metrics (stub engines, no real vLLM needed)."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from collections.abc import AsyncIterator, Callable

import pytest

from tests.fakes.raw_engine import Answer, raw_engine
from tests.fakes.stub_engine import StubBehaviour, StubEngine, serve
from tests.router.helpers import FAST, client, http, metric_value, running_router, stubs, wait_for
from vllm_stack.app import Router, build_router
from vllm_stack.engines.discovery.base import EndpointInfo
from vllm_stack.relay.leg import chunked_end, chunked_end_before_crlf
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


def _chat_request(max_tokens: int, stream: bool = False) -> bytes:
    """A raw chat completion request (the stop tests write on a connection they hold themselves)."""
    body = (
        b'{"model":"stub-model","messages":[{"role":"user","content":"hi"}],"stream":%b,"max_tokens":%d}'
        % (
            b"true" if stream else b"false",
            max_tokens,
        )
    )
    return (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(body), body))  # fmt: skip


async def test_stop_cuts_what_outlives_the_grace_period() -> None:
    """A stream longer than the grace period is cut when it ends, and the engine aborts it."""
    engine = StubEngine("slow", ["stub-model"], StubBehaviour(token_delay_s=0.2))
    async with stubs(engine) as urls:
        server = await started_server(urls[0], shutdown_grace=0.5)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(_chat_request(50, stream=True))
        await reader.readuntil(b"data:")
        await asyncio.wait_for(server.stop(), 5)
        rest = await asyncio.wait_for(reader.read(), 5)  # EOF: the connection was closed
        assert b"[DONE]" not in rest
        writer.close()
        await wait_for(lambda: engine.aborted == 1, what="the engine to abort the cut stream")


async def _read_answer(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One answer with a content-length body: its head and body."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(
        next(
            line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length")
        )
    )
    return head, await asyncio.wait_for(reader.readexactly(length), 5)


async def test_a_request_sent_on_a_kept_alive_connection_as_the_stop_begins_is_answered() -> None:
    """Issue 47: in a rolling upgrade a client's keep-alive connection to the old router is idle for a moment
    between two answers, and its next request may already be on the way when SIGTERM comes. Closing that
    connection at once failed the request (the client saw the connection close without an answer); it is
    answered instead, with `connection: close`, and the stop ends once it is."""
    async with stubs(StubEngine("e", ["stub-model"])) as urls:
        server = await started_server(urls[0], shutdown_grace=10.0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(_chat_request(2))
        head, _ = await _read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" not in head.lower()
        stopping = asyncio.ensure_future(server.stop())
        await wait_for(lambda: server.draining, what="the stop under way")
        writer.write(_chat_request(3))  # the client's next request, sent before it could know
        head, body = await _read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert b"connection: close" in head.lower() and b"tok tok tok" in body, (head, body)
        assert await asyncio.wait_for(reader.read(), 5) == b""  # then closed by the router
        writer.close()
        await asyncio.wait_for(stopping, 5)
        assert not server.connections


async def test_a_request_after_an_answer_begun_before_the_stop_is_answered() -> None:
    """Issue 47: an answer whose head went out before SIGTERM promised keep-alive; the client sends its next
    request on the same connection as soon as the answer ends. Closing the connection right after that
    answer failed the request (measured on the node: a reset 1 ms after it was sent); it is answered,
    with `connection: close`."""
    engine = StubEngine("slow", ["stub-model"], StubBehaviour(token_delay_s=0.05))
    async with stubs(engine) as urls:
        server = await started_server(urls[0], shutdown_grace=10.0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(_chat_request(10, stream=True))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert b"connection: close" not in head.lower() and b"transfer-encoding: chunked" in head.lower()
        stopping = asyncio.ensure_future(server.stop())
        await wait_for(lambda: server.draining, what="the stop under way")
        streamed = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 5)  # the last chunk
        assert b"[DONE]" in streamed
        writer.write(_chat_request(2))
        head, body = await _read_answer(reader)
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head.lower(), (head, body)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await asyncio.wait_for(stopping, 5)
    assert engine.completed == 2


async def test_a_stop_closes_connections_idle_past_the_drain_wait_without_waiting_the_grace() -> None:
    """A keep-alive connection no request comes on is closed once idle for ``drain_idle`` seconds: the
    stop does not last the grace period for it."""
    async with stubs(StubEngine("e", ["stub-model"])) as urls:
        router = build_router({**FAST, "static_backends": urls[0]}, environ={})
        server = RouterServer(router, "127.0.0.1", 0, shutdown_grace=30.0, drain_idle=0.3)
        await server.start()
        await wait_for(lambda: router.registry.healthy_count == 1)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(_chat_request(1))
        await _read_answer(reader)
        started = time.monotonic()
        await asyncio.wait_for(server.stop(), 10)
        assert time.monotonic() - started < 5
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()


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


@contextlib.asynccontextmanager
async def through_router(
    answer: Answer,
) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter, Router, str]]:
    """A client connection to a router over one raw engine that answers with ``answer``; yields the
    connection, the router and the engine's URL."""
    async with (
        raw_engine(answer) as engine_url,
        running_router([engine_url], health_check_interval=30) as (url, router),
    ):
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            yield reader, writer, router, engine_url
        finally:
            writer.close()


def test_chunked_end_finds_where_a_chunked_body_ends() -> None:
    """The end of a chunked body is found exactly, trailers included, whatever follows it."""
    body = b"5\r\nhello\r\n0\r\nx-t: 1\r\n\r\n"
    assert chunked_end(body) == len(body)
    assert chunked_end(body + b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n") == len(body)
    assert chunked_end(body + b"XXXX") == len(body)
    assert chunked_end(b"5\r\nhel") is None  # not ended yet
    assert chunked_end(b"lo\r\n0\r\n\r\n") is None  # starts inside a chunk: cannot be told


def test_chunked_end_before_crlf_tells_the_answers_crlfs_from_those_after_it() -> None:
    """Issue 44: of a chunked answer's last read that nothing but CR and LF may follow, the answer's
    part ends with its last line and CRLF CRLF (the last chunk's line may have come in the read before)."""
    assert chunked_end_before_crlf(b"", b"0\r\n\r\n\r\n") == 5
    assert chunked_end_before_crlf(b"", b"0\r\nx-t: 1\r\n\r\n\r\n\r\n") == len(b"0\r\nx-t: 1\r\n\r\n")
    assert chunked_end_before_crlf(b"...\r\n0", b"\r\n\r\n\r\n") == 4
    assert chunked_end_before_crlf(b"\r\n0\r\n\r", b"\n") == 1  # the answer's own last byte
    assert chunked_end_before_crlf(b"", b"\r\n") is None  # nothing before it: cannot be told


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

    async with through_router(answer) as (reader, writer, router, engine_url):
        body = b'{"model":"stub-model","stream":true,"messages":[{"role":"user","content":"h"}]}'
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        got = await asyncio.wait_for(reader.readuntil(b"data: [DO"), 5)
        forwarded.set()
        got += await asyncio.wait_for(reader.read(), 5)  # until the router closes
        assert got.startswith(b"HTTP/1.1 200 OK") and got.count(b"HTTP/1.1") == 1, got
        assert b"NE]" not in got, got
        assert router.pools.idle_connections(engine_url) == 0


PLAIN = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'
CHAT = b'{"model":"stub-model","messages":[{"role":"user","content":"h"}]}'
CHAT_REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%b" % (len(CHAT), CHAT)
)


class EngineConnections:
    """Which of a raw engine's connections each request came on (0, 1, ... in order of first use)."""

    def __init__(self) -> None:
        self.writers: list[asyncio.StreamWriter] = []
        self.requests: list[int] = []  # per request, its connection's number

    def saw(self, writer: asyncio.StreamWriter) -> int:
        """The request's connection number; and how many requests came on it before this one."""
        if not any(w is writer for w in self.writers):
            self.writers.append(writer)
        number = next(i for i, w in enumerate(self.writers) if w is writer)
        self.requests.append(number)
        return self.requests.count(number) - 1


async def plain_answers(engine_bytes: Callable[[int], bytes], count: int = 3) -> tuple[list[int], int]:
    """``count`` chat requests through a router, one after another on one client connection, to a
    raw engine that writes ``engine_bytes(n)`` for a request that came after ``n`` others on its
    connection. Each answer's head must start right where the last answer's Content-Length ended.
    Returns each request's engine connection (numbered in order of first use) and how many engine
    connections the router's pool holds afterwards."""
    seen = EngineConnections()

    async def answer(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(engine_bytes(seen.saw(writer)))
        await writer.drain()
        return True

    async with through_router(answer) as (reader, writer, router, engine_url):
        for _ in range(count):
            writer.write(CHAT_REQUEST)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n"), head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            assert await asyncio.wait_for(reader.readexactly(length), 5) == b'{"ok":true}'
        return seen.requests, router.pools.idle_connections(engine_url)


async def test_a_crlf_after_an_answer_is_not_forwarded_and_its_connection_not_reused() -> None:
    """Issue 44: an engine writes a bare CRLF after an answer of Content-Length 11. The upstream
    parser skips CRLF between messages (as HTTP allows), so the client got 13 bytes (h11, the OpenAI
    SDK's HTTP stack, then fails its next request on that connection) and the engine connection was
    pooled. Now the client's next answer starts where the first ended, and each request has an engine
    connection of its own."""
    assert await plain_answers(lambda _earlier: PLAIN + b"\r\n") == ([0, 1, 2], 0)


async def test_a_crlf_read_before_the_next_answer_is_dropped_and_ends_its_connection() -> None:
    """Issue 44: the CRLF an engine wrote after an answer may come in a read of its own, after the
    connection went back to the pool and carried the next request: it is not the next answer's (whose
    head the client gets as the engine framed it), and that connection is not reused afterwards (the
    third request takes a new one, which is pooled after its clean answer)."""
    requests, pooled = await plain_answers(lambda earlier: (b"\r\n" if earlier else b"") + PLAIN)
    assert (requests, pooled) == ([0, 0, 1], 1)
