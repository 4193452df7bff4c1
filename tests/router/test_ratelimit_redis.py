"""The rate limits' shared store against a real Redis (Debian's redis-server, started and stopped by PID
on a loopback port): two router replicas (their limiters, then two whole in-process routers), one
tenant, the limit holds within one request;
corrections land in the shared buckets; a stopped server fails open to each replica's own buckets."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio
import yaml
from vllm_stack_dev.testbed.redis_server import RedisServer

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import metric_value, running_router, stubs
from vllm_stack.tenants.limiter import RateLimiter
from vllm_stack.tenants.ratelimit import Decision, TenantLimits
from vllm_stack.tenants.redis_store import MAX_CONNECTIONS, RedisBuckets

pytestmark = pytest.mark.redis

#: The store's timeout here: the test machines' two cores are shared, and a decision that times out
#: fails open (its own test below), which would make the exactness tests measure the load instead.
SLOW_MACHINE = 10.0


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[tuple[RateLimiter, RateLimiter, list[str]]]:
    """Two replicas' limiters on one Redis, each with its own connections; their store errors."""
    errors: list[str] = []
    made = [
        RateLimiter(
            {},
            shared=RedisBuckets(redis_server.url, SLOW_MACHINE),
            on_store_error=lambda n=n: errors.append(n),
        )
        for n in ("a", "b")
    ]
    yield made[0], made[1], errors
    for limiter in made:
        await limiter.close()


async def _take(limiter: RateLimiter, tenant: str, limits: TenantLimits, tokens: int) -> Decision:
    decision = limiter.take(tenant, limits, tokens)
    return decision if isinstance(decision, Decision) else await decision


async def test_two_replicas_hold_one_requests_limit_within_one_request(
    replicas: tuple[RateLimiter, RateLimiter, list[str]],
) -> None:
    one, two, errors = replicas
    limits = TenantLimits(requests_per_minute=20)
    # 60 requests at once, alternating between the replicas; the bucket refills 1 per 3 s meanwhile
    decisions = await asyncio.gather(*(_take(one if i % 2 else two, "t", limits, 0) for i in range(60)))
    allowed = sum(d.allowed for d in decisions)
    assert 20 <= allowed <= 21, allowed
    assert errors == []
    refused = [d for d in decisions if not d.allowed]
    assert all(0 < d.retry_after <= 3.0 for d in refused)
    assert all(d.requests is not None and d.requests.remaining < 1 for d in refused)


async def test_a_replica_holds_a_bounded_number_of_connections_to_the_store(
    redis_server: RedisServer,
) -> None:
    """600 decisions at once: they share at most MAX_CONNECTIONS connections, waiting for a free one
    (was: one connection each, as many as requests in flight, for a Redis that answers slowly)."""
    watcher = redis.asyncio.Redis.from_url(redis_server.url)
    before = (await watcher.info("stats"))["total_connections_received"]
    limiter = RateLimiter({}, shared=RedisBuckets(redis_server.url, SLOW_MACHINE))
    try:
        decisions = await asyncio.gather(
            *(_take(limiter, "t", TenantLimits(requests_per_minute=1000), 0) for _ in range(600))
        )
    finally:
        await limiter.close()
    after = (await watcher.info("stats"))["total_connections_received"]
    await watcher.aclose()
    assert sum(d.allowed for d in decisions) == 600
    assert after - before <= MAX_CONNECTIONS, after - before


async def test_two_replicas_hold_one_tokens_limit_and_share_the_corrections(
    replicas: tuple[RateLimiter, RateLimiter, list[str]],
) -> None:
    one, two, errors = replicas
    limits = TenantLimits(tokens_per_minute=1000)
    decisions = await asyncio.gather(*(_take(one if i % 2 else two, "t", limits, 100) for i in range(30)))
    admitted = [d for d in decisions if d.allowed]
    assert 10 <= len(admitted) <= 11, len(admitted)
    # replica one learns the answers used 10 tokens each: the refunds free room on replica two too
    for decision in admitted:
        one.settle("t", limits, decision, "200", b'"usage":{"prompt_tokens":6,"completion_tokens":4}')
    await one.close()  # waits for the pending corrections
    later = await _take(two, "t", limits, 100)
    assert later.allowed and later.tokens is not None
    assert later.tokens.remaining >= 1000 - 100 - 10 * len(admitted) - 100
    assert errors == []


