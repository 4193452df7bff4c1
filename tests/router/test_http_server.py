"""The router's HTTP/1.1 front end, seen from the wire: keep-alive, pipelining, closing, chunked and
``Expect: 100-continue`` request bodies, body limits, malformed input, HEAD, streaming without
buffering, disconnects, slow readers and many connections.

Black-box tests over raw sockets (``asyncio.open_connection``) so they hold for whatever server
carries the router. Checks that test_proxy/test_errors/test_failover already make through httpx are
repeated here only where the wire itself matters (framing, timing, a raw close or reset).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import orjson
import pytest

from tests.fakes.stub_engine import StubBehaviour, StubEngine
from tests.router.helpers import metric_value, running_router, stubs, wait_for

MSG = [{"role": "user", "content": "hi"}]
TIMEOUT = 5.0  # for any single read; a hang fails the test instead of stalling the suite


# ---- a tiny HTTP/1.1 client ------------------------------------------------------------------------
@dataclass
class Response:
    version: str
    status: int
    headers: list[tuple[str, str]]  # names lower-cased, in wire order
    body: bytes = b""

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)

    def json(self) -> object:
        return orjson.loads(self.body)


def request(
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Iterable[tuple[str, str]] = (),
    version: str = "HTTP/1.1",
) -> bytes:
    """One request's bytes: a Host header, the given headers, Content-Length when there is a body."""
    lines = [f"{method} {path} {version}", "Host: router.test"]
    headers = list(headers)
    lines += [f"{k}: {v}" for k, v in headers]
    if body is not None and not any(k.lower() in ("content-length", "transfer-encoding") for k, _ in headers):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def chat(max_tokens: int = 3, stream: bool = False, **extra: object) -> bytes:
    return orjson.dumps(
        {"model": "stub-model", "messages": MSG, "max_tokens": max_tokens, "stream": stream, **extra}
    )


def post_chat(body: bytes, headers: Iterable[tuple[str, str]] = (), version: str = "HTTP/1.1") -> bytes:
    return request(
        "POST",
        "/v1/chat/completions",
        body,
        [("Content-Type", "application/json"), *headers],
        version,
    )


async def read_head(reader: asyncio.StreamReader) -> Response:
    """The status line and headers of the next response (an interim 1xx one included)."""
    line = await asyncio.wait_for(reader.readline(), TIMEOUT)
    if not line:
        raise EOFError("connection closed before a response")
    version, status, *_ = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
    headers = []
    while True:
        line = await asyncio.wait_for(reader.readline(), TIMEOUT)
        if line in (b"\r\n", b"\n"):
            break
        if not line:
            raise EOFError("connection closed inside the response headers")
        name, _, value = line.decode("latin-1").partition(":")
        headers.append((name.strip().lower(), value.strip()))
    return Response(version, int(status), headers)


def has_body(head: Response, method: str) -> bool:
    return not (method == "HEAD" or head.status < 200 or head.status in (204, 304))


async def body_parts(reader: asyncio.StreamReader, head: Response) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive: chunked, by Content-Length, or up to the connection's close."""
    if "chunked" in (head.header("transfer-encoding") or "").lower():
        while True:
            size_line = await asyncio.wait_for(reader.readline(), TIMEOUT)
            if not size_line:
                raise EOFError("connection closed inside a chunked body")
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while (await asyncio.wait_for(reader.readline(), TIMEOUT)) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            data = await asyncio.wait_for(reader.readexactly(size), TIMEOUT)
            assert await asyncio.wait_for(reader.readexactly(2), TIMEOUT) == b"\r\n"
            yield data
    elif (length := head.header("content-length")) is not None:
        left = int(length)
        while left:
            data = await asyncio.wait_for(reader.read(min(left, 65536)), TIMEOUT)
            if not data:
                raise EOFError("connection closed inside a Content-Length body")
            left -= len(data)
            yield data
    else:
        while data := await asyncio.wait_for(reader.read(65536), TIMEOUT):
            yield data


async def read_response(reader: asyncio.StreamReader, method: str = "GET") -> Response:
    """The next complete response (final or interim) from ``reader``."""
    head = await read_head(reader)
    if has_body(head, method):
        head.body = b"".join([part async for part in body_parts(reader, head)])
    return head


