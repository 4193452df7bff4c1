"""What request bodies may hold of the router (issue 44): body bytes are counted as they arrive (a head
alone holds nothing), a body that stops sending gets 408 after ``request_body_timeout`` (a buffered one
and an upload streamed to disk alike), and with client keys one key holds at most its share
(``max_body_share_per_key``) of ``max_buffered_body_bytes``. Raw sockets, one stub engine."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from tests.batch.test_uploads import batch_server
from tests.router.helpers import wait_for
from tests.router.test_http_server import (
    assert_chat,
    assert_openai_error,
    budget_server,
    chat,
    closed_by_peer,
    connect,
    padded_chat,
    post_chat,
    read_final,
    request,
)
from vllm_stack.app import build_router
from vllm_stack.server import RouterServer
from vllm_stack.server.http1 import HttpConnection

MIB = 1 << 20
ENGINE = "http://127.0.0.1:9"  # the discard port: for routers that are built but never started


def head_only(declared: int, key: str | None = None) -> bytes:
    """A chat completion's head declaring ``declared`` body bytes, none of which follow."""
    auth = [("Authorization", f"Bearer {key}")] if key else []
    return request(
        "POST",
        "/v1/chat/completions",
        headers=[("Content-Type", "application/json"), ("Content-Length", str(declared)), *auth],
    )


async def test_heads_alone_hold_nothing_and_get_408_once_silent_for_the_body_timeout() -> None:
    """Eight connections each send only a head declaring a body of the limit (four times the
    budget together): before issue 44 their declared lengths were reserved, so two of them took the
    whole budget and every other body got 503. Now they hold nothing: a normal client's requests go
    through meanwhile; and having sent no body byte for request_body_timeout (1 s here; default 60 s)
    each holder gets 408 and its connection is closed, so none holds anything for minutes."""
    settings = {"max_body_bytes": MIB, "max_buffered_body_bytes": 2 * MIB, "request_body_timeout": 1.0}
    async with budget_server(**settings) as (url, server), contextlib.AsyncExitStack() as stack:
        holders = [await stack.enter_async_context(connect(url)) for _ in range(8)]
        for _, writer in holders:
            writer.write(head_only(MIB))
        await wait_for(
            lambda: sum(bool(c.head_started) for c in server.connections) == 8, what="eight heads read"
        )
        assert server.buffered_body_bytes == 0
        async with connect(url) as (reader, writer):
            for _ in range(3):
                writer.write(post_chat(chat()))
                assert_chat(await read_final(reader, "POST"), 3)
            writer.write(post_chat(padded_chat(MIB)))  # a body as large as the holders declared
            assert_chat(await read_final(reader, "POST"), 3)
        for reader, _ in holders:
            answer = await read_final(reader, "POST")
            assert_openai_error(answer, 408, "request_timeout")
            assert answer.header("connection") == "close"
            assert await closed_by_peer(reader)
        await wait_for(lambda: server.buffered_body_bytes == 0 and not server.connections, what="all gone")


