"""The HTTP conformance and smuggling corpus: raw exchanges in both directions, as data.

``corpus/client_to_router.yaml`` holds raw client bytes and what the router must answer (statuses in
order, whether it closes, its error marker, what the engine saw); ``corpus/engine_to_router.yaml``
holds raw engine answers and what the client must get. A new case is a few lines of YAML, so a
defect found by hand becomes a permanent check. Cases that carry an ``h11`` outcome are also sent to
uvicorn with h11 (an independent, strict HTTP/1.1 implementation) to show the router is at least as
strict as it where that matters (smuggling, framing).

The engines here are a stub (tests/fakes/stub_engine.py) and a raw-socket fake: the point is the
wire, and a real vLLM engine cannot be made to send malformed answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import pytest
import uvicorn
import yaml

from tests.fakes.raw_engine import raw_engine
from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import running_router, stubs, wait_for

CORPUS = Path(__file__).parent / "corpus"
MARKER = "x-vllm-stack-error"
QUIET = 0.5  # seconds of silence after which the router is taken to have answered everything
READ_LIMIT = 10.0


def _load(name: str) -> list[dict[str, Any]]:
    return yaml.safe_load((CORPUS / name).read_text())


def _bytes(spec: str | list[Any]) -> bytes:
    """A case's bytes: a string (latin-1, so \\xff is one byte) or parts with repeats; AUTO lengths."""
    parts = [spec] if isinstance(spec, str) else spec
    out = b"".join(
        (p["repeat"] * p["times"]).encode("latin-1") if isinstance(p, dict) else p.encode("latin-1")
        for p in parts
    )
    if b"Content-Length: AUTO" in out:
        head, _, body = out.partition(b"\r\n\r\n")
        out = head.replace(b"AUTO", b"%d" % len(body)) + b"\r\n\r\n" + body
    return out


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes = b""


@dataclass
class Exchange:
    answers: list[Answer] = field(default_factory=list)
    closed: bool = False
    raw: bytes = b""  # every byte the router sent, as sent


class _Responses:
    """httptools callbacks collecting every response in a byte stream (interim ones included)."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._open = False
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self._headers, self._body = {}, []
        self._open = False

    def on_headers_complete(self) -> None:
        self._open = True

    def eof(self) -> None:
        """The connection closed: a close-delimited body ends here."""
        if self._open:
            self._open = False
            self.answers.append(Answer(self.parser.get_status_code(), self._headers, b"".join(self._body)))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._open = False
        status = self.parser.get_status_code()
        self.answers.append(Answer(status, self._headers, b"".join(self._body)))


async def exchange(url: str, data: bytes) -> Exchange:
    """Send ``data`` in one write and read every answer until the router closes or goes quiet."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    responses = _Responses()
    result = Exchange()
    received: list[bytes] = []
    try:
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        deadline = asyncio.get_running_loop().time() + READ_LIMIT
        while asyncio.get_running_loop().time() < deadline:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), QUIET)
            except TimeoutError:
                break
            except ConnectionError:
                result.closed = True
                break
            if not chunk:
                result.closed = True
                break
            received.append(chunk)
            try:
                responses.parser.feed_data(chunk)
            except httptools.HttpParserUpgrade:
                pass
        if result.closed:
            responses.eof()
    finally:
        writer.close()
    result.answers = responses.answers
    result.raw = b"".join(received)
    return result


# ---- client -> router -------------------------------------------------------------------------------
CLIENT_CASES = _load("client_to_router.yaml")


@pytest.fixture(scope="module")
def corpus_stub() -> StubEngine:
    return StubEngine("corpus", ["stub-model"])


@contextlib.asynccontextmanager
async def _router(kind: str, stub: StubEngine) -> AsyncIterator[str]:
    environ = {"VLLM_STACK_API_KEYS": "k1"} if kind == "keyed" else {}
    async with (
        stubs(stub) as urls,
        running_router(urls, environ=environ, session_key="x-session-id") as (
            url,
            _,
        ),
    ):
        yield url


