"""A stream that survives its engine, over stub engines (they break a stream on demand; the real-engine
version, an engine killed mid-stream, is in test_engines.py).

The client's side is read raw where the framing matters (the chunked body's end and its trailer); the
second engine's side from what the stub saw (the request that continued the answer).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httptools
import orjson
import pytest

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import http, metric_value, running_router, stubs, wait_for
from vllm_stack.director.continuation import Continuation
from vllm_stack.relay.leg import KEEP_LIMIT
from vllm_stack.relay.transcript import NotContinuable

MODEL = "stub-model"
SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "hi"}


class _Answer:
    """httptools callbacks: the status, the dechunked body and the trailer fields of one answer."""

    def __init__(self) -> None:
        self.status = 0
        self.body = bytearray()
        self.fields: list[tuple[bytes, bytes]] = []
        self.complete = False
        self.parser: httptools.HttpResponseParser | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


async def raw_stream(url: str, path: str, body: dict[str, Any]) -> _Answer:
    """POST ``body`` on a raw connection and read the whole answer as it was framed."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    payload = orjson.dumps(body)
    writer.write(
        b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"te: trailers\r\n\r\n%s" % (path.encode(), len(payload), payload)
    )
    answer = _Answer()
    parser = answer.parser = httptools.HttpResponseParser(answer)
    try:
        while not answer.complete:
            data = await asyncio.wait_for(reader.read(65536), 30)
            if not data:
                break
            parser.feed_data(data)
    finally:
        writer.close()
    return answer


def events(body: bytes) -> list[Any]:
    out = []
    for block in bytes(body).split(b"\n\n"):
        if block.startswith(b"data: "):
            data = block[6:]
            out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


def text_of(evs: list[Any], chat: bool = True) -> str:
    parts = []
    for e in evs:
        if e == "[DONE]" or "error" in e:
            continue
        for c in e["choices"]:
            parts.append((c.get("delta") or {}).get("content") or "" if chat else c.get("text") or "")
    return "".join(parts)


def sent_to(engine: StubEngine, path: str) -> list[dict[str, Any]]:
    return [orjson.loads(s.body) for s in engine.seen if s.path == path]


@pytest.fixture
async def pair():  # noqa: ANN201
    """Two stubs; the first (round-robin's first pick) breaks its streams after two events."""
    a, b = StubEngine("a", [MODEL]), StubEngine("b", [MODEL])
    a.behaviour.break_after_chunks = 2
    async with stubs(a, b) as urls:
        yield a, b, urls