async def test_a_body_that_stops_sending_gets_408_and_gives_its_bytes_back() -> None:
    """Half a body, then silence: what it sent is held until request_body_timeout (0.5 s here)
    passes without a byte; then 408, the connection closed, and the bytes given back."""
    settings = {"max_body_bytes": MIB, "request_body_timeout": 0.5}
    async with budget_server(**settings) as (url, server), connect(url) as (reader, writer):
        whole = post_chat(padded_chat(MIB))
        started = time.monotonic()
        writer.write(whole[: -MIB // 2])
        await wait_for(lambda: server.buffered_body_bytes == MIB // 2, what="half the body held")
        answer = await read_final(reader, "POST")
        assert time.monotonic() - started >= 0.5
        assert_openai_error(answer, 408, "request_timeout")
        assert await closed_by_peer(reader)
        await wait_for(lambda: server.buffered_body_bytes == 0, what="the body's bytes given back")


class _Transport:
    """What a connection writes, for driving one directly (its clock is the test's)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def can_write_eof(self) -> bool:
        return False

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default


async def test_a_body_that_keeps_sending_is_not_timed_out_however_long_it_takes() -> None:
    """The body timeout runs from the last byte, not from the head: each sweep that sees the body
    grown starts it again. Driven with the sweep's own call and made-up times (a paced socket client
    would depend on this machine's load)."""
    router = build_router({"static_backends": ENGINE, "max_body_bytes": MIB}, environ={})
    server = RouterServer(router, "127.0.0.1", 0)  # not started: only what a connection asks of it
    conn = HttpConnection(server)
    transport = _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    whole = post_chat(padded_chat(10_000))
    conn.data_received(whole[:-9000])
    t = conn.head_started
    for step in range(1, 9):  # 1,000 bytes every 0.6 s against a 1 s timeout: 4.8 s in all
        conn.check_reading(t + 0.6 * step - 0.3, 30.0, 1.0)
        conn.data_received(whole[-9000 + (step - 1) * 1000 : -9000 + step * 1000])
        conn.check_reading(t + 0.6 * step, 30.0, 1.0)
    assert not transport.written, b"".join(transport.written)[:200]
    conn.check_reading(t + 4.8 + 0.9, 30.0, 1.0)
    assert not transport.written
    conn.check_reading(t + 4.8 + 1.1, 30.0, 1.0)
    assert b"".join(transport.written).startswith(b"HTTP/1.1 408 "), transport.written
    conn.connection_lost(None)
    assert server.buffered_body_bytes == 0


async def test_one_key_holds_at_most_its_share_of_the_budget(tmp_path: Path) -> None:
    """With client keys, one key's bodies together hold at most max_body_share_per_key of the budget
    (a quarter of 4 MiB here, which is also the 1 MiB body limit: a key may always send one
    largest body). Past it that key's requests get 429 body_share_exceeded with Retry-After (a large
    declared one on its head, a small one as its bytes pass the share) while another key's requests
    go through; once its body is answered the key has its share back."""
    keys = tmp_path / "keys.txt"
    keys.write_text("key-a\nkey-b\n")
    settings = {
        "max_body_bytes": MIB,
        "max_buffered_body_bytes": 4 * MIB,
        "max_body_share_per_key": 0.25,
        "api_keys_file": str(keys),
    }
    a = [("Authorization", "Bearer key-a")]
    b = [("Authorization", "Bearer key-b")]
    async with budget_server(**settings) as (url, server):
        body = padded_chat(MIB)
        async with connect(url) as (r1, w1):
            w1.write(post_chat(body, a)[:-1000])  # key-a holds its share but 1000 bytes
            await wait_for(lambda: server.budget.held_by(b"key-a") == MIB - 1000, what="key-a's body held")
            async with connect(url) as (reader, writer):  # a large declared body: refused on its head
                writer.write(head_only(MIB, "key-a"))
                refused = await read_final(reader, "POST")
                assert_openai_error(refused, 429, "body_share_exceeded")
                assert refused.header("retry-after") == "1"
            async with connect(url) as (reader, writer):  # a small one: as it passes the share
                writer.write(post_chat(padded_chat(2000), a))
                assert_openai_error(await read_final(reader, "POST"), 429, "body_share_exceeded")
                assert await closed_by_peer(reader)
            async with connect(url) as (reader, writer):  # another key: its own share
                writer.write(post_chat(body, b))
                assert_chat(await read_final(reader, "POST"), 3)
            w1.write(body[-1000:])
            assert_chat(await read_final(r1, "POST"), 3)
        async with connect(url) as (reader, writer):
            writer.write(post_chat(body, a))
            assert_chat(await read_final(reader, "POST"), 3)
        await wait_for(lambda: server.buffered_body_bytes == 0, what="the budget given back")
        assert server.budget.held_by(b"key-a") == 0 == server.budget.held_by(b"key-b")


async def test_a_silent_upload_gets_408_after_the_same_body_timeout(tmp_path: Path) -> None:
    """An upload streamed to disk (the Batch API's /v1/files) is held to the same request_body_timeout
    as a buffered body: one setting for both (before issue 44 the upload's was a fixed 60 s)."""
    async with batch_server(tmp_path, request_body_timeout=0.5) as (url, server, _files):
        async with connect(url) as (reader, writer):
            writer.write(
                b"POST /v1/files HTTP/1.1\r\nhost: x\r\nauthorization: Bearer good-key\r\n"
                b"content-type: multipart/form-data; boundary=b\r\ncontent-length: 20000\r\n\r\n"
                b'--b\r\ncontent-disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
            )
            answer = await read_final(reader, "POST")
            assert_openai_error(answer, 408, "request_timeout")
            assert await closed_by_peer(reader)
        await wait_for(lambda: server.buffered_body_bytes == 0, what="the window given back")


def test_requests_on_open_paths_share_one_holder(tmp_path: Path) -> None:
    """With client keys on, requests that need no key (the open paths) count together under one
    holder, whatever key they carry: made-up keys cannot multiply shares. Keys off: no holder."""
    keys = tmp_path / "keys.txt"
    keys.write_text("key-a\n")
    keyed = build_router({"static_backends": ENGINE, "api_keys_file": str(keys)}, environ={})
    made_up = [(b"authorization", b"Bearer made-up")]
    assert keyed.body_holder("/health", made_up) == b"" == keyed.body_holder("/metrics", [])
    assert keyed.body_holder("/v1/chat/completions", [(b"authorization", b"Bearer key-a")]) == b"key-a"
    keyless = build_router({"static_backends": ENGINE}, environ={})
    assert keyless.body_holder("/v1/chat/completions", made_up) is None
