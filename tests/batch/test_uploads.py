"""File uploads are written to disk as they arrive, not buffered: a file far larger than the router's body
limit and its whole buffer budget goes through whole, the router holds at most the stream's window of it at
any time, and an upload refused (no key, too large) or abandoned leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from tests.batch.helpers import upload
from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import FAST, stubs, wait_for
from vllm_stack.app import build_router
from vllm_stack.server import RouterServer
from vllm_stack.server.body_stream import STREAM_HOLD

MIB = 1024 * 1024


@contextlib.asynccontextmanager
async def batch_server(tmp_path: Path, **settings: object) -> AsyncIterator[tuple[str, RouterServer, Path]]:
    """A router with the Batch API over one stub engine, on its own server (whose buffer figures the
    tests read): yields (url, server, the directory of file contents)."""
    async with stubs(StubEngine("s1", ["stub-model"])) as urls:
        cli = {
            **FAST,
            "static_backends": urls[0],
            "batch_api": True,
            "batch_dir": str(tmp_path / "batch"),
            **settings,
        }
        router = build_router(cli, environ={"VLLM_STACK_API_KEYS": "good-key"})
        server = RouterServer(router, "127.0.0.1", 0, shutdown_grace=2.0)
        await server.start()
        try:
            yield server.url, server, tmp_path / "batch" / "files"
        finally:
            await server.stop()


@pytest.fixture
async def small_budget_router(tmp_path: Path):  # noqa: ANN201 - (url, server, files dir)
    """Bodies of at most 1 MiB, 3 MiB held by all connections together; uploads of up to 64 MiB."""
    async with batch_server(
        tmp_path, max_body_bytes=MIB, max_buffered_body_bytes=3 * MIB, batch_max_file_bytes=64 * MIB
    ) as served:
        yield served


KEY = {"authorization": "Bearer good-key"}


async def _raw_head(url: str, request_head: bytes) -> bytes:
    """The answer's head to a request head sent alone (its body never follows)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request_head)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    finally:
        writer.close()


def _leftovers(files: Path) -> list[str]:
    return [p.name for p in files.iterdir() if p.name.startswith(".part-")]


async def test_a_file_larger_than_every_buffer_is_streamed_to_disk(small_budget_router) -> None:  # noqa: ANN001
    url, server, files = small_budget_router
    content = b"".join(b'{"n": %d, "pad": "%s"}\n' % (n, b"x" * 200) for n in range(150_000))  # ~31 MB
    assert len(content) > 20 * MIB
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, server.buffered_body_bytes)
            await asyncio.sleep(0.001)

    watcher = asyncio.create_task(watch())
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=KEY) as http:
        answer = await upload(http, content)
        watcher.cancel()
        assert answer.status_code == 200, answer.text
        doc = answer.json()
        assert doc["bytes"] == len(content)
        download = await http.get(f"/v1/files/{doc['id']}/content")
    assert hashlib.sha256(download.content).digest() == hashlib.sha256(content).digest()
    assert 0 < peak <= STREAM_HOLD  # the stream's window and its handler's piece, never the file
    assert server.buffered_body_bytes == 0
    assert not _leftovers(files)


async def test_an_upload_over_the_file_limit_is_413_and_leaves_nothing(tmp_path: Path) -> None:
    async with (
        batch_server(tmp_path, batch_max_file_bytes=MIB) as (url, _, files),
        httpx.AsyncClient(base_url=url, timeout=60, headers=KEY) as http,
    ):
        answer = await upload(http, os.urandom(3 * MIB))
        assert answer.status_code == 413, answer.text
        assert answer.json()["error"]["code"] in ("file_too_large", "body_too_large")
        head = await _raw_head(
            url,
            b"POST /v1/files HTTP/1.1\r\nhost: x\r\nauthorization: Bearer good-key\r\n"
            b"content-type: multipart/form-data; boundary=b\r\ncontent-length: 5000000\r\n"
            b"expect: 100-continue\r\n\r\n",
        )
        assert head.startswith(b"HTTP/1.1 413"), head  # a declared length over the limit: before any byte
        assert not _leftovers(files)


async def test_an_upload_without_a_key_is_refused_before_its_body(small_budget_router) -> None:  # noqa: ANN001
    url, server, files = small_budget_router
    head = await _raw_head(
        url,
        b"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-type: multipart/form-data; boundary=b\r\n"
        b"content-length: 50000000\r\nexpect: 100-continue\r\n\r\n",
    )
    assert head.startswith(b"HTTP/1.1 401"), head
    assert not _leftovers(files)


async def test_an_abandoned_upload_leaves_nothing(small_budget_router) -> None:  # noqa: ANN001
    url, server, files = small_budget_router
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/files HTTP/1.1\r\nhost: x\r\nauthorization: Bearer good-key\r\n"
        b"content-type: multipart/form-data; boundary=b\r\ncontent-length: 20000000\r\n\r\n"
        b'--b\r\ncontent-disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
    )
    writer.write(b"y" * (2 * MIB))
    await writer.drain()
    await wait_for(lambda: bool(_leftovers(files)), what="the upload's temporary file")
    writer.close()
    await wait_for(lambda: not _leftovers(files), what="the temporary file removed")
    await wait_for(lambda: server.buffered_body_bytes == 0, what="the window given back")


async def test_a_chunked_upload_is_streamed_too(small_budget_router) -> None:  # noqa: ANN001
    url, server, files = small_budget_router
    boundary = b"chunky"
    payload = b"".join(b'{"n": %d}\n' % n for n in range(300_000))  # ~3.3 MB, in 64 KiB chunks

    async def body() -> AsyncIterator[bytes]:
        yield b"--" + boundary + b'\r\ncontent-disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        yield (
            b"--" + boundary + b'\r\ncontent-disposition: form-data; name="file"; filename="c.jsonl"\r\n\r\n'
        )
        for start in range(0, len(payload), 64 * 1024):
            yield payload[start : start + 64 * 1024]
        yield b"\r\n--" + boundary + b"--\r\n"

    headers = {**KEY, "content-type": "multipart/form-data; boundary=chunky"}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as http:
        answer = await http.post("/v1/files", content=body())
        assert answer.status_code == 200, answer.text
        assert answer.json()["bytes"] == len(payload) and answer.json()["filename"] == "c.jsonl"
        download = await http.get(f"/v1/files/{answer.json()['id']}/content")
    assert download.content == payload
    assert server.buffered_body_bytes == 0
