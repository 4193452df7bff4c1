"""Guards against one-line regressions that the rest of the suite lets through.

Each test names, in its docstring, the one-line break it was checked against: the break was applied
locally, the test failed, and the break was reverted (it is not committed).
"""

from __future__ import annotations

import asyncio

import orjson

from tests.fakes.raw_engine import raw_engine
from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import FAST, client, http, running_router, serving, stubs, wait_for
from tests.router.test_http_server import connect, post_chat, read_final, sse_data
from vllm_stack.app import build_router

MSG = [{"role": "user", "content": "hi"}]
#: What the engine sends on every answer: hop-by-hop headers (RFC 9110 7.6.1) and an end-to-end one.
HOP_HEADERS = (
    b"Connection: x-foo, Keep-Alive\r\n"
    b"Keep-Alive: timeout=5, max=100\r\n"
    b"Proxy-Connection: keep-alive\r\n"
    b"Upgrade: h2c\r\n"
    b"x-foo: only-for-this-hop\r\n"
    b"Trailer: x-checksum\r\n"
    b"x-end-to-end: kept\r\n"
)
HOP_NAMES = {"keep-alive", "proxy-connection", "upgrade", "x-foo", "trailer"}


async def _hop_header_answer(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> bool:
    """Every POST is answered with :data:`HOP_HEADERS`: a JSON chat answer by Content-Length, or a
    chunked SSE stream. A raw-socket engine (tests/fakes/raw_engine.py), since uvicorn would rewrite
    the very headers under test."""
    if orjson.loads(body).get("stream"):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n" + HOP_HEADERS)
        writer.write(b"transfer-encoding: chunked\r\n\r\n")
        for event in (b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n', b"data: [DONE]\n\n"):
            writer.write(b"%x\r\n%b\r\n" % (len(event), event))
        writer.write(b"0\r\n\r\n")
    else:
        payload = b'{"choices":[{"index":0,"message":{"content":"a"}}]}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%bcontent-length: %d\r\n\r\n%b"
            % (HOP_HEADERS, len(payload), payload)
        )
    await writer.drain()
    return True


def _assert_no_hop_headers(headers: list[tuple[str, str]]) -> None:
    names = {k for k, _ in headers}
    assert not names & HOP_NAMES, headers
    assert all(v.lower() == "close" for k, v in headers if k == "connection"), (
        headers
    )  # only the router's own
    assert ("x-end-to-end", "kept") in headers, headers


async def test_hop_by_hop_headers_of_engine_answers_do_not_reach_the_client() -> None:
    """Hop-by-hop response headers (``Connection`` and the headers it lists, ``Keep-Alive``,
    ``Proxy-Connection``, ``Upgrade``, ``Trailer``) describe the engine's connection to the router and
    must not reach the client, for plain and streamed answers alike; end-to-end headers must. Raw
    sockets on both sides, so no HTTP library hides or adds headers. Real engines do not send these,
    hence the fake engine.

    Kills: in ``relay/leg.py`` ``_without_hop_by_hop``, dropping ``and name not in listed``
    (``x-foo`` leaks); ``elif _HOP_BY_HOP_HEADER.search(lowered) is not None or ...`` turned into
    ``elif False and ...`` (every hop-by-hop header leaks); removing ``b"trailer"`` from
    ``relay/headers.py`` ``HOP_BY_HOP``.
    """
    async with raw_engine(_hop_header_answer) as engine_url, running_router([engine_url]) as (url, _):
        async with connect(url) as (reader, writer):
            for stream in (False, True, False):  # keep-alive: one connection, both kinds of answer
                body = orjson.dumps({"model": "stub-model", "messages": MSG, "stream": stream})
                writer.write(post_chat(body))
                resp = await read_final(reader, "POST")
                assert resp.status == 200, resp
                _assert_no_hop_headers(resp.headers)
                if stream:
                    assert sse_data(resp.body)[-1] == b"[DONE]"


async def test_config_watcher_applies_every_reload_in_a_row_even_after_a_bad_file(tmp_path) -> None:
    """The YAML watcher must keep watching: several edits in sequence, with a rejected (bad) file in
    the middle, each take effect, seen from outside through ``GET /engines`` (routing logic and
    backends) and through where requests go. The older hot-reload test checks one reload and then only
    that a bad file does not crash the router.

    Kills: in ``app.py`` ``_watch_config``, a ``return`` after ``self.reload(config)`` (the watcher
    dies after its first reload), or ``continue`` -> ``return`` after a rejected file.
    """
    a, b = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    async with stubs(a, b) as (ua, ub):
        f = tmp_path / "router.yaml"
        f.write_text(f"static-backends: [{ua}]\nrouting-logic: roundrobin\n")
        router = build_router(FAST, str(f), environ={})
        async with serving(router) as url, http(url) as h:

            async def engines_view() -> tuple[str, list[str]]:
                doc = (await h.get("/engines")).json()
                return doc["routing_logic"], sorted(e["url"] for e in doc["engines"])

            steps = [
                (f"static-backends: [{ua}, {ub}]\nrouting-logic: session\n", ("session", sorted([ua, ub]))),
                ("static-backends: [not-a-url]\n", None),  # rejected: the previous config stays
                (f"static-backends: [{ub}]\nrouting-logic: leastloaded\n", ("leastloaded", [ub])),
                (f"static-backends: [{ua}]\nrouting-logic: p2c\n", ("p2c", [ua])),
            ]
            expected = ("roundrobin", [ua])
            await wait_for(lambda: router.registry.healthy_count == 1)
            for text, want in steps:
                f.write_text(text)
                if want is None:
                    await asyncio.sleep(1.5)  # longer than one watch interval
                    assert await engines_view() == expected
                    continue
                expected = want
                for _ in range(100):
                    if await engines_view() == expected:
                        break
                    await asyncio.sleep(0.05)
                assert await engines_view() == expected
            # the last config routes: only engine a serves now
            await wait_for(lambda: router.registry.healthy_count == 1)
            before = len(b.seen)
            for _ in range(4):
                r = await h.post("/v1/chat/completions", json={"model": "stub-model", "messages": MSG})
                assert r.status_code == 200 and r.json()["engine"] == "a"
            assert len(b.seen) == before


async def test_models_union_has_a_stable_sorted_order_and_no_duplicates() -> None:
    """``GET /v1/models`` over several engines serving overlapping models: each id once, sorted by id,
    and the same list on every call (clients and UIs diff it). The engines list their models in
    different, unsorted orders, so insertion order differs from the sorted one.

    Kills: in ``discovery/registry.py`` ``model_cards``, ``return [seen[k] for k in sorted(seen)]`` ->
    ``return list(seen.values())`` (engine order leaks out), and ``seen.setdefault(card["id"], card)``
    -> ``seen.setdefault(id(card), card)`` (duplicates).
    """
    a = StubEngine("a", ["zeta", "alpha"])
    b = StubEngine("b", ["mid", "alpha"])
    b.add_model("alpha-lora", parent="alpha")
    c = StubEngine("c", ["mid", "zeta", "beta"])
    async with stubs(a, b, c) as urls, running_router(urls) as (url, _):
        oai = client(url)
        lists = [[m.model_dump() for m in (await oai.models.list()).data] for _ in range(5)]
    ids = [card["id"] for card in lists[0]]
    assert ids == ["alpha", "alpha-lora", "beta", "mid", "zeta"]
    assert all(other == lists[0] for other in lists[1:])
    assert next(card for card in lists[0] if card["id"] == "alpha-lora")["parent"] == "alpha"
