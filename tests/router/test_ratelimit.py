"""The rate limiter alone, on a fake clock: buckets, reservations and their correction, OpenAI's
header formats, and a failing shared store failing open to this replica's buckets."""

from __future__ import annotations

import asyncio

import pytest

from vllm_stack.director.rate_gate import unanswered_refund
from vllm_stack.scheduling.framework import Completion
from vllm_stack.tenants.limiter import RateLimiter, correction, used_tokens
from vllm_stack.tenants.ratelimit import (
    Decision,
    LocalBuckets,
    TenantLimits,
    duration,
    max_tokens,
    prompt_tokens,
    request_tokens,
)


class FakeClock:
    """Seconds that move only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _headers(raw: bytes) -> dict[str, str]:
    lines = raw.decode().split("\r\n")
    return dict(line.split(": ", 1) for line in lines if line)


def test_requests_per_minute_refuse_past_the_limit_and_refill_over_the_minute() -> None:
    clock = FakeClock()
    buckets = LocalBuckets(clock)
    limits = TenantLimits(requests_per_minute=3)
    assert [buckets.take("a", limits, 0).allowed for _ in range(4)] == [True, True, True, False]
    refused = buckets.take("a", limits, 0)
    assert not refused.allowed and refused.retry_after == pytest.approx(20.0)
    assert refused.retry_after_header() == b"20"
    clock.now += 19.9
    assert not buckets.take("a", limits, 0).allowed
    clock.now += 0.1
    assert buckets.take("a", limits, 0).allowed
    assert not buckets.take("a", limits, 0).allowed
    # another tenant has its own buckets
    assert buckets.take("b", limits, 0).allowed


def test_tokens_per_minute_take_both_or_neither() -> None:
    clock = FakeClock()
    buckets = LocalBuckets(clock)
    limits = TenantLimits(requests_per_minute=10, tokens_per_minute=600)
    first = buckets.take("a", limits, 500)
    assert first.allowed and first.reserved == 500
    refused = buckets.take("a", limits, 200)  # 100 left: needs 100 more, at 10 tokens per second
    assert not refused.allowed and refused.reserved == 0
    assert refused.retry_after == pytest.approx(10.0)
    # the refused request took no request either: 9 requests remain
    assert refused.requests is not None and refused.requests.remaining == pytest.approx(9.0)
    clock.now += 10
    assert buckets.take("a", limits, 200).allowed


def test_a_request_larger_than_the_minute_passes_on_a_full_bucket_and_leaves_at_most_a_minutes_debt() -> None:
    """The debt one request leaves is bounded by one window (the gate caps reservations at a minute
    too; this is the buckets' own bound, and the correction's: a usage far past the reservation)."""
    clock = FakeClock()
    buckets = LocalBuckets(clock)
    limits = TenantLimits(tokens_per_minute=100)
    big = buckets.take("a", limits, 250)
    assert big.allowed and big.tokens is not None and big.tokens.remaining == pytest.approx(-100.0)
    after = buckets.take("a", limits, 1)
    assert not after.allowed and after.retry_after == pytest.approx(101 * 60 / 100)
    clock.now += 120
    assert buckets.take("a", limits, 100).allowed
    buckets.adjust("a", limits, 10**30)  # a usage of 1e30 tokens: forgiven past one minute's debt
    later = buckets.take("a", limits, 1)
    assert later.tokens is not None and later.tokens.remaining == pytest.approx(-100.0)
    assert later.retry_after == pytest.approx(101 * 60 / 100)


def test_adjust_corrects_the_reservation_both_ways_and_never_past_full() -> None:
    clock = FakeClock()
    buckets = LocalBuckets(clock)
    limits = TenantLimits(tokens_per_minute=1000)
    buckets.take("a", limits, 800)
    buckets.adjust("a", limits, -700)  # used 100 of the 800 reserved
    assert buckets.take("a", limits, 900).allowed
    buckets.adjust("a", limits, 50)  # used 50 more than reserved
    refused = buckets.take("a", limits, 1)
    assert refused.tokens is not None and refused.tokens.remaining == pytest.approx(-50.0)
    buckets.adjust("a", limits, -10_000)
    full = buckets.take("a", limits, 0)
    assert full.tokens is not None and full.tokens.remaining == pytest.approx(1000.0)


def test_headers_are_openais() -> None:
    clock = FakeClock()
    buckets = LocalBuckets(clock)
    decision = buckets.take("a", TenantLimits(requests_per_minute=60, tokens_per_minute=150_000), 16)
    assert _headers(decision.headers()) == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-limit-tokens": "150000",
        "x-ratelimit-remaining-tokens": "149984",
        "x-ratelimit-reset-tokens": "6ms",
    }
    only_requests = buckets.take("b", TenantLimits(requests_per_minute=5), 16)
    assert set(_headers(only_requests.headers())) == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
    }


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0s"),
        (0.017, "17ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (360, "6m0s"),
        (90.25, "1m30.25s"),
        (3600, "1h0m0s"),
    ],
)
def test_duration_is_written_as_go_and_openai_write_it(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_what_a_request_reserves() -> None:
    assert max_tokens(b'{"max_tokens": 30}') == 30
    assert max_tokens(b'{"max_completion_tokens": 40, "max_tokens": 30}') == 40
    assert max_tokens(b'{"max_output_tokens": 7}') == 7
    assert max_tokens(b'{"max_tokens": "many"}') is None
    assert max_tokens(b"not json") is None
    # counted by the routing tokenizer: its count; else the prompt's bytes / 4, rounded up
    assert prompt_tokens(12, b"x" * 100) == 12
    assert prompt_tokens(None, b"x" * 101) == 26
    assert prompt_tokens(None, None) == 0
    assert request_tokens(12, b'{"max_tokens": 30}', 256, 4096, 10_000) == 42
    assert request_tokens(2, b"{}", 256, None, 10_000) == 2 + 256


def test_a_reservation_is_capped_at_the_models_context_and_one_minute() -> None:
    """A client's max_tokens of 1e9 (or 1e30) reserves at most the model's context, and never more
    than one minute's tokens: its tenant waits at most a minute for it, not days."""
    huge = b'{"max_tokens": 1000000000}'
    assert request_tokens(10, huge, 0, 4096, 100_000) == 4096
    assert request_tokens(10, huge, 0, None, 100_000) == 100_000
    assert request_tokens(10, b'{"max_tokens": 1e30}', 0, None, 100_000) <= 100_000
    assert request_tokens(10, b'{"max_tokens": 1000000000000000000000000000000}', 0, None, 100_000) == 100_000


