"""Rate limits through a router, declared in its tenants file: OpenAI's x-ratelimit-* headers on answers,
429 rate_limit_exceeded with retry-after past the limit (the engine never sees it), the token
reservation corrected from the answer's usage (streamed too: include_usage), and no gate at all where
no tenant has a limit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import metric_value, running_router, stubs, wait_for
from vllm_stack.tenants.ratelimit import Decision, LocalBuckets, TenantLimits

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
TENANT_HEADER = "x-llm-d-inference-fairness-id"
TENANT = {TENANT_HEADER: "t"}
RATE_HEADERS = {
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
}


def tenants_file(tmp_path: Path, **fields: object) -> str:
    """A tenants file declaring tenant "t" with ``fields`` (its limits, its weight)."""
    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": [{"name": "t", **fields}]}))
    return str(path)


async def test_answers_carry_the_headers_and_the_limit_answers_429(tmp_path: Path) -> None:
    engine = StubEngine()
    tenants = tenants_file(tmp_path, requests_per_minute=2, tokens_per_minute=100_000)
    async with stubs(engine) as urls, running_router(urls, tenants_file=tenants) as (url, router):
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=TENANT) as http:
            answers = [
                await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4}) for _ in range(3)
            ]
            other = await http.post("/v1/chat/completions", json=CHAT, headers={TENANT_HEADER: "someone"})
        refused = metric_value(
            router, "vllm_stack_router_tenant_rejections_total", tenant="t", reason="rate_limited"
        )
    first, second, third = answers
    assert first.status_code == second.status_code == 200
    assert RATE_HEADERS <= set(first.headers)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert second.headers["x-ratelimit-remaining-requests"] == "0"
    assert first.headers["x-ratelimit-reset-requests"] == "30s"
    assert third.status_code == 429
    error = third.json()["error"]
    assert error["type"] == error["code"] == "rate_limit_exceeded"
    assert "tenant 't'" in error["message"] and "requests per minute" in error["message"]
    assert int(third.headers["retry-after"]) == 30  # 2 per minute: the next one in 30 s
    assert third.headers["x-llm-d-request-dropped-reason"] == "rate_limited"  # as llm-d's router says
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused == 1
    # the refused one never reached the engine; an undeclared tenant has no limits, nor their headers
    assert engine.completed == 3
    assert other.status_code == 200 and not RATE_HEADERS & set(other.headers)


async def test_no_limits_no_headers_and_no_gate(tmp_path: Path) -> None:
    """Tenants declared without limits: the request path has no rate gate at all."""
    tenants = tenants_file(tmp_path, weight=2)
    async with stubs(StubEngine()) as urls, running_router(urls, tenants_file=tenants) as (url, router):
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=TENANT) as http:
            answer = await http.post("/v1/chat/completions", json=CHAT)
        hooks = router.director.hooks
    assert answer.status_code == 200 and not RATE_HEADERS & set(answer.headers)
    assert not [h for h in (*hooks.prepare, *hooks.response_complete) if "RateLimitGate" in repr(h)]


@pytest.mark.parametrize(
    ("stream", "usage", "corrected"),
    [(False, True, True), (True, True, True), (True, False, False)],
    ids=["json", "stream-include-usage", "stream-without-usage"],
)
async def test_the_token_reservation_is_corrected_from_usage(
    stream: bool, usage: bool, corrected: bool, tmp_path: Path
) -> None:
    """No max_tokens: the model's default (the stub's context, 2048, less the prompt) is reserved; the
    stub answers 8 tokens, so the usage gives almost all of it back. Without usage it stays reserved."""
    engine = StubEngine(max_model_len=2048)
    tenants = tenants_file(tmp_path, tokens_per_minute=6000)  # refills 100 a second
    async with stubs(engine) as urls, running_router(urls, tenants_file=tenants) as (url, router):
        body: dict[str, object] = {**CHAT, "stream": stream}
        if usage and stream:
            body["stream_options"] = {"include_usage": True}
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=TENANT) as http:
            first = await http.post("/v1/chat/completions", json=body)
            assert first.status_code == 200
            assert (b'"usage"' in first.content) == usage
            second = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
        gauge = metric_value(router, "vllm_stack_router_tenant_tokens", tenant="t")
    assert second.status_code == 200
    assert first.headers["x-ratelimit-remaining-tokens"] == str(6000 - 2048)  # prompt + default reserved
    left = int(second.headers["x-ratelimit-remaining-tokens"])
    assert abs(gauge - (6000 - left)) <= 1  # the tenant_tokens gauge: what the last decision counted
    if corrected:  # 2048 reserved, 5 + 8 used: back to nearly full before the second's own ~20
        assert left > 5900, left
    else:  # the 2048 stay taken; at most a few seconds' refill came back
        assert left < 4500, left


def _finished(router: object, status: str) -> float:
    """Requests the router finished with ``status`` (any model, any engine)."""
    family = router.metrics.registry.collect()  # type: ignore[attr-defined]
    return sum(
        s.value
        for metric in family
        for s in metric.samples
        if s.name == "vllm_stack_router_requests_total" and s.labels.get("status") == status
    )


async def test_a_client_gone_before_the_answer_gives_back_its_output_reservation(tmp_path: Path) -> None:
    """The reviewer's repro through a router: tokens_per_minute 100000, max_tokens 1e9, the client
    closes its connection before the engine answered. The reservation was capped at a minute's tokens
    and its output part comes back: the tenant's next request passes with the bucket nearly full (was:
    refused with retry-after ~600000 s)."""
    engine = StubEngine(max_model_len=10**7)
    engine.behaviour.delay_s = 30.0  # the first answer never comes before its client leaves
    tenants = tenants_file(tmp_path, tokens_per_minute=100_000)
    async with stubs(engine) as urls, running_router(urls, tenants_file=tenants) as (url, router):
        async with httpx.AsyncClient(base_url=url, timeout=60, headers=TENANT) as http:
            gone = asyncio.ensure_future(
                http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10**9})
            )
            await wait_for(lambda: len(engine.seen) == 1, what="the engine receiving the first request")
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            await wait_for(
                lambda: _finished(router, "client_closed") == 1, what="the router seeing the client go"
            )
            engine.behaviour.delay_s = 0.0
            second = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    assert second.status_code == 200, second.headers.get("retry-after")
    assert int(second.headers["x-ratelimit-remaining-tokens"]) > 100_000 - 100


async def test_the_queues_own_refusal_of_a_limited_tenant_carries_its_rate_limit_headers(
    tmp_path: Path,
) -> None:
    """Every answer of a limited tenant carries OpenAI's headers: a 429 queue_full too (was: only the
    answers relayed from an engine, and the rate limit's own 429)."""
    engine = StubEngine()
    engine.waiting = 9  # saturated: standard requests wait in the router's queue
    tenants = tenants_file(tmp_path, requests_per_minute=100)
    async with (
        stubs(engine) as urls,
        running_router(urls, tenants_file=tenants, queue_max_per_band=1, queue_timeout=30) as (url, router),
        httpx.AsyncClient(base_url=url, timeout=30, headers=TENANT) as http,
    ):
        await wait_for(
            lambda: (t := router.registry.engines()[0].fresh_telemetry()) is not None and t.waiting == 9,
            what="the engine's saturation scraped",
        )
        waiting = asyncio.ensure_future(http.post("/v1/chat/completions", json=CHAT))
        await wait_for(lambda: router.queue.length == 1, what="the first request waiting")
        refused = await http.post("/v1/chat/completions", json=CHAT)
        engine.waiting = 0
        answered = await asyncio.wait_for(waiting, 30)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    assert refused.headers["x-llm-d-request-dropped-reason"] == "queue_full"
    assert {h for h in RATE_HEADERS if h.endswith("-requests")} <= set(refused.headers)
    assert refused.headers["x-ratelimit-remaining-requests"] == "98"
    assert answered.status_code == 200


