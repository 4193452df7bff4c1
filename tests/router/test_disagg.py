"""Disaggregated prefill through the router, against stub engines that speak vLLM's HTTP API and
return a connector's ``kv_transfer_params`` as a prefill engine does (no vLLM needed for what is
tested here: the protocol on the wire, the decider, the fallbacks, the client leaving; the real
engines' test is tests/engines/test_disagg_engines.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import zmq
from kubernetes_asyncio.client import V1ObjectMeta, V1Pod, V1PodCondition, V1PodStatus

from tests.fakes.stub_engine import StubBehaviour, StubEngine
from tests.router.helpers import http, metric_value, running_router, stubs, wait_for
from vllm_stack.config import ConfigError, load_config
from vllm_stack.director.pd_notify import MAX_EARLY, PdNotifications
from vllm_stack.engines.discovery.kubernetes import pod_endpoint
from vllm_stack.scheduling.framework import RequestContext
from vllm_stack.scheduling.plugins.uncached_tokens_decider import UncachedTokensDecider

LONG = "the quick brown fox jumps over the lazy dog " * 60  # ~650 tokens by the byte estimate
HANDOVER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "prefill-engine-7",
    "remote_block_ids": [3, 4, 5],
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
}
DISAGG = "vllm_stack_router_disagg_requests_total"
SCRAPE_ERRORS = "vllm_stack_router_engine_scrape_errors_total"
PREDICTIONS = "vllm_stack_router_prefix_predictions_total"


def body(content: str = LONG, **extra: object) -> dict[str, object]:
    return {
        "model": "stub-model",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 5,
        **extra,
    }


def pd_settings(**extra: object) -> dict[str, object]:
    return {
        "routing_logic": "disaggregated_prefill",
        "static_roles": "prefill,decode",
        "disagg_min_uncached_tokens": 64,
        **extra,
    }


async def test_prefill_then_decode_with_the_handover_on_the_wire() -> None:
    prefill = StubEngine("P", behaviour=StubBehaviour(kv_transfer_params=HANDOVER))
    decode = StubEngine("D")
    environ = {"VLLM_API_KEY": "engine-key"}
    async with (
        stubs(prefill, decode) as urls,
        running_router(urls, environ, **pd_settings()) as (url, router),
    ):
        async with http(url) as c:
            sent = body(stream=True, stream_options={"include_usage": True}, min_tokens=3)
            headers = {
                "authorization": "Bearer sk-client",
                "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
            }
            async with c.stream("POST", "/v1/chat/completions", json=sent, headers=headers) as r:
                text = (await r.aread()).decode()
            assert r.status_code == 200, text
            assert r.headers["x-stub-engine"] == "D" and "data: [DONE]" in text
        (p,) = prefill.seen
        (d,) = decode.seen
        prefill_doc, decode_doc = json.loads(p.body), json.loads(d.body)
        # the prefill leg: one token, not streamed, asking for a remote decode
        assert prefill_doc["max_tokens"] == 1 and prefill_doc["stream"] is False
        assert "stream_options" not in prefill_doc and "min_tokens" not in prefill_doc
        assert prefill_doc["kv_transfer_params"]["do_remote_decode"] is True
        assert prefill_doc["messages"] == sent["messages"]
        # the decode leg: the client's request as sent, plus exactly what the prefill answer returned
        assert decode_doc.pop("kv_transfer_params") == HANDOVER
        assert decode_doc == sent
        # the engines' key (never the client's), the client's headers and one request id reach both
        for seen in (p, d):
            assert seen.headers["authorization"] == "Bearer engine-key"
            assert seen.headers["traceparent"] == headers["traceparent"]
        assert p.headers["x-request-id"] == d.headers["x-request-id"] == r.headers["x-request-id"]
        assert metric_value(router, DISAGG, model="stub-model", outcome="disaggregated") == 1
        engines = {e.name: e for e in router.registry.engines()}
        assert sorted(e.role for e in engines.values()) == ["decode", "prefill"]
        assert all(e.in_flight == 0 and e.prefill_tokens == 0 for e in engines.values())


async def test_a_connector_that_hands_over_nothing_leaves_the_decode_body_as_sent() -> None:
    """ExampleConnector returns no kv_transfer_params (the KV goes through a shared folder)."""
    prefill, decode = StubEngine("P"), StubEngine("D")
    async with stubs(prefill, decode) as urls, running_router(urls, **pd_settings()) as (url, _):
        async with http(url) as c:
            raw = json.dumps(body()).encode()
            r = await c.post(
                "/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert r.status_code == 200 and r.json()["engine"] == "D"
        assert len(prefill.seen) == 1
        assert decode.seen[0].body == raw  # byte for byte


async def test_the_decider_serves_a_short_uncached_part_decode_only() -> None:
    prefill, decode = StubEngine("P"), StubEngine("D")
    async with (
        stubs(prefill, decode) as urls,
        running_router(urls, **pd_settings(disagg_min_uncached_tokens=4096)) as (
            url,
            router,
        ),
    ):
        async with http(url) as c:
            r = await c.post("/v1/chat/completions", json=body())
            assert r.status_code == 200 and r.json()["engine"] == "D"
            r = await c.post("/v1/chat/completions", json=body("hi"))  # shorter than one block
            assert r.status_code == 200 and r.json()["engine"] == "D"
        assert not prefill.seen and len(decode.seen) == 2
        assert "kv_transfer_params" not in json.loads(decode.seen[0].body)
        assert metric_value(router, DISAGG, model="stub-model", outcome="short") == 2


@pytest.mark.parametrize(("min_uncached", "prefilled"), [(4096, False), (64, True)])
async def test_only_a_prefill_leg_sent_claims_the_prefill_engine(min_uncached: int, prefilled: bool) -> None:
    """The prefill profile's picker places the prompt before the decider runs; a decode-only decision
    must leave its index (the prompt's blocks on the prefill engine) and its recent shares as they were,
    or later requests would expect cached tokens there that were never sent. A prefill leg sent claims
    both, as any placement does.

    Kills: in ``scheduling/disaggregation.py`` ``prefill_step``, the prefill profile's pick made before
    the decider.
    """
    prefill, decode = StubEngine("P"), StubEngine("D")
    settings = pd_settings(disagg_min_uncached_tokens=min_uncached)
    async with stubs(prefill, decode) as urls, running_router(urls, **settings) as (url, router):
        async with http(url) as c:
            r = await c.post("/v1/chat/completions", json=body())
            assert r.status_code == 200 and r.json()["engine"] == "D"
        assert len(prefill.seen) == int(prefilled)
        picker = router.scheduler.profiles["prefill"].picker
        engine = next(e for e in router.registry.engines() if e.role == "prefill")
        blocks = picker.index.blocks_of(engine.name)
        (shares,) = picker.shares_for("stub-model").counts([engine])
        predictions = sum(
            metric_value(router, PREDICTIONS, mode="characters", outcome=outcome)
            for outcome in ("exact", "over", "under", "unreported")
        )
        if prefilled:
            assert blocks > 0 and shares == 1 and predictions == 1
        else:  # nor is the prefill pick's prediction compared with what the decode engine cached
            assert blocks == 0 and shares == 0 and predictions == 0
            assert metric_value(router, DISAGG, model="stub-model", outcome="short") == 1


def test_the_decider_takes_an_uncached_part_of_exactly_the_threshold() -> None:
    """``min_uncached_tokens`` is the least uncached part worth a prefill leg: reaching it is enough.

    Kills: in ``scheduling/plugins/uncached_tokens_decider.py`` ``decide``, ``>=`` -> ``>``.
    """
    ctx = RequestContext("stub-model")
    decider = UncachedTokensDecider(min_uncached_tokens=256)
    assert decider.decide(ctx, 256) and decider.decide(ctx, 257)
    assert not decider.decide(ctx, 255)
    assert UncachedTokensDecider(min_uncached_tokens=0).decide(ctx, 0)


async def test_the_prefill_leg_asks_for_one_choice_and_the_decode_leg_for_the_clients() -> None:
    """The prefill leg computes the prompt's KV once: ``n`` 1 whatever the client asked (n choices
    would prefill and sample n times, for one hand-over); the decode leg keeps the client's ``n``.

    Kills: in ``director/disagg.py`` ``prefill_body``, removing ``out["n"] = 1``.
    """
    prefill = StubEngine("P", behaviour=StubBehaviour(kv_transfer_params=HANDOVER))
    decode = StubEngine("D")
    async with stubs(prefill, decode) as urls, running_router(urls, **pd_settings()) as (url, _):
        async with http(url) as c:
            r = await c.post("/v1/chat/completions", json=body(n=3))
            assert r.status_code == 200, r.text
        (p,) = prefill.seen
        (d,) = decode.seen
        assert json.loads(p.body)["n"] == 1
        assert json.loads(d.body)["n"] == 3


async def test_the_decider_goes_by_the_uncached_part_of_the_prompt_not_the_body() -> None:
    """The decider's input is the prompt tokens the prefill engine lacks, the prefix index's estimate:
    a prompt sent again (its blocks now indexed on the prefill engine) has almost nothing uncached
    and is served decode-only; a long non-prompt field (``user`` here) is no prompt to prefill.

    Kills: in ``scheduling/disaggregation.py`` ``prefill_step``, the decider given a count of the whole
    body (``len(ctx.body) // 4``) or the prompt's length without what is cached.
    """
    prefill = StubEngine("P", behaviour=StubBehaviour(kv_transfer_params=HANDOVER))
    decode = StubEngine("D")
    async with stubs(prefill, decode) as urls, running_router(urls, **pd_settings()) as (url, router):
        async with http(url) as c:
            for _ in range(2):  # the first is prefilled there, the second finds it cached
                r = await c.post("/v1/chat/completions", json=body())
                assert r.status_code == 200, r.text
        assert len(prefill.seen) == 1
        assert metric_value(router, DISAGG, model="stub-model", outcome="short") == 1
    # ~660 prompt tokens by the byte estimate, under the threshold; the body's 8 KB more are no prompt
    settings = pd_settings(disagg_min_uncached_tokens=1000)
    async with stubs(prefill, decode) as urls, running_router(urls, **settings) as (url, router):
        async with http(url) as c:
            r = await c.post("/v1/chat/completions", json=body(user="u" * 8000))
            assert r.status_code == 200, r.text
        assert len(prefill.seen) == 1  # none more
        assert metric_value(router, DISAGG, model="stub-model", outcome="short") == 1


@pytest.mark.parametrize("status", [500, 503, 400])
async def test_a_failed_prefill_falls_back_to_decode_only(status: int) -> None:
    prefill = StubEngine("P", behaviour=StubBehaviour(fail_statuses=[status], kv_transfer_params=HANDOVER))
    decode = StubEngine("D")
    async with stubs(prefill, decode) as urls, running_router(urls, **pd_settings()) as (url, router):
        async with http(url) as c:
            r = await c.post("/v1/chat/completions", json=body())
            assert r.status_code == 200 and r.json()["engine"] == "D"
        assert len(prefill.seen) == 1
        assert "kv_transfer_params" not in json.loads(decode.seen[0].body)
        assert metric_value(router, DISAGG, model="stub-model", outcome="prefill_failed") == 1


async def test_an_unreachable_prefill_engine_falls_back_and_is_ejected() -> None:
    prefill, decode = StubEngine("P"), StubEngine("D")
    async with stubs(decode) as (decode_url,):
        async with stubs(prefill) as (prefill_url,):
            pass  # its port is closed now
        # Neither health checks nor scrapes (whose refused connection ejects it too) run between the
        # engine made healthy below and the request: only the prefill leg's connect can eject it.
        settings = pd_settings(health_check_interval=30.0, engine_scrape_interval=30.0)
        async with running_router([prefill_url, decode_url], wait_healthy=1, **settings) as (url, router):
            engine = next(e for e in router.registry.engines() if e.url == prefill_url)
            # The scraper's first round (at the start) has failed there: the next one is 30 s away.
            await wait_for(
                lambda: metric_value(router, SCRAPE_ERRORS, engine=engine.name) >= 1, what="the first scrape"
            )
            engine.healthy = True  # as it was until it died, between two health checks
            engine.models = frozenset({"stub-model"})
            router.registry._rebuild()  # noqa: SLF001 - what a passed probe does
            assert router.registry.prefill_candidates("stub-model")
            async with http(url) as c:
                r = await c.post("/v1/chat/completions", json=body())
                assert r.status_code == 200 and r.json()["engine"] == "D"
            assert not router.registry.prefill_candidates("stub-model")  # ejected
            assert metric_value(router, DISAGG, model="stub-model", outcome="prefill_failed") == 1


async def test_a_client_that_leaves_during_prefill_ends_it_there_and_reaches_no_decode_engine() -> None:
    prefill = StubEngine("P", behaviour=StubBehaviour(delay_s=3.0))
    decode = StubEngine("D")
    async with stubs(prefill, decode) as urls, running_router(urls, **pd_settings()) as (url, router):
        async with httpx.AsyncClient(base_url=url, timeout=0.5) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/v1/chat/completions", json=body())
        engine = next(e for e in router.registry.engines() if e.role == "prefill")
        await wait_for(lambda: engine.in_flight == 0, within=2.0, what="the prefill leg's end")
        assert engine.prefill_tokens == 0
        # Past the prefill engine's answer (to the closed connection): nothing can start a decode leg.
        await wait_for(lambda: prefill.completed == 1, within=10.0, what="the prefill engine's answer")
        assert not decode.seen
        assert router.pools.idle_connections(engine.url) == 0  # its connection was closed, not reused


async def test_a_decode_retry_carries_the_same_handover() -> None:
    prefill = StubEngine("P", behaviour=StubBehaviour(kv_transfer_params=HANDOVER))
    shared = StubBehaviour(fail_statuses=[503])  # whichever decode engine is tried first fails
    first, second = StubEngine("D1", behaviour=shared), StubEngine("D2", behaviour=shared)
    settings = pd_settings(static_roles="prefill,decode,decode")
    async with stubs(prefill, first, second) as urls, running_router(urls, **settings) as (url, _):
        async with http(url) as c:
            r = await c.post("/v1/chat/completions", json=body())
            assert r.status_code == 200, r.text
        decode_bodies = [json.loads(s.body) for s in (*first.seen, *second.seen)]
        assert len(prefill.seen) == 1 and len(decode_bodies) == 2
        assert all(d["kv_transfer_params"] == HANDOVER for d in decode_bodies)


async def test_a_client_that_orchestrates_itself_is_passed_through() -> None:
    prefill, decode = StubEngine("P"), StubEngine("D")
    async with stubs(prefill, decode) as urls, running_router(urls, **pd_settings()) as (url, router):
        async with http(url) as c:
            r = await c.post("/v1/chat/completions", json=body(kv_transfer_params=HANDOVER))
            assert r.status_code == 200 and r.json()["engine"] == "D"
        assert not prefill.seen
        assert json.loads(decode.seen[0].body)["kv_transfer_params"] == HANDOVER
        assert metric_value(router, DISAGG, model="stub-model", outcome="client_params") == 1


async def test_prefill_engines_take_no_whole_request_and_embeddings_are_not_disaggregated() -> None:
    prefill, decode = StubEngine("P"), StubEngine("D")
    async with stubs(prefill, decode) as urls, running_router(urls, **pd_settings()) as (url, router):
        async with http(url) as c:
            for _ in range(4):
                r = await c.post("/v1/embeddings", json={"model": "stub-model", "input": LONG})
                assert r.status_code == 200
            r = await c.get("/engines")
        assert not prefill.seen and len(decode.seen) == 4
        roles = {e["url"]: e["role"] for e in r.json()["engines"]}
        assert roles == {urls[0]: "prefill", urls[1]: "decode"}


async def test_without_decode_engines_a_request_is_not_served_by_a_prefill_engine() -> None:
    prefill = StubEngine("P")
    settings = pd_settings(static_roles="prefill", queue_timeout=0.5)
    async with stubs(prefill) as urls, running_router(urls, **settings) as (url, _):
        async with http(url) as c:
            r = await c.post("/v1/chat/completions", json=body())
        assert r.status_code in (503,), r.text
        assert len(prefill.seen) <= 1  # at most its prefill leg


def test_roles_are_checked() -> None:
    with pytest.raises(ConfigError, match="static_roles"):
        load_config({"static_backends": "http://a:1", "static_roles": "prefil"})
    with pytest.raises(ConfigError, match="one entry per static backend"):
        load_config({"static_backends": "http://a:1", "static_roles": "prefill,decode"})
    config = load_config({"static_backends": "http://a:1,http://b:1", "static_roles": "prefill,decode"})
    assert config.disaggregated


# ---- LMCache's own PD mode (disagg_protocol: lmcache) ---------------------------------------------------
class ProxyNotif(msgspec.Struct, tag=True):
    """LMCache 0.5.x's notification to the proxy, as its source defines the wire format (a tagged
    msgspec struct: the msgpack map {"type": "ProxyNotif", "req_id": ...}); LMCache's PD path needs
    CUDA, so this test stands in for the prefill engine's LMCache."""

    req_id: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def lmcache_sender(port: int) -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield push
    finally:
        push.close()
        ctx.term()