def test_a_request_that_ended_unanswered_gives_back_its_output_and_the_next_may_go() -> None:
    """The reviewer's repro: tokens_per_minute 100000, max_tokens 1e9, the client gone while queued.
    The next request waits seconds at most (was: ~600000 s)."""
    clock = FakeClock()
    limits = TenantLimits(tokens_per_minute=100_000)
    limiter = RateLimiter({"t": limits}, local=LocalBuckets(clock))
    reserved = request_tokens(50, b'{"max_tokens": 1000000000}', 0, None, 100_000)
    decision = limiter.take("t", limits, reserved)
    assert isinstance(decision, Decision) and decision.allowed
    engine = object()
    queued = Completion(None, "client_closed", 1.0, None, None)
    assert unanswered_refund(queued, decision.reserved, 50) == decision.reserved  # never sent: all
    sent = Completion(engine, "client_closed", 1.0, None, b"")  # type: ignore[arg-type]
    assert unanswered_refund(sent, decision.reserved, 50) == decision.reserved - 50  # the output part
    broke = Completion(engine, "upstream_error", 1.0, None, b"")  # type: ignore[arg-type]
    assert unanswered_refund(broke, decision.reserved, 50) == decision.reserved - 50
    streamed = Completion(engine, "client_closed", 1.0, 0.2, b"data: {}")  # type: ignore[arg-type]
    assert unanswered_refund(streamed, decision.reserved, 50) == 0  # the answer was under way: it stands
    answered = Completion(engine, "200", 1.0, None, b"{}")  # type: ignore[arg-type]
    assert unanswered_refund(answered, decision.reserved, 50) == 0
    limiter.settle(
        "t", limits, decision, "client_closed", None, unanswered_refund(queued, decision.reserved, 50)
    )
    after = limiter.take("t", limits, 1000)
    assert isinstance(after, Decision) and after.allowed
    # the engine was reached: the prompt part stays, the next small request still passes at once
    second = limiter.take("t", limits, reserved)
    assert isinstance(second, Decision) and not second.allowed and second.retry_after <= 60.0
    clock.now += 60
    second = limiter.take("t", limits, reserved)
    assert isinstance(second, Decision) and second.allowed
    limiter.settle("t", limits, second, "client_closed", b"", unanswered_refund(sent, second.reserved, 50))
    nxt = limiter.take("t", limits, 1000)
    assert isinstance(nxt, Decision) and nxt.allowed, nxt


