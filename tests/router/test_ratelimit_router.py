"""Rate limits through a router: OpenAI's x-ratelimit-* headers on answers, 429 rate_limit_exceeded
with retry-after past the limit (the engine never sees it), the token reservation corrected from the
answer's usage, streamed too (include_usage)."""

from __future__ import annotations

import httpx
import pytest

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import running_router, stubs
from vllm_stack.app import Router
from vllm_stack.director.rate_gate import RateLimitGate, with_gate
from vllm_stack.tenants.limiter import RateLimiter
from vllm_stack.tenants.ratelimit import TenantLimits

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
RATE_HEADERS = {
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
}


def _limit(router: Router, limits: TenantLimits) -> RateLimiter:
    """Every request of this router is tenant "t", limited by ``limits`` (this replica's buckets)."""
    limiter = RateLimiter({"t": limits})
    gate = RateLimitGate(limiter, lambda ctx: "t", router.registry.candidates)
    router.director.hooks = with_gate(router.director.hooks, gate)
    return limiter


async def test_answers_carry_the_headers_and_the_limit_answers_429() -> None:
    engine = StubEngine()
    async with stubs(engine) as urls, running_router(urls) as (url, router):
        _limit(router, TenantLimits(requests_per_minute=2, tokens_per_minute=100_000))
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            answers = [
                await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4}) for _ in range(3)
            ]
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
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    assert engine.completed == 2  # the refused one never reached the engine


@pytest.mark.parametrize(
    ("stream", "usage", "corrected"),
    [(False, False, True), (True, True, True), (True, False, False)],
    ids=["json", "stream-include-usage", "stream-without-usage"],
)
async def test_the_token_reservation_is_corrected_from_usage(
    stream: bool, usage: bool, corrected: bool
) -> None:
    """No max_tokens: the model's default (the stub's context, 2048, less the prompt) is reserved; the
    stub answers 8 tokens, so the usage gives almost all of it back. Without usage it stays reserved."""
    engine = StubEngine(max_model_len=2048)
    async with stubs(engine) as urls, running_router(urls) as (url, router):
        _limit(router, TenantLimits(tokens_per_minute=6000))  # refills 100 a second
        body: dict[str, object] = {**CHAT, "stream": stream}
        if usage and stream:
            body["stream_options"] = {"include_usage": True}
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            first = await http.post("/v1/chat/completions", json=body)
            assert first.status_code == 200
            if stream:
                assert (b'"usage"' in first.content) == usage
            second = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    assert second.status_code == 200
    assert first.headers["x-ratelimit-remaining-tokens"] == str(6000 - 2048)  # prompt + default reserved
    left = int(second.headers["x-ratelimit-remaining-tokens"])
    if corrected:  # 2048 reserved, 5 + 8 used: back to nearly full before the second's own ~20
        assert left > 5900, left
    else:  # the 2048 stay taken; at most a few seconds' refill came back
        assert left < 4500, left
