"""Guards against one-line regressions that the rest of the suite lets through.

Each test names, in its docstring, the one-line break it was checked against: the break was applied
locally, the test failed, and the break was reverted (it is not committed).
"""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest

from tests.fakes.raw_engine import raw_engine
from tests.fakes.stub_engine import StubBehaviour, StubEngine
from tests.router.helpers import FAST, client, http, running_router, serving, stubs, wait_for
from tests.router.test_http_server import connect, post_chat, read_final, sse_data
from vllm_stack.app import build_router
from vllm_stack.engines.circuit import BreakerState, CircuitBreaker

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


# ---- client API keys, through raw HTTP (the check's place may move; what a client sees may not) --------
GOOD_KEY = "sk-good"


async def _chat_status(url: str, headers: list[tuple[str, str]]) -> int:
    body = orjson.dumps({"model": "stub-model", "messages": MSG})
    async with connect(url) as (reader, writer):
        writer.write(post_chat(body, headers))
        return (await read_final(reader, "POST")).status


async def test_the_bearer_scheme_is_case_insensitive_and_x_api_key_never_overrides_authorization() -> None:
    """RFC 9110 11.1: an auth scheme name is case-insensitive, so ``bearer`` and ``BEARER`` carry a
    key as ``Bearer`` does. A valid ``Authorization`` is the request's key whatever ``x-api-key`` says,
    before or after it (a proxy or SDK may add a stale ``x-api-key``). Raw requests: the header names,
    order and case are exactly these.

    Kills: in ``api/auth.py``, ``scheme.lower() == b"bearer"`` -> ``scheme == b"Bearer"`` (lower- and
    upper-case schemes refused), and ``elif name == b"x-api-key" and offered is None`` without
    ``and offered is None`` (a wrong ``x-api-key`` after a valid ``Authorization`` wins: 401).
    """
    environ = {"VLLM_STACK_API_KEYS": GOOD_KEY}
    async with stubs(StubEngine("e")) as urls, running_router(urls, environ) as (url, _):
        assert await _chat_status(url, []) == 401  # keys are on
        assert await _chat_status(url, [("Authorization", "Bearer sk-wrong")]) == 401
        for scheme in ("Bearer", "bearer", "BEARER", "bEaReR"):
            assert await _chat_status(url, [("Authorization", f"{scheme} {GOOD_KEY}")]) == 200, scheme
        assert await _chat_status(url, [("x-api-key", GOOD_KEY)]) == 200
        for headers in (
            [("Authorization", f"Bearer {GOOD_KEY}"), ("x-api-key", "sk-wrong")],
            [("x-api-key", "sk-wrong"), ("Authorization", f"Bearer {GOOD_KEY}")],
        ):
            assert await _chat_status(url, headers) == 200, headers


# ---- the circuit breaker ---------------------------------------------------------------------------------
def test_a_success_resets_the_breakers_count_of_consecutive_failures() -> None:
    """The threshold counts failures in a row: two, a success, two more must leave the breaker closed
    (four failures, but never three consecutive ones).

    Kills: in ``engines/circuit.py`` ``success``, removing ``self._failures = 0`` (the breaker opens
    on the fourth failure).
    """
    breaker = CircuitBreaker(3, 10.0, clock=lambda: 0.0)
    for outcome in ("failure", "failure", "success", "failure", "failure"):
        getattr(breaker, outcome)()
    assert breaker.state is BreakerState.CLOSED and breaker.available()
    breaker.failure()  # the third in a row
    assert breaker.state is BreakerState.OPEN


def test_each_trip_restarts_the_cool_down() -> None:
    """An engine that hangs is tripped at every silent scrape; the breaker must stay open for
    ``open_seconds`` after the last trip, not the first, or a probe goes to a hung engine.

    Kills: in ``engines/circuit.py`` ``trip``, setting ``self._opened_at`` only when the breaker was
    not open already (or not at all).
    """
    now = [0.0]
    breaker = CircuitBreaker(5, 10.0, clock=lambda: now[0])
    breaker.trip()
    now[0] = 8.0
    breaker.trip()  # still silent
    now[0] = 12.0  # 12 s after the first trip, 4 s after the last
    assert breaker.state is BreakerState.OPEN and not breaker.available()
    now[0] = 18.0
    assert breaker.available()