def lmcache_settings(port: int, **extra: object) -> dict[str, object]:
    return pd_settings(
        disagg_protocol="lmcache",
        disagg_notify_port=port,
        disagg_receiver_init_port=55555,
        disagg_receiver_alloc_port=55556,
        **extra,
    )


async def test_lmcache_names_the_decode_receiver_and_decodes_once_notified() -> None:
    prefill, decode = (
        StubEngine("P", behaviour=StubBehaviour(kv_transfer_params={"first_tok": 42})),
        StubEngine("D"),
    )
    port = free_port()
    async with (
        stubs(prefill, decode) as urls,
        running_router(urls, **lmcache_settings(port)) as (url, router),
    ):
        async with http(url) as c:
            sent = body(stream=True)
            answer = asyncio.ensure_future(c.post("/v1/chat/completions", json=sent))
            await wait_for(lambda: len(prefill.seen) == 1, what="the prefill leg")
            spec = json.loads(prefill.seen[0].body)["kv_transfer_params"]
            assert spec["ret_first_tok"] is True
            disagg_spec = spec["disagg_spec"]
            assert disagg_spec["receiver_host"] == "127.0.0.1"
            assert disagg_spec["receiver_init_port"] == [55555] and disagg_spec["receiver_alloc_port"] == [
                55556
            ]
            await wait_for(lambda: router.pd_notifications.waiting == 1, what="the wait for the notification")
            assert not decode.seen  # the KV is not there yet
            with lmcache_sender(port) as push:
                push.send(msgspec.msgpack.encode(ProxyNotif(disagg_spec["req_id"])))
                r = await answer
        assert r.status_code == 200 and "data: [DONE]" in r.text
        assert json.loads(decode.seen[0].body) == sent  # the client's own request, no hand-over params
        assert metric_value(router, DISAGG, model="stub-model", outcome="notify_timeout") == 0
        assert router.pd_notifications.waiting == 0