async def test_a_chat_stream_broken_by_its_engine_goes_on_on_another_as_one_answer(pair) -> None:  # noqa: ANN001
    a, b, urls = pair
    async with running_router(urls) as (url, router):
        body = {
            "model": MODEL,
            "messages": [SYSTEM, USER],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        answer = await raw_stream(url, "/v1/chat/completions", body)
    assert answer.status == 200 and answer.complete
    evs = events(answer.body)
    assert evs[-1] == "[DONE]" and not any("error" in e for e in evs[:-1])
    assert {e["id"] for e in evs[:-1]} == {"chatcmpl-stub-a"}  # one answer: the first engine's id
    # the first engine's two tokens, then the second's: it was asked for the four left
    assert text_of(evs) == "t0 t1 t0 t1 t2 t3 "
    (continued,) = sent_to(b, "/v1/chat/completions")
    assert continued["messages"] == [SYSTEM, USER, {"role": "assistant", "content": "t0 t1 "}]
    assert continued["continue_final_message"] is True and continued["add_generation_prompt"] is False
    assert continued["max_tokens"] == 4
    # usage: the streamed text counted as output, not as the second engine's prompt (the stub: 5 + 4)
    assert evs[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert (b"x-vllm-stack-continued", b"1") in answer.fields  # the trailer, after the last chunk
    assert (
        metric_value(router, "vllm_stack_router_stream_continuations_total", model=MODEL, outcome="continued")
        == 1
    )
    assert (
        metric_value(router, "vllm_stack_router_stream_continuations_total", model=MODEL, outcome="completed")
        == 1
    )
    assert (
        metric_value(router, "vllm_stack_router_retries_total", model=MODEL, reason="stream_continued") == 1
    )
    assert metric_value(router, "vllm_stack_router_stream_continuation_seconds_count") == 1


async def test_a_completions_stream_goes_on_with_the_text_after_its_prompt(pair) -> None:  # noqa: ANN001
    a, b, urls = pair
    async with running_router(urls) as (url, _):
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 5, "stream": True}
        answer = await raw_stream(url, "/v1/completions", body)
    evs = events(answer.body)
    assert evs[-1] == "[DONE]" and text_of(evs, chat=False) == "t0 t1 t0 t1 t2 "
    assert {e["id"] for e in evs[:-1]} == {"cmpl-stub-a"}
    (continued,) = sent_to(b, "/v1/completions")
    assert continued["prompt"] == "Oncet0 t1 " and continued["max_tokens"] == 3


async def test_an_openai_client_reads_one_well_formed_stream(pair) -> None:  # noqa: ANN001
    _, _, urls = pair
    async with running_router(urls) as (url, _), http(url) as h:
        body = {"model": MODEL, "messages": [USER], "max_tokens": 4, "stream": True}
        async with h.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 5  # four tokens (two and two), then [DONE]


@pytest.mark.parametrize(
    ("field", "value"),
    [("seed", 0), ("n", 2), ("logprobs", True), ("response_format", {"type": "json_object"})],
)
async def test_a_request_a_continuation_would_not_answer_faithfully_is_broken_off(
    pair,
    field: str,
    value: Any,  # noqa: ANN001, ANN401
) -> None:
    a, b, urls = pair
    async with running_router(urls) as (url, router):
        body = {"model": MODEL, "messages": [USER], "max_tokens": 6, "stream": True, field: value}
        answer = await raw_stream(url, "/v1/chat/completions", body)
    evs = events(answer.body)
    assert len(evs) == 3 and "mid-stream" in evs[-1]["error"]["message"]
    assert sent_to(b, "/v1/chat/completions") == []
    assert (
        metric_value(
            router, "vllm_stack_router_stream_continuations_total", model=MODEL, outcome=f"parameter_{field}"
        )
        == 1
    )


async def test_off_a_broken_stream_ends_with_an_error_event(pair) -> None:  # noqa: ANN001
    _, b, urls = pair
    async with running_router(urls, stream_continuation=False) as (url, _):
        body = {"model": MODEL, "messages": [USER], "max_tokens": 6, "stream": True}
        answer = await raw_stream(url, "/v1/chat/completions", body)
    evs = events(answer.body)
    assert len(evs) == 3 and "mid-stream" in evs[-1]["error"]["message"]
    assert sent_to(b, "/v1/chat/completions") == []


async def test_the_other_engines_refusal_ends_the_stream_with_its_words(pair) -> None:  # noqa: ANN001
    _, b, urls = pair
    async with running_router(urls) as (url, router):
        b.behaviour.fail_statuses = [400]
        body = {"model": MODEL, "messages": [USER], "max_tokens": 6, "stream": True}
        answer = await raw_stream(url, "/v1/chat/completions", body)
    evs = events(answer.body)
    assert answer.complete and len(evs) == 3
    assert "refused to continue the stream (400)" in evs[-1]["error"]["message"]
    assert "stub b fails with 400" in evs[-1]["error"]["message"]
    assert (
        metric_value(router, "vllm_stack_router_stream_continuations_total", model=MODEL, outcome="refused")
        == 1
    )


async def test_a_continuation_that_breaks_too_goes_on_on_a_third_engine() -> None:
    a, b, c = StubEngine("a", [MODEL]), StubEngine("b", [MODEL]), StubEngine("c", [MODEL])
    a.behaviour.break_after_chunks = 2
    for e in (b, c):
        e.behaviour.token_delay_s = 0.5  # time to make the first continuation's engine break after one
    async with stubs(a, b, c) as urls, running_router(urls) as (url, _):
        body = {"model": MODEL, "messages": [USER], "max_tokens": 6, "stream": True}
        reading = asyncio.ensure_future(raw_stream(url, "/v1/chat/completions", body))
        await wait_for(lambda: len(b.seen) + len(c.seen) == 1, within=20, what="the first continuation")
        second, third = (b, c) if b.seen else (c, b)
        second.behaviour.break_after_chunks = 1
        answer = await reading
    evs = events(answer.body)
    assert evs[-1] == "[DONE]" and text_of(evs) == "t0 t1 t0 t0 t1 t2 "
    (last,) = sent_to(third, "/v1/chat/completions")
    assert last["messages"][-1] == {"role": "assistant", "content": "t0 t1 t0 "} and last["max_tokens"] == 3
    assert (b"x-vllm-stack-continued", b"2") in answer.fields


def test_what_the_client_received_is_read_back_from_the_framed_bytes() -> None:
    first = b'data: {"id":"x","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    second = b'data: {"id":"x","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
    framed = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in (first, second))
    body = orjson.dumps({"model": "m", "messages": [USER], "stream": True, "max_tokens": 10})
    continuation = Continuation.begin("/v1/chat/completions", body, framed, True, True)
    assert continuation.transcript.text == "Hel" and continuation.transcript.tokens == 1
    request = orjson.loads(continuation.body())
    assert request["messages"][-1] == {"role": "assistant", "content": "Hel"} and request["max_tokens"] == 9
    # the continuation's role event is dropped; its next one takes the first answer's id
    role = b'{"id":"y","created":2,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    assert continuation.transcript.rewrite(role) is None
    word = orjson.loads(
        continuation.transcript.rewrite(
            b'{"id":"y","created":2,"model":"m","choices":[{"index":0,"delta":{"content":"lo"}}]}'
        )
    )
    assert (word["id"], word["created"], continuation.transcript.text) == ("x", 1, "Hello")


def test_a_stream_cut_inside_an_event_or_holding_a_tool_call_is_not_continued() -> None:
    body = orjson.dumps({"model": "m", "messages": [USER], "stream": True})
    with pytest.raises(NotContinuable, match="partial_event"):
        Continuation.begin("/v1/chat/completions", body, b'data: {"id":"x","choi', False, True)
    call = b'data: {"id":"x","choices":[{"index":0,"delta":{"tool_calls":[{"index":0}]}}]}\n\n'
    with pytest.raises(NotContinuable, match="tool_call"):
        Continuation.begin("/v1/chat/completions", body, call, False, True)
    with pytest.raises(NotContinuable, match="path"):
        Continuation.begin("/v1/responses", body, b"", False, True)


async def test_a_stream_that_stalls_on_an_engine_found_down_is_continued() -> None:
    """vLLM stopped with SIGTERM leaves its streams open and silent: once the router finds the engine down,
    a stream silent for 2 s there goes on on another engine."""
    a, b = StubEngine("a", [MODEL]), StubEngine("b", [MODEL])
    a.behaviour.token_delay_s = 0.2
    async with stubs(a, b) as urls, running_router(urls) as (url, router):
        body = {"model": MODEL, "messages": [USER], "max_tokens": 8, "stream": True}
        reading = asyncio.ensure_future(raw_stream(url, "/v1/chat/completions", body))
        await wait_for(lambda: len(a.seen) == 1, what="the stream on the first engine")
        a.behaviour.token_delay_s = 120  # silent from its next token on
        a.healthy = False  # and its health checks fail
        answer = await reading
    evs = events(answer.body)
    assert evs[-1] == "[DONE]" and not any("error" in e for e in evs[:-1])
    (continued,) = sent_to(b, "/v1/chat/completions")
    streamed = continued["messages"][-1]["content"]
    assert streamed.startswith("t0 ") and text_of(evs) == streamed + "".join(
        f"t{i} " for i in range(continued["max_tokens"])
    )
    assert (
        metric_value(router, "vllm_stack_router_stream_continuations_total", model=MODEL, outcome="completed")
        == 1
    )


async def test_a_stream_longer_than_the_bytes_kept_for_it_is_broken_off() -> None:
    """The bytes a stream keeps for a continuation are bounded (KEEP_LIMIT, checked every 64 reads): past
    it they are let go, and a break then ends the stream with an error event."""
    a, b = StubEngine("a", [MODEL]), StubEngine("b", [MODEL])
    a.behaviour.break_after_chunks = KEEP_LIMIT // 100  # the stub's events are about 150 bytes
    async with stubs(a, b) as urls, running_router(urls) as (url, router):
        body = {"model": MODEL, "messages": [USER], "max_tokens": KEEP_LIMIT // 50, "stream": True}
        answer = await raw_stream(url, "/v1/chat/completions", body)
    evs = events(answer.body)
    assert "mid-stream" in evs[-1]["error"]["message"] and len(evs) == KEEP_LIMIT // 100 + 1
    assert sent_to(b, "/v1/chat/completions") == []
    assert (
        metric_value(router, "vllm_stack_router_stream_continuations_total", model=MODEL, outcome="too_long")
        == 1
    )


#: vLLM 0.32's last event when its engine core dies (a SIGTERM in a container ends its streams so)
ENGINE_DEAD = {
    "error": {
        "message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_stream_its_engine_gave_up_with_an_error_event_goes_on_on_another(path: str) -> None:
    """An engine that ends a stream with an error event of a server error (vLLM's when its engine core
    died) broke it as surely as one that closed the connection: the event and its [DONE] are not
    forwarded, the stream goes on on the other engine as one answer."""
    a, b = StubEngine("a", [MODEL]), StubEngine("b", [MODEL])
    a.behaviour.give_up_after_chunks, a.behaviour.give_up_event = 2, ENGINE_DEAD
    chat = path == "/v1/chat/completions"
    async with stubs(a, b) as urls, running_router(urls) as (url, router):
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "stream": True}
        body.update({"messages": [USER]} if chat else {"prompt": "Once"})
        answer = await raw_stream(url, path, body)
    evs = events(answer.body)
    assert answer.complete and evs[-1] == "[DONE]" and evs.count("[DONE]") == 1
    assert not any("error" in e for e in evs[:-1])
    assert text_of(evs, chat=chat) == "t0 t1 t0 t1 t2 "
    (continued,) = sent_to(b, path)
    assert continued["max_tokens"] == 3
    assert (b"x-vllm-stack-continued", b"1") in answer.fields
    assert (
        metric_value(router, "vllm_stack_router_stream_continuations_total", model=MODEL, outcome="completed")
        == 1
    )


async def test_an_error_event_of_the_request_itself_is_forwarded_as_it_came() -> None:
    """An error event below 500 says the request is wrong, which another engine would say too: the
    client reads it, nothing is continued."""
    a, b = StubEngine("a", [MODEL]), StubEngine("b", [MODEL])
    refusal = {"error": {"message": "bad request mid-stream", "type": "BadRequestError", "code": 400}}
    a.behaviour.give_up_after_chunks, a.behaviour.give_up_event = 2, refusal
    async with stubs(a, b) as urls, running_router(urls) as (url, _):
        body = {"model": MODEL, "messages": [USER], "max_tokens": 5, "stream": True}
        answer = await raw_stream(url, "/v1/chat/completions", body)
    assert events(answer.body) == [*events(answer.body)[:2], refusal, "[DONE]"]
    assert sent_to(b, "/v1/chat/completions") == []


async def test_a_give_up_read_with_the_end_of_the_body_in_it_is_not_forwarded() -> None:
    """An engine whose error event, [DONE] and last chunk come in one write after its tokens (as vLLM's
    may): none of it is forwarded, and the other engine continues after the tokens."""
    b = StubEngine("b", [MODEL])

    def chunk(payload: bytes) -> bytes:
        event = b"data: " + payload + b"\n\n"
        return b"%x\r\n%b\r\n" % (len(event), event)

    def token(i: int) -> bytes:
        choice = {"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}
        return orjson.dumps({"id": "chatcmpl-raw", "object": "chat.completion.chunk", "created": 1,
                             "model": MODEL, "choices": [choice]})  # fmt: skip

    last = chunk(orjson.dumps(ENGINE_DEAD)) + chunk(b"[DONE]") + b"0\r\n\r\n"
    models = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answers on a kept-alive connection: the model list to the router's probes, an empty 200 to its
        scrapes, and to a POST two tokens, then after a pause the rest in one write."""
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                fields = dict(line.partition(b":")[::2] for line in head.split(b"\r\n")[1:] if line)
                length = int({k.lower(): v for k, v in fields.items()}.get(b"content-length", b"0"))
                await reader.readexactly(length)
                if head.startswith(b"POST"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"transfer-encoding: chunked\r\n\r\n" + chunk(token(0)) + chunk(token(1)))  # fmt: skip
                    await writer.drain()
                    await asyncio.sleep(0.5)  # the engine core dies; the server says so a moment later
                    writer.write(last)
                else:
                    body = models if b" /v1/models " in head.split(b"\r\n")[0] else b""
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n%b" % (len(body), body))  # fmt: skip
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    raw_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with stubs(b) as (b_url,), running_router([raw_url, b_url]) as (url, _):
            body = {"model": MODEL, "messages": [USER], "max_tokens": 4, "stream": True}
            answer = await raw_stream(url, "/v1/chat/completions", body)
    finally:
        server.close()
    evs = events(answer.body)
    assert evs[-1] == "[DONE]" and not any("error" in e for e in evs[:-1])
    assert text_of(evs) == "t0 t1 t0 t1 " and {e["id"] for e in evs[:-1]} == {"chatcmpl-raw"}
    (continued,) = sent_to(b, "/v1/chat/completions")
    assert continued["messages"][-1] == {"role": "assistant", "content": "t0 t1 "}


async def test_a_continuation_its_engine_gives_up_goes_on_on_a_third_engine() -> None:
    a, b, c = StubEngine("a", [MODEL]), StubEngine("b", [MODEL]), StubEngine("c", [MODEL])
    a.behaviour.break_after_chunks = 2
    for e in (b, c):
        e.behaviour.token_delay_s = 0.5
    async with stubs(a, b, c) as urls, running_router(urls) as (url, _):
        body = {"model": MODEL, "messages": [USER], "max_tokens": 6, "stream": True}
        reading = asyncio.ensure_future(raw_stream(url, "/v1/chat/completions", body))
        await wait_for(lambda: len(b.seen) + len(c.seen) == 1, within=20, what="the first continuation")
        second, third = (b, c) if b.seen else (c, b)
        second.behaviour.give_up_after_chunks, second.behaviour.give_up_event = 1, ENGINE_DEAD
        answer = await reading
    evs = events(answer.body)
    assert evs[-1] == "[DONE]" and not any("error" in e for e in evs[:-1])
    assert text_of(evs) == "t0 t1 t0 t0 t1 t2 "
    (last,) = sent_to(third, "/v1/chat/completions")
    assert last["messages"][-1] == {"role": "assistant", "content": "t0 t1 t0 "}
    assert (b"x-vllm-stack-continued", b"2") in answer.fields