async def test_a_huge_request_leaves_at_most_a_minutes_debt_and_a_short_expiry(
    redis_server: RedisServer, replicas: tuple[RateLimiter, RateLimiter, list[str]]
) -> None:
    """A reservation of 1e30 tokens (the buckets' own bound; the gate caps it at a minute before):
    the script succeeds (was: PEXPIRE refused a float's exponent after HSET wrote the debt), the debt
    is one minute's, and the key expires within the two minutes the bucket takes to fill."""
    one, _, errors = replicas
    limits = TenantLimits(tokens_per_minute=100_000)
    big = await _take(one, "t", limits, 10**30)
    assert big.allowed and big.tokens is not None and big.tokens.remaining == pytest.approx(-100_000)
    after = await _take(one, "t", limits, 1)
    assert not after.allowed and after.retry_after <= 121.0
    one.settle("t", limits, big, "200", b'"usage":{"prompt_tokens":1,"completion_tokens":99999999999}')
    await one.close()  # waits for the correction
    assert errors == []
    client = redis.asyncio.Redis.from_url(redis_server.url)
    ttl = await client.pttl("vllm-stack:ratelimit:t")
    await client.aclose()
    assert 0 < ttl <= 121_000, ttl


async def test_only_limited_axes_count_and_a_changed_limit_starts_full_in_redis(
    replicas: tuple[RateLimiter, RateLimiter, list[str]],
) -> None:
    """As the local buckets: 300 unlimited requests, then requests_per_minute: 60 lets the next go;
    a token limit added later starts full."""
    one, _, errors = replicas
    tokens_only = TenantLimits(tokens_per_minute=10**9)
    for _ in range(300):
        assert (await _take(one, "t", tokens_only, 1)).allowed
    both = TenantLimits(requests_per_minute=60, tokens_per_minute=10**9)
    first = await _take(one, "t", both, 1)
    assert first.allowed and first.requests is not None and first.requests.remaining == pytest.approx(59.0)
    with_less = TenantLimits(requests_per_minute=60, tokens_per_minute=600)
    added = await _take(one, "t", with_less, 600)
    assert added.allowed and added.tokens is not None and added.tokens.remaining == pytest.approx(0.0)
    assert errors == []


async def test_a_stopped_store_fails_open_to_each_replicas_buckets(
    redis_server: RedisServer, replicas: tuple[RateLimiter, RateLimiter, list[str]]
) -> None:
    one, _, errors = replicas
    limits = TenantLimits(requests_per_minute=2)
    assert (await _take(one, "t", limits, 0)).allowed
    redis_server.stop()
    outcomes = [(await _take(one, "t", limits, 0)).allowed for _ in range(3)]
    assert outcomes == [True, True, False]  # this replica's own bucket, full at first
    assert errors == ["a", "a", "a"]


async def test_two_routers_one_tenant_the_limit_holds_within_one_request(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Two router replicas (in-process, each with its own server and Redis connections) over one engine,
    one tenant limited to 10 requests a minute: 30 requests at once, spread over both, get 10 answers
    (11 if the bucket refilled one meanwhile, at 1 per 6 s) and 429s for the rest."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [{"name": "t", "requests_per_minute": 10}]}))
    environ = {"VLLM_STACK_RATE_LIMIT_REDIS_URL": redis_server.url}
    slow = {"rate_limit_store_timeout": SLOW_MACHINE}
    engine = StubEngine()
    async with (
        stubs(engine) as urls,
        running_router(urls, environ, tenants_file=str(tenants), **slow) as (one, router_one),
        running_router(urls, environ, tenants_file=str(tenants), **slow) as (two, router_two),
        httpx.AsyncClient(timeout=30, headers={"x-llm-d-inference-fairness-id": "t"}) as http,
    ):
        body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}]}
        answers = await asyncio.gather(
            *(http.post(f"{one if i % 2 else two}/v1/chat/completions", json=body) for i in range(30))
        )
        errors = [
            metric_value(r, "vllm_stack_router_rate_limit_store_errors_total")
            for r in (router_one, router_two)
        ]
    statuses = Counter(a.status_code for a in answers)
    assert set(statuses) == {200, 429}, statuses
    assert 10 <= statuses[200] <= 11, statuses
    assert engine.completed == statuses[200]
    assert errors == [0, 0]
    # both replicas answered and refused: the limit was shared, not split
    by_replica = Counter((str(a.request.url).startswith(one), a.status_code) for a in answers)
    assert all(by_replica[(side, 429)] > 0 for side in (True, False)), by_replica
    assert all(int(a.headers["retry-after"]) >= 1 for a in answers if a.status_code == 429)