async def test_lmcache_a_notification_before_the_prefill_answer_is_kept() -> None:
    prefill, decode = StubEngine("P", behaviour=StubBehaviour(delay_s=0.5)), StubEngine("D")
    port = free_port()
    settings = lmcache_settings(port, disagg_notify_timeout=5.0)
    async with stubs(prefill, decode) as urls, running_router(urls, **settings) as (url, router):
        async with http(url) as c:
            answer = asyncio.ensure_future(c.post("/v1/chat/completions", json=body()))
            await wait_for(lambda: len(prefill.seen) == 1, what="the prefill leg")
            req_id = json.loads(prefill.seen[0].body)["kv_transfer_params"]["disagg_spec"]["req_id"]
            with lmcache_sender(port) as push:
                push.send(msgspec.msgpack.encode(ProxyNotif(req_id)))
            started = time.monotonic()
            r = await answer
        assert r.status_code == 200 and r.json()["engine"] == "D"
        assert time.monotonic() - started < 2.0  # not the notification timeout
        assert metric_value(router, DISAGG, model="stub-model", outcome="notify_timeout") == 0


async def test_lmcache_without_a_notification_decodes_after_the_timeout() -> None:
    prefill, decode = StubEngine("P"), StubEngine("D")
    settings = lmcache_settings(free_port(), disagg_notify_timeout=0.3)
    async with stubs(prefill, decode) as urls, running_router(urls, **settings) as (url, router):
        async with http(url) as c:
            r = await c.post("/v1/chat/completions", json=body())
        assert r.status_code == 200 and r.json()["engine"] == "D"
        assert metric_value(router, DISAGG, model="stub-model", outcome="notify_timeout") == 1
        assert router.pd_notifications.waiting == 0