def test_usage_corrects_the_reservation() -> None:
    clock = FakeClock()
    decision = LocalBuckets(clock).take("a", TenantLimits(tokens_per_minute=1000), 300)
    body = b'{"id":"x","usage":{"prompt_tokens":20,"total_tokens":25,"completion_tokens":5}}'
    assert used_tokens(body) == 25
    stream = b'data: {"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":9}}\n\ndata: [DONE]\n\n'
    assert used_tokens(stream) == 29
    assert correction(decision, "200", body) == 25 - 300
    assert correction(decision, "200", b'{"choices":[]}') == 0  # no usage: the reservation stays
    assert correction(decision, "client_closed", None) == 0
    assert correction(decision, "400", b'{"error":{}}') == -300  # refused: nothing generated


class _BrokenStore:
    url = "redis://:secret@127.0.0.1:1/0"

    def __init__(self) -> None:
        self.calls = 0

    async def take(self, tenant: str, limits: TenantLimits, tokens: int) -> object:
        self.calls += 1
        raise ConnectionError("refused")

    async def adjust(self, tenant: str, limits: TenantLimits, delta: int) -> None:
        raise ConnectionError("refused")

    async def close(self) -> None:
        pass


def test_a_failing_store_fails_open_to_this_replicas_buckets(caplog: pytest.LogCaptureFixture) -> None:
    errors: list[int] = []
    store = _BrokenStore()
    clock = FakeClock()
    limits = TenantLimits(requests_per_minute=2)
    limiter = RateLimiter(
        {"a": limits}, shared=store, local=LocalBuckets(clock), on_store_error=lambda: errors.append(1)
    )

    async def run() -> list[bool]:
        out = []
        for _ in range(3):
            decision = limiter.take("a", limits, 0)
            assert not isinstance(decision, type(None))
            out.append((await decision).allowed)  # type: ignore[misc]
        return out

    with caplog.at_level("WARNING"):
        assert asyncio.run(run()) == [True, True, False]  # still limited: per replica
    assert len(errors) == 3 and store.calls == 3
    warnings = [r.getMessage() for r in caplog.records if "rate-limit store" in r.getMessage()]
    assert len(warnings) == 1 and "secret" not in warnings[0], warnings


def test_limits_for_a_tenant_and_the_default() -> None:
    limiter = RateLimiter(
        {"a": TenantLimits(requests_per_minute=5), "b": TenantLimits()},
        default=TenantLimits(tokens_per_minute=100),
    )
    assert limiter.limits_for("a") == TenantLimits(requests_per_minute=5)
    assert limiter.limits_for("b") == TenantLimits(tokens_per_minute=100)  # b sets none: the default's
    assert limiter.limits_for("zz") == TenantLimits(tokens_per_minute=100)
    assert RateLimiter({}).limits_for("zz") is None


def test_only_limited_axes_count_and_a_changed_limit_starts_full() -> None:
    """A reload that adds requests_per_minute: 60 after 5000 unlimited requests lets the next one go
    (was: refused for 5000 s); a token limit added later starts full (was: empty); a changed limit
    starts full; a correction made under the old token limit is dropped."""
    clock = FakeClock()
    buckets = LocalBuckets(clock)
    tokens_only = TenantLimits(tokens_per_minute=10**9)
    for _ in range(5000):
        assert buckets.take("a", tokens_only, 1).allowed
    both = TenantLimits(requests_per_minute=60, tokens_per_minute=10**9)
    first = buckets.take("a", both, 1)
    assert first.allowed and first.requests is not None and first.requests.remaining == pytest.approx(59.0)
    requests_only = TenantLimits(requests_per_minute=1000)
    for _ in range(10):
        assert buckets.take("b", requests_only, 500).allowed
    with_tokens = TenantLimits(requests_per_minute=1000, tokens_per_minute=600)
    added = buckets.take("b", with_tokens, 600)
    assert added.allowed and added.tokens is not None and added.tokens.remaining == pytest.approx(0.0)
    assert added.requests is not None and added.requests.remaining == pytest.approx(989.0)  # kept
    raised = TenantLimits(requests_per_minute=1000, tokens_per_minute=1200)
    buckets.adjust("b", raised, 500)  # a correction for a request taken under other limits: dropped
    again = buckets.take("b", raised, 1200)
    assert again.allowed and again.tokens is not None and again.tokens.remaining == pytest.approx(0.0)
    buckets.adjust("b", with_tokens, -1200)  # the old limit's refund: the bucket is another now
    assert not buckets.take("b", raised, 1).allowed