async def test_a_half_open_probe_whose_client_left_lets_the_next_probe_through() -> None:
    """The one request a half-open breaker lets through is its probe; when its client leaves before
    the engine answered, nothing was learned about the engine, and the probe must be released so the
    next request can be the probe. Otherwise the breaker stays half-open with a probe that never ends,
    and the engine gets no request again.

    Kills: in ``director/request.py`` ``client_lost``, removing ``self.engine.breaker.release()``.
    """
    engine = StubEngine("e", behaviour=StubBehaviour(delay_s=5.0))
    settings = {"circuit_open_seconds": 0.2, "retries": 0}
    async with stubs(engine) as urls, running_router(urls, **settings) as (url, router):
        (known,) = router.registry.engines()
        known.breaker.trip()  # as a hang seen by the scraper does
        await wait_for(known.breaker.available, what="the cool-down's end")
        async with httpx.AsyncClient(base_url=url, timeout=0.5) as h:
            with pytest.raises(httpx.ReadTimeout):  # the client leaves during the probe
                await h.post("/v1/chat/completions", json={"model": "stub-model", "messages": MSG})
        assert known.breaker.state is BreakerState.HALF_OPEN
        await wait_for(lambda: known.in_flight == 0, what="the router's end of the probe")
        assert known.breaker.available(), "the probe whose client left still holds the breaker"
        engine.behaviour.delay_s = 0.0
        async with http(url) as h:
            r = await h.post("/v1/chat/completions", json={"model": "stub-model", "messages": MSG})
        assert r.status_code == 200 and known.breaker.state is BreakerState.CLOSED


# ---- hot LoRA adapters -------------------------------------------------------------------------------------
LORA_BASE = "stub-model"


def _lora(name: str, tier: str) -> dict[str, str]:
    return {"name": name, "source": f"/adapters/{name}", "base_model": LORA_BASE, "tier": tier}


async def test_a_hot_adapter_is_not_unloaded_even_when_it_is_the_least_recently_used() -> None:
    """With warm adapters beside it (no cold one that would go first anyway), the hot adapter, never
    used by a request, is the least recently used of all; a full engine must still unload a warm one.

    Kills: in ``engines/adapter_placement.py`` ``_victim``, ``(spec is not None and spec.pinned)`` ->
    ``(spec is not None and False)`` (the hot adapter is unloaded for the second warm one).
    """
    e = StubEngine("a", [LORA_BASE], max_loras=2)
    specs = [_lora("hot1", "hot"), _lora("w1", "warm"), _lora("w2", "warm")]
    async with stubs(e) as urls, running_router(urls, lora_adapters=specs) as (url, router), http(url) as h:
        await wait_for(
            lambda: "hot1" in e.cards and router.registry.engines()[0].max_loras, what="hot1 loaded"
        )
        for name in ("w1", "w2", "w1"):
            r = await h.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200, r.text
            await wait_for(lambda: router.registry.engines()[0].fresh_telemetry() is not None)
        assert "hot1" in e.cards, e.lora_loads
        assert e.lora_loads == ["hot1", "w1", "w2", "w1"]


async def test_a_hot_adapter_whose_load_failed_is_not_tried_again_at_every_health_check() -> None:
    """A hot adapter is loaded after each answered ``/v1/models`` where it is missing; one whose load
    failed there waits ``HOT_RETRY_SECONDS`` (30 s) before the next try, so an engine that refuses it
    is not asked again every 0.2 s. Asserted over five health checks after the failure: each would
    have retried without the back-off, so five is enough to see it.

    Kills: in ``engines/adapter_placement.py`` ``reconcile``, the back-off's ``continue`` removed (or
    its condition made false).
    """
    e = StubEngine("a", [LORA_BASE], max_loras=2, behaviour=StubBehaviour(lora_load_status=400))
    async with stubs(e) as urls, running_router(urls, lora_adapters=[_lora("hot1", "hot")]) as (_, router):
        await wait_for(lambda: e.lora_loads == ["hot1"], what="the first hot load")
        checks = [0]
        router.registry.on_models_learned.append(lambda _engine: checks.__setitem__(0, checks[0] + 1))
        await wait_for(lambda: checks[0] >= 5, what="five health checks after the failed load")
        assert e.lora_loads == ["hot1"]