class _SlowStore:
    """A shared store that takes at once (as Redis runs its script) and answers when ``reply`` is set."""

    url = "redis://stand-in"

    def __init__(self) -> None:
        self.buckets = LocalBuckets()
        self.taken = asyncio.Event()
        self.reply = asyncio.Event()
        self.adjusts: list[int] = []

    async def take(self, tenant: str, limits: TenantLimits, tokens: int) -> Decision:
        decision = self.buckets.take(tenant, limits, tokens)
        self.taken.set()
        await self.reply.wait()
        return decision

    async def adjust(self, tenant: str, limits: TenantLimits, delta: int) -> None:
        self.adjusts.append(delta)
        self.buckets.adjust(tenant, limits, delta)

    async def close(self) -> None:
        return None


async def test_a_client_gone_while_the_shared_store_decides_gets_its_tokens_back(tmp_path: Path) -> None:
    """The store took a reservation and its answer was still on the way when the client left: once it
    comes, the tokens go back (was: the cancelled wait dropped the decision, and a minute's tokens with
    it)."""
    engine = StubEngine(max_model_len=10**7)
    tenants = tenants_file(tmp_path, tokens_per_minute=100_000)
    async with stubs(engine) as urls, running_router(urls, tenants_file=tenants) as (url, router):
        store = _SlowStore()
        router.rate_limiter.shared = store
        async with httpx.AsyncClient(base_url=url, timeout=30, headers=TENANT) as http:
            gone = asyncio.ensure_future(
                http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 50_000})
            )
            await asyncio.wait_for(store.taken.wait(), 10)
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            await wait_for(lambda: _finished(router, "client_closed") == 1, what="the router seeing it go")
            store.reply.set()
            await wait_for(lambda: len(store.adjusts) == 1, what="the reservation given back")
            assert store.adjusts[0] <= -50_000, store.adjusts
            second = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    assert second.status_code == 200
    assert int(second.headers["x-ratelimit-remaining-tokens"]) > 100_000 - 100
    assert len(engine.seen) == 1  # the second only: the gone one never reached the engine