def test_pd_notifications_stay_bounded_and_skip_what_is_not_one() -> None:
    notifications = PdNotifications(1)
    for i in range(MAX_EARLY + 50):
        notifications.deliver(msgspec.msgpack.encode(ProxyNotif(f"r{i}")))
    for junk in (
        b"",
        b"\xc1",
        msgspec.msgpack.encode([1, 2]),
        msgspec.msgpack.encode({"req_id": 7}),
        b"x" * 5000,
    ):
        notifications.deliver(junk)
    assert len(notifications._early) == MAX_EARLY  # noqa: SLF001 - the bound under test
    assert notifications.malformed == 5 and notifications.received == MAX_EARLY + 55


def _pod(labels: dict[str, str]) -> V1Pod:
    return V1Pod(
        metadata=V1ObjectMeta(name="engine-0", labels=labels),
        status=V1PodStatus(
            phase="Running", pod_ip="10.0.0.9", conditions=[V1PodCondition(type="Ready", status="True")]
        ),
    )


@pytest.mark.parametrize(
    ("labels", "role"),
    [
        ({"vllm-stack.io/role": "prefill"}, "prefill"),
        ({"vllm-stack.io/role": "decode", "model": "opt-prefill"}, "decode"),  # the chart's label wins
        ({"model": "opt-prefill"}, "prefill"),  # production-stack's --prefill-model-labels
        ({"model": "opt-decode"}, "decode"),
        ({"model": "other"}, None),
        ({"vllm-stack.io/role": "prefil"}, None),  # unknown: logged, served whole
        ({}, None),
    ],
)
def test_kubernetes_discovery_reads_the_role_of_a_pod(labels: dict[str, str], role: str | None) -> None:
    roles = {"opt-prefill": "prefill", "opt-decode": "decode"}
    endpoint = pod_endpoint(_pod(labels), 8000, roles)
    assert endpoint is not None and endpoint.role == role