async def read_final(reader: asyncio.StreamReader, method: str = "GET") -> Response:
    """The next final response, skipping interim 1xx ones."""
    while (resp := await read_response(reader, method)).status < 200:
        pass
    return resp


async def closed_by_peer(reader: asyncio.StreamReader, within: float = TIMEOUT) -> bool:
    """True when the server closes the connection (EOF or reset) before ``within`` seconds pass."""
    try:
        return await asyncio.wait_for(reader.read(1), within) == b""
    except (ConnectionError, asyncio.IncompleteReadError):
        return True
    except TimeoutError:
        return False


@contextlib.asynccontextmanager
async def connect(url: str) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port, limit=1 << 20)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def sse_data(body: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [
        line[5:].strip()
        for event in body.split(b"\n\n")
        for line in event.split(b"\n")
        if line.startswith(b"data:")
    ]


def assert_chat(resp: Response, max_tokens: int) -> dict:
    assert resp.status == 200, resp
    doc = resp.json()
    assert isinstance(doc, dict)
    assert doc["model"] == "stub-model"
    assert doc["choices"][0]["message"]["content"] == "tok " * max_tokens
    assert doc["engine"] in ("s1", "s2", "e")
    return doc


def assert_stream(resp: Response, max_tokens: int) -> None:
    assert resp.status == 200, resp
    assert (resp.header("content-type") or "").startswith("text/event-stream")
    data = sse_data(resp.body)
    assert data[-1] == b"[DONE]"
    contents = [orjson.loads(d)["choices"][0]["delta"]["content"] for d in data[:-1]]
    assert contents == [f"t{i} " for i in range(max_tokens)]


def assert_openai_error(resp: Response, status: int, code: str | None = None) -> dict:
    assert resp.status == status, resp
    assert resp.header("content-type") == "application/json"
    doc = resp.json()
    assert isinstance(doc, dict)
    err = doc["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return err


def seen_with_id(engines: list[StubEngine], request_id: str) -> list:
    return [s for e in engines for s in e.seen if s.headers.get("x-request-id") == request_id]


# ---- connection management ---------------------------------------------------------------------------
async def test_keep_alive_serves_sequential_requests_on_one_connection(router2) -> None:
    """One HTTP/1.1 connection carries a GET, a non-streamed POST and a streamed POST one after the
    other (and then one more request): a persistent connection is not closed after any kind of answer,
    streamed ones included."""
    url, _, _ = router2
    async with connect(url) as (reader, writer):
        writer.write(request("GET", "/health"))
        resp = await read_final(reader)
        assert resp.status == 200 and resp.json() == {"status": "ok"}

        writer.write(post_chat(chat(max_tokens=4)))
        assert_chat(await read_final(reader, "POST"), 4)

        writer.write(post_chat(chat(max_tokens=3, stream=True)))
        streamed = await read_final(reader, "POST")
        assert_stream(streamed, 3)

        writer.write(request("GET", "/health"))
        resp = await read_final(reader)
        assert resp.status == 200
        for r in (resp, streamed):
            assert "close" not in (r.header("connection") or "").lower()
        assert not await closed_by_peer(reader, within=0.2)


async def test_pipelined_requests_are_answered_in_order(router2) -> None:
    """Two complete requests written in one write (HTTP/1.1 pipelining) are both answered, whole and
    in the order they were sent."""
    url, _, engines = router2
    async with connect(url) as (reader, writer):
        writer.write(
            post_chat(chat(max_tokens=2), [("X-Request-Id", "pipe-1")])
            + post_chat(chat(max_tokens=5), [("X-Request-Id", "pipe-2")])
        )
        first = await read_final(reader, "POST")
        second = await read_final(reader, "POST")
    assert_chat(first, 2)
    assert_chat(second, 5)
    assert first.header("x-request-id") == "pipe-1"
    assert second.header("x-request-id") == "pipe-2"
    assert len(seen_with_id(engines, "pipe-1")) == len(seen_with_id(engines, "pipe-2")) == 1


async def test_pipelined_responses_keep_order_when_the_first_is_slower() -> None:
    """A slow streamed request followed, in the same write, by a fast one: the fast answer waits
    for the slow one to finish, so the two responses never interleave on the wire."""
    engine = StubEngine("e", ["stub-model"], StubBehaviour(token_delay_s=0.1))
    async with stubs(engine) as urls, running_router(urls) as (url, _):
        async with connect(url) as (reader, writer):
            writer.write(
                post_chat(chat(max_tokens=4, stream=True), [("X-Request-Id", "slow")])
                + post_chat(chat(max_tokens=2), [("X-Request-Id", "fast")])
                + request("GET", "/health")
            )
            slow = await read_final(reader, "POST")
            fast = await read_final(reader, "POST")
            health = await read_final(reader)
    assert slow.header("x-request-id") == "slow"
    assert_stream(slow, 4)
    assert fast.header("x-request-id") == "fast"
    assert_chat(fast, 2)
    assert health.status == 200


async def test_connection_close_from_client_closes_after_the_answer(router2) -> None:
    """``Connection: close`` from the client: the request is answered in full, then the router
    closes the connection."""
    url, _, _ = router2
    async with connect(url) as (reader, writer):
        writer.write(post_chat(chat(max_tokens=3), [("Connection", "close")]))
        assert_chat(await read_final(reader, "POST"), 3)
        assert await closed_by_peer(reader)


async def test_http10_without_keep_alive_is_answered_then_closed(router2) -> None:
    """An HTTP/1.0 request without ``Connection: keep-alive``: answered, then the connection is
    closed (HTTP/1.0 connections are not persistent by default)."""
    url, _, _ = router2
    async with connect(url) as (reader, writer):
        writer.write(request("GET", "/health", version="HTTP/1.0"))
        resp = await read_final(reader)
        assert resp.status == 200 and resp.json() == {"status": "ok"}
        assert await closed_by_peer(reader)
    async with connect(url) as (reader, writer):
        writer.write(post_chat(chat(max_tokens=2), version="HTTP/1.0"))
        assert_chat(await read_final(reader, "POST"), 2)
        assert await closed_by_peer(reader)


async def test_http10_streamed_answer_is_not_chunked(router2) -> None:
    """An HTTP/1.0 client cannot decode chunked transfer coding (RFC 9112 section 6.1), so a streamed
    answer to it is delimited by closing the connection: the raw bytes after the headers are the
    SSE events themselves."""
    url, _, _ = router2
    async with connect(url) as (reader, writer):
        writer.write(post_chat(chat(max_tokens=3, stream=True), version="HTTP/1.0"))
        head = await read_head(reader)
        assert head.status == 200
        assert head.header("transfer-encoding") is None
        raw = b""
        while data := await asyncio.wait_for(reader.read(65536), TIMEOUT):
            raw += data
    head.body = raw
    assert_stream(head, 3)


# ---- request bodies ------------------------------------------------------------------------------------
async def test_chunked_request_body_reaches_the_engine_byte_for_byte(router2) -> None:
    """A request body sent with ``Transfer-Encoding: chunked`` in several chunks, with pauses between
    them (so they arrive in separate reads), is reassembled and forwarded upstream unchanged."""
    url, _, engines = router2
    body = chat(max_tokens=3, user="chunked-body-user")
    pieces = [body[:1], body[1:17], body[17:40], body[40:]]
    async with connect(url) as (reader, writer):
        writer.write(
            request(
                "POST",
                "/v1/chat/completions",
                headers=[
                    ("Content-Type", "application/json"),
                    ("Transfer-Encoding", "chunked"),
                    ("X-Request-Id", "chunked-1"),
                ],
            )
        )
        for piece in pieces:
            await writer.drain()
            await asyncio.sleep(0.03)
            writer.write(b"%X\r\n%s\r\n" % (len(piece), piece))
        await asyncio.sleep(0.03)
        writer.write(b"0\r\n\r\n")
        assert_chat(await read_final(reader, "POST"), 3)
        # the connection is still usable after a chunked request body
        writer.write(request("GET", "/health"))
        assert (await read_final(reader)).status == 200
    (seen,) = seen_with_id(engines, "chunked-1")
    assert seen.body == body


async def test_expect_100_continue(router2) -> None:
    """``Expect: 100-continue``: the router sends ``100 Continue`` before the client sends the body,
    then the normal answer; the Expect header itself stays on this hop."""
    url, _, engines = router2
    body = chat(max_tokens=2)
    async with connect(url) as (reader, writer):
        head = request(
            "POST",
            "/v1/chat/completions",
            headers=[
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
                ("Expect", "100-continue"),
                ("X-Request-Id", "expect-1"),
            ],
        )
        writer.write(head)
        interim = await read_head(reader)  # no body sent yet: only a 100 can come now
        assert interim.status == 100
        writer.write(body)
        assert_chat(await read_final(reader, "POST"), 2)
    (seen,) = seen_with_id(engines, "expect-1")
    assert seen.body == body
    assert "expect" not in seen.headers


async def test_body_over_max_body_bytes_is_413_without_reading_it(two_stubs) -> None:
    """With ``max_body_bytes=1000``: a declared Content-Length above the limit is answered 413 (an
    OpenAI-shaped error) from the headers alone, without the body ever being sent and without a
    ``100 Continue`` when the client asked for one; a chunked body is answered 413 as soon as it
    passes the limit, before it ends. The router keeps serving afterwards."""
    engines, urls = two_stubs
    async with running_router(urls, max_body_bytes=1000) as (url, _):
        for expect in ([], [("Expect", "100-continue")]):
            async with connect(url) as (reader, writer):
                writer.write(
                    request(
                        "POST",
                        "/v1/chat/completions",
                        headers=[("Content-Type", "application/json"), ("Content-Length", "5000"), *expect],
                    )
                )
                resp = await read_response(reader, "POST")  # no body was sent: the answer cannot wait for it
                assert_openai_error(resp, 413, "body_too_large")
                assert resp.header("x-request-id")

        async with connect(url) as (reader, writer):
            writer.write(
                request(
                    "POST",
                    "/v1/chat/completions",
                    headers=[("Content-Type", "application/json"), ("Transfer-Encoding", "chunked")],
                )
            )
            for _ in range(7):  # 2100 bytes, then the client stalls without ending the body
                writer.write(b"12C\r\n" + b"x" * 300 + b"\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
            assert_openai_error(await read_response(reader, "POST"), 413, "body_too_large")

        async with connect(url) as (reader, writer):
            writer.write(post_chat(chat(max_tokens=2)))
            assert_chat(await read_final(reader, "POST"), 2)
    assert not any(s.path == "/v1/chat/completions" and len(s.body) > 1000 for e in engines for s in e.seen)


#: (what, bytes, statuses allowed besides 4xx)
MALFORMED = [
    ("tls", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40) + b"\r\n\r\n", ()),
    ("not-http", b"THIS IS NOT HTTP\r\n\r\n", ()),
    ("no-version", b"GET /health\r\n\r\n", (505,)),  # an HTTP/0.9 simple request: 505 (RFC 9110 15.6.6)
    ("bad-header", b"GET /health HTTP/1.1\r\nHost: x\r\nno colon in this header\r\n\r\n", ()),
    (
        "bad-content-length",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
        (),
    ),
    (
        "bad-chunk-size",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n",
        (),
    ),
    ("bad-version", b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n", (505,)),
]


async def test_malformed_requests_get_4xx_or_a_close_never_500(router2) -> None:
    """Bytes that are not a valid HTTP/1.1 request (TLS on the plain port, non-HTTP text, a header
    without a colon, a non-numeric Content-Length, a bad chunk size...) get a 4xx answer or a closed
    connection within 2 s, never a 500 and never a hang; the connection that was open before and new
    connections keep being served."""
    url, _, _ = router2
    async with connect(url) as (other_reader, other_writer):
        other_writer.write(request("GET", "/health"))
        assert (await read_final(other_reader)).status == 200
        for what, garbage, also_allowed in MALFORMED:
            async with connect(url) as (reader, writer):
                writer.write(garbage)
                raw = b""
                try:
                    while data := await asyncio.wait_for(reader.read(65536), 2.0):
                        raw += data
                        if b"\r\n\r\n" in raw:
                            break
                except ConnectionError:
                    pass
                except TimeoutError:
                    raise AssertionError(f"{what}: neither an answer nor a close within 2 s") from None
                if raw:
                    status = int(raw.split(b" ", 2)[1])
                    assert 400 <= status < 500 or status in also_allowed, (what, raw)
            other_writer.write(post_chat(chat(max_tokens=2)))
            assert_chat(await read_final(other_reader, "POST"), 2)
            async with connect(url) as (reader, writer):
                writer.write(request("GET", "/health"))
                assert (await read_final(reader)).status == 200, what


async def test_router_errors_carry_a_request_id_and_keep_the_connection(router2) -> None:
    """Errors the router answers itself (a non-JSON body: 400, a wrong method: 405, an unknown
    path: 404) are OpenAI-shaped, each carries an ``x-request-id``, and the connection stays usable
    after them."""
    url, _, engines = router2
    async with connect(url) as (reader, writer):
        for req, method, status, code in (
            (post_chat(b"this is not json"), "POST", 400, "invalid_json"),
            (request("GET", "/v1/chat/completions"), "GET", 405, "method_not_allowed"),
            (request("GET", "/no/such/path"), "GET", 404, "not_found"),
            (
                request("POST", "/no/such/path", b"{}", [("Content-Type", "application/json")]),
                "POST",
                404,
                "not_found",
            ),
        ):
            writer.write(req)
            resp = await read_final(reader, method)
            assert_openai_error(resp, status, code)
            assert resp.header("x-request-id"), resp.headers
        writer.write(post_chat(chat(max_tokens=2)))
        assert_chat(await read_final(reader, "POST"), 2)
    assert not any(e.seen for e in engines if any(s.body == b"this is not json" for s in e.seen))


async def test_head_health_has_no_body(router2) -> None:
    """``HEAD /health`` is 200 with headers and no body bytes at all: the next response on the same
    connection starts right after the HEAD response's headers."""
    url, _, _ = router2
    async with connect(url) as (reader, writer):
        writer.write(request("HEAD", "/health") + request("GET", "/health"))
        head = await read_final(reader, "HEAD")
        assert head.status == 200 and head.body == b""
        nxt = await read_final(reader)
        assert nxt.status == 200 and nxt.json() == {"status": "ok"}


@pytest.mark.parametrize(
    ("path", "headers", "status"),
    [
        ("/no/such/path", [("Authorization", "Bearer k1")], 404),
        ("/v1/chat/completions", [("Authorization", "Bearer k1")], 405),
        ("/v1/models", [], 401),
        ("/v1/models", [("Authorization", "Bearer wrong")], 401),
    ],
    ids=["404", "405", "401-missing", "401-wrong"],
)
async def test_head_errors_have_no_body(path: str, headers: list[tuple[str, str]], status: int) -> None:
    """RFC 9110 9.3.2: an error answer to HEAD carries the GET's headers (its Content-Length too)
    and no body, so the next answer on a keep-alive connection is read as one."""
    async with (
        stubs(StubEngine("e", ["stub-model"])) as urls,
        running_router(urls, environ={"VLLM_STACK_API_KEYS": "k1"}) as (url, _),
        connect(url) as (reader, writer),
    ):
        writer.write(request("HEAD", path, headers=headers) + request("GET", path, headers=headers))
        writer.write(request("GET", "/health"))
        head = await read_final(reader, "HEAD")
        got = await read_final(reader, "GET")
        assert (head.status, got.status) == (status, status), (head, got)
        assert head.header("content-length") == got.header("content-length") == str(len(got.body))
        assert head.header("x-vllm-stack-error") == got.header("x-vllm-stack-error")
        health = await read_final(reader)
        assert health.status == 200 and health.json() == {"status": "ok"}


# ---- streaming ------------------------------------------------------------------------------------------
async def test_stream_events_reach_the_client_as_they_are_produced() -> None:
    """Streamed SSE events are written to the socket as the engine produces them (no buffering in
    the router), with the engine's own headers passed through."""
    engine = StubEngine("e", ["stub-model"], StubBehaviour(token_delay_s=0.2))
    async with stubs(engine) as urls, running_router(urls) as (url, _):
        async with connect(url) as (reader, writer):
            t0 = time.monotonic()
            writer.write(post_chat(chat(max_tokens=4, stream=True)))
            head = await read_head(reader)
            assert head.status == 200
            assert head.header("x-stub-engine") == "e"
            assert head.header("content-length") is None
            arrivals: list[float] = []
            raw = b""
            async for part in body_parts(reader, head):
                raw += part
                while len(sse_data(raw)) > len(arrivals):
                    arrivals.append(time.monotonic() - t0)
    head.body = raw
    assert_stream(head, 4)
    assert len(arrivals) == 5, arrivals
    assert arrivals[0] < 0.2, arrivals  # the first token did not wait for the next ones
    assert arrivals[-1] - arrivals[0] > 0.5, arrivals


@pytest.mark.parametrize("how", ["close", "reset"])
async def test_client_leaving_mid_stream_aborts_upstream(how: str) -> None:
    """A client that closes (FIN) or resets (RST) its connection in the middle of a stream: the router
    cancels the upstream request (the engine sees the disconnect) and its in-flight count and gauge
    for that engine return to 0."""
    engine = StubEngine("e", ["stub-model"], StubBehaviour(token_delay_s=0.1))
    async with stubs(engine) as urls, running_router(urls) as (url, router):
        async with connect(url) as (reader, writer):
            writer.write(post_chat(chat(max_tokens=100, stream=True)))
            head = await read_head(reader)
            assert head.status == 200
            async for part in body_parts(reader, head):
                if sse_data(part):
                    break
            eng = router.registry.engines()[0]
            assert eng.in_flight == 1
            if how == "reset":
                writer.transport.abort()
            else:
                writer.close()
        await wait_for(lambda: engine.aborted == 1 and engine.running == 0, within=5, what="engine abort")
        await wait_for(lambda: eng.in_flight == 0, within=5, what="router in-flight back to 0")
        assert metric_value(router, "vllm_stack_router_in_flight_requests", engine=eng.name) == 0
        assert engine.completed == 0


async def test_slow_reader_gets_every_event_in_order(router2) -> None:
    """A client that asks for a long stream (2000 events) and reads nothing for a second still gets
    every event, in order, once it reads: back-pressure from a slow reader loses nothing."""
    url, _, _ = router2
    async with connect(url) as (reader, writer):
        writer.write(post_chat(chat(max_tokens=2000, stream=True)))
        await writer.drain()
        await asyncio.sleep(1.0)
        resp = await read_final(reader, "POST")
        assert_stream(resp, 2000)
        writer.write(request("GET", "/health"))  # and the connection is still fine
        assert (await read_final(reader)).status == 200


async def test_many_concurrent_keep_alive_connections(router2) -> None:
    """200 concurrent keep-alive connections, each sending a GET, a non-streamed and a streamed POST
    in turn, are all answered correctly."""
    url, _, _ = router2

    async def one(i: int) -> None:
        async with connect(url) as (reader, writer):
            writer.write(request("GET", "/health"))
            assert (await read_final(reader)).status == 200
            writer.write(post_chat(chat(max_tokens=1 + i % 3)))
            assert_chat(await read_final(reader, "POST"), 1 + i % 3)
            writer.write(post_chat(chat(max_tokens=2, stream=True)))
            assert_stream(await read_final(reader, "POST"), 2)

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(200)))
    assert time.monotonic() - t0 < 10


# ---- headers --------------------------------------------------------------------------------------------
async def test_keep_alive_and_proxy_connection_headers_stay_on_this_hop(router2) -> None:
    """Request headers that only describe the client's connection to the router (``Keep-Alive``,
    ``Proxy-Connection``) are not forwarded to the engine; end-to-end ones are, and the engine's
    response headers reach the client."""
    url, _, engines = router2
    async with connect(url) as (reader, writer):
        writer.write(
            post_chat(
                chat(max_tokens=2),
                [
                    ("Connection", "keep-alive"),
                    ("Keep-Alive", "timeout=5, max=100"),
                    ("Proxy-Connection", "keep-alive"),
                    ("X-Request-Id", "hop-1"),
                    ("X-Custom-End-To-End", "kept"),
                ],
            )
        )
        resp = await read_final(reader, "POST")
    assert_chat(resp, 2)
    assert resp.header("x-stub-engine") in ("s1", "s2")
    (seen,) = seen_with_id(engines, "hop-1")
    assert "keep-alive" not in seen.headers
    assert "proxy-connection" not in seen.headers
    assert seen.headers["x-custom-end-to-end"] == "kept"


async def test_h2c_upgrade_request_is_answered_over_http11(router2) -> None:
    """A cleartext HTTP/2 upgrade offer (what ``curl --http2`` sends to an http:// URL) is declined
    by answering normally over HTTP/1.1, and the upgrade headers are not forwarded upstream."""
    url, _, engines = router2
    async with connect(url) as (reader, writer):
        writer.write(
            post_chat(
                chat(max_tokens=2),
                [
                    ("Connection", "Upgrade, HTTP2-Settings"),
                    ("Upgrade", "h2c"),
                    ("HTTP2-Settings", "AAMAAABkAARAAAAAAAIAAAAA"),
                    ("X-Request-Id", "h2c-1"),
                ],
            )
        )
        resp = await read_final(reader, "POST")
    assert_chat(resp, 2)
    assert resp.version == "HTTP/1.1"
    (seen,) = seen_with_id(engines, "h2c-1")
    assert "upgrade" not in seen.headers
    assert "http2-settings" not in seen.headers


# ---- the bodies all connections hold together -------------------------------------------------------
@contextlib.asynccontextmanager
async def budget_server(**settings: object) -> AsyncIterator[tuple[str, object]]:
    """A router over one stub on a server the test can read (its ``buffered_body_bytes``)."""
    from vllm_stack.app import build_router
    from vllm_stack.server import RouterServer

    async with stubs(StubEngine("e", ["stub-model"])) as urls:
        router = build_router(
            {
                "static_backends": urls[0],
                "routing_logic": "roundrobin",
                "health_check_interval": 0.2,
                **settings,
            },
            environ={},
        )
        server = RouterServer(router, "127.0.0.1", 0, shutdown_grace=2.0)
        await server.start()
        try:
            await wait_for(lambda: router.registry.healthy_count == 1)
            yield server.url, server
        finally:
            await server.stop()


def padded_chat(size: int) -> bytes:
    """A chat completion body of exactly ``size`` bytes (padding in an ignored field)."""
    body = chat()
    return body[:-1] + b',"pad":"' + b"x" * (size - len(body) - 9) + b'"}'


async def test_bodies_past_the_buffer_budget_get_503_with_retry_after() -> None:
    """Issue 29: past max_buffered_body_bytes (here two bodies' worth) a request whose declared body
    would not fit is refused at once with 503 and Retry-After, before its body is read; the budget
    comes back as the held bodies are answered (then the same request goes through), and nothing of
    it is left held afterwards. (Issue 44: body bytes count as they arrive, so the two holders send
    all of their bodies but the last 1000 bytes.)"""
    mib = 1 << 20
    async with budget_server(max_body_bytes=mib, max_buffered_body_bytes=2 * mib) as (url, server):
        body = padded_chat(mib)
        most = post_chat(body)[:-1000]
        async with connect(url) as (r1, w1), connect(url) as (r2, w2), connect(url) as (r3, w3):
            w1.write(most)
            w2.write(most)
            await wait_for(lambda: server.buffered_body_bytes == 2 * (mib - 1000), what="two bodies held")
            w3.write(post_chat(body)[: -mib // 2])
            refused = await read_final(r3)
            assert_openai_error(refused, 503, "body_buffers_full")
            assert refused.header("retry-after") == "1"
            assert await closed_by_peer(r3)
            w1.write(body[-1000:])
            w2.write(body[-1000:])
            assert_chat(await read_final(r1, "POST"), 3)
            assert_chat(await read_final(r2, "POST"), 3)
        async with connect(url) as (reader, writer):
            writer.write(post_chat(body))
            assert_chat(await read_final(reader, "POST"), 3)
        await wait_for(lambda: server.buffered_body_bytes == 0, what="the budget given back")


async def test_chunked_bodies_count_against_the_buffer_budget_as_they_arrive() -> None:
    """A chunked body reserves the budget as its chunks arrive: the one that would pass it is a 503
    mid-body (and the connection closed); what it had reserved is given back."""
    mib = 1 << 20
    async with budget_server(max_body_bytes=mib, max_buffered_body_bytes=mib) as (url, server):
        async with connect(url) as (r1, w1), connect(url) as (r2, w2):
            w1.write(post_chat(padded_chat(mib))[:-1000])  # holds the whole budget but 1000 bytes
            await wait_for(lambda: server.buffered_body_bytes == mib - 1000, what="the first body held")
            chunk = b"x" * 4096
            w2.write(post_chat(b"", [("Transfer-Encoding", "chunked")]))
            w2.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            assert_openai_error(await read_final(r2), 503, "body_buffers_full")
            assert await closed_by_peer(r2)
        await wait_for(lambda: server.buffered_body_bytes == 0, what="the budget given back")


async def test_budget_is_given_back_on_every_exit() -> None:
    """Pipelined bodies, bodies refused for size, clients that leave mid-body: the budget's count
    is back at 0 once their connections are gone."""
    async with budget_server(max_body_bytes=64 * 1024) as (url, server):
        async with connect(url) as (reader, writer):
            writer.write(post_chat(chat()) * 3)
            for _ in range(3):
                assert_chat(await read_final(reader, "POST"), 3)
        given_back = lambda: server.buffered_body_bytes == 0  # noqa: E731
        async with connect(url) as (reader, writer):
            writer.write(post_chat(padded_chat(60_000))[:-10_000])
            await wait_for(lambda: server.buffered_body_bytes == 50_000, what="a body held")
        await wait_for(given_back, what="the left body given back")
        async with connect(url) as (reader, writer):
            writer.write(post_chat(b"", [("Transfer-Encoding", "chunked")]) + b"8000\r\n" + b"y" * 0x8000)
            await wait_for(lambda: server.buffered_body_bytes == 0x8000, what="chunks reserved")
        await wait_for(given_back, what="the left chunks given back")
        async with connect(url) as (reader, writer):
            writer.write(post_chat(padded_chat(100_000)))
            assert_openai_error(await read_final(reader), 413, "body_too_large")
        await wait_for(
            lambda: server.buffered_body_bytes == 0 and not server.connections, what="all given back"
        )


# ---- RFC 9110 / 9112 conformance beyond the corpus --------------------------------------------------
async def test_a_probe_past_the_connection_limit_is_answered_then_closed_without_a_503() -> None:
    """Issue 29: a connection past max_connections may still reach /health; once that is answered
    the connection is closed (``connection: close``), never sent an unsolicited 503 later."""
    async with (
        stubs(StubEngine("e", ["stub-model"])) as urls,
        running_router(urls, max_connections=1) as (url, _),
        connect(url) as _held,
        connect(url) as (reader, writer),
    ):
        writer.write(request("GET", "/health"))
        answer = await read_final(reader)
        assert answer.status == 200 and answer.header("connection") == "close", answer
        rest = await asyncio.wait_for(reader.read(), TIMEOUT)  # until the router closes
        assert rest == b"", rest


async def test_a_slow_request_head_gets_408_and_a_close() -> None:
    """Issue 29: a head still arriving after request_head_timeout (0.3 s here; default 30 s) is
    answered 408 and the connection closed, not held for minutes."""
    async with (
        stubs(StubEngine("e", ["stub-model"])) as urls,
        running_router(urls, request_head_timeout=0.3) as (url, router),
        connect(url) as (reader, writer),
    ):
        started = time.monotonic()
        writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\nX-Slow: 1\r\n")  # and never the end
        answer = await read_final(reader)
        assert_openai_error(answer, 408, "request_timeout")
        assert answer.header("connection") == "close"
        assert await closed_by_peer(reader)
        assert time.monotonic() - started < 3, "408 well after the timeout"
        assert router.head_timeout() == 0.3