@pytest.mark.parametrize("case", CLIENT_CASES, ids=[c["name"] for c in CLIENT_CASES])
async def test_client_to_router(case: dict[str, Any], corpus_stub: StubEngine) -> None:
    expect = case["expect"]
    corpus_stub.seen.clear()
    async with _router(case.get("router", "open"), corpus_stub) as url:
        sent = _bytes(case["send"])
        got = await exchange(url, sent)
    statuses = [a.status for a in got.answers]
    assert statuses == expect["statuses"], f"{case['name']}: answered {statuses}"
    assert got.closed == expect["closed"], f"{case['name']}: closed={got.closed}"
    last = got.answers[-1]
    if "marker" in expect:
        assert (MARKER in last.headers) == expect["marker"], last.headers
    if last.headers.get(MARKER):  # the router's own error: OpenAI-shaped, with its code as the marker
        assert last.headers["content-type"] == "application/json"
        import orjson

        error = orjson.loads(last.body)["error"]
        assert (
            set(error) == {"message", "type", "param", "code"} and str(error["code"]) == last.headers[MARKER]
        )
        assert last.status < 500 or case.get("router_5xx"), "a router 5xx for client input"
    for name, value in expect.get("headers", {}).items():  # on every answer
        assert all(a.headers.get(name) == value for a in got.answers), [a.headers for a in got.answers]
    seen = corpus_stub.seen[-1].headers if corpus_stub.seen else {}
    for name in expect.get("engine_lacks", ()):
        assert name not in seen, f"{name} reached the engine: {seen}"
    for name in expect.get("engine_has", ()):
        assert name in seen, f"{name} did not reach the engine: {seen}"
    if "request_id" in expect:
        assert last.headers.get("x-request-id") == expect["request_id"], last.headers
    if "request_id_replaced" in expect:
        sent_id = sent.split(b"X-Request-Id: ")[1].split(b"\r\n")[0] if b"X-Request-Id: " in sent else b""
        echoed = last.headers["x-request-id"].encode("latin-1")
        assert echoed and echoed != sent_id and len(echoed) <= 128
        sent_upstream = [v for k, v in corpus_stub.seen[-1].header_list if k == "x-request-id"]
        assert [v.encode("latin-1") for v in sent_upstream] == [echoed], sent_upstream


H11_CASES = [c for c in CLIENT_CASES if "h11" in c]


@contextlib.asynccontextmanager
async def _h11_server() -> AsyncIterator[str]:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    config = uvicorn.Config(app, host="127.0.0.1", port=0, http="h11", log_level="critical", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    await wait_for(lambda: server.started, what="uvicorn started")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 5)


@pytest.mark.parametrize("case", H11_CASES, ids=[c["name"] for c in H11_CASES])
async def test_same_bytes_on_uvicorn_h11(case: dict[str, Any]) -> None:
    """The reference outcome recorded beside the router's: where h11 refuses, so does the router."""
    async with _h11_server() as url:
        got = await exchange(url, _bytes(case["send"]))
    assert [a.status for a in got.answers] == case["h11"]["statuses"]
    assert got.closed == case["h11"]["closed"]


# ---- engine -> router -------------------------------------------------------------------------------
ENGINE_CASES = _load("engine_to_router.yaml")


def _answering(answer: bytes, close_after: bool):  # noqa: ANN202
    async def answer_post(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
        writer.write(answer)
        await writer.drain()
        return not close_after

    return answer_post


CHAT = b'{"model":"stub-model","messages":[{"role":"user","content":"h"}]}'
CHAT_REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%b" % (len(CHAT), CHAT)
)


@pytest.mark.parametrize("case", ENGINE_CASES, ids=[c["name"] for c in ENGINE_CASES])
async def test_engine_to_router(case: dict[str, Any]) -> None:
    expect = case["expect"]
    async with (
        raw_engine(_answering(_bytes(case["answer"]), case.get("close_after", False))) as engine_url,
        running_router([engine_url], health_check_interval=30) as (url, router),
    ):
        got = await exchange(url, CHAT_REQUEST)
        assert len(got.answers) == 1, [a.status for a in got.answers]
        answer = got.answers[0]
        assert answer.status == expect["status"], answer
        assert (MARKER in answer.headers) == expect["marker"], answer.headers
        if expect["marker"]:
            assert answer.headers[MARKER] == expect["code"], answer
        if "body" in expect:
            assert answer.body == expect["body"].encode()
        if "ends_with" in expect:  # (the parser above skips a stray CRLF; an h11 client does not)
            assert got.raw.endswith(_bytes(expect["ends_with"])), got.raw[-60:]
        for name in expect.get("client_lacks", ()):
            assert name not in answer.headers, f"{name} reached the client"
        if "pooled" in expect:  # the exchange's connection went back to the pool, or was closed
            assert router.pools.idle_connections(engine_url) == int(expect["pooled"])
        if expect.get("engine_healthy"):
            assert router.registry.candidates("stub-model"), "the engine was ejected"
            assert all(e.breaker.available() for e in router.registry.candidates("stub-model"))
