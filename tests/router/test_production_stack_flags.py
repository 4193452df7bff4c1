"""production-stack's 2026 router flags (issue 52 item 3), each given on the command line as a
production-stack user writes it and checked through a running router: what the flag parses to, and
what the router then does differently (with the flag against without it).

Stub engines stand in for vLLM: these tests need engines that fail on demand and that report which
requests they were sent (tests/fakes/stub_engine.py)."""

from __future__ import annotations

from typing import Any

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import http, running_router, stubs
from vllm_stack.router_cli import build_parser

MSG = [{"role": "user", "content": "hi"}]
BODY = {"model": "stub-model", "messages": MSG, "max_tokens": 3}


def flags(*argv: str) -> dict[str, Any]:
    """The settings ``vllm-stack router ARGV`` gives (what the command line passes the router)."""
    args = vars(build_parser().parse_args(list(argv)))
    return {
        k: v for k, v in args.items() if v is not None and k != "config_file" and not k.startswith("hosted_")
    }


def route(r: Any) -> dict[str, str]:  # noqa: ANN401 - an httpx response
    """The x-vllm-stack-route header (debug headers on) as a mapping."""
    parts = [p.strip().split("=", 1) for p in r.headers["x-vllm-stack-route"].split(";")]
    return {k: v for k, v in parts}


# ---- --max-instance-failover-reroute-attempts: our retries -------------------------------------------


def test_reroute_attempts_is_the_retries_setting() -> None:
    assert flags("--max-instance-failover-reroute-attempts", "0") == {"retries": 0}
    assert flags("--max-instance-failover-reroute-attempts", "3")["retries"] == 3


async def _codes_with_one_failing_engine(*argv: str) -> list[int]:
    """Two round-robin requests over two engines whose first answers 503 once."""
    a, b = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    a.behaviour.fail_statuses = [503]
    settings = flags("--routing-logic", "roundrobin", *argv)
    async with stubs(a, b) as urls, running_router(urls, **settings) as (url, _), http(url) as h:
        return [(await h.post("/v1/chat/completions", json=BODY)).status_code for _ in range(2)]


async def test_reroute_attempts_reroute_a_failed_request_to_another_engine() -> None:
    # production-stack's default, 0: the engine's 503 reaches the client
    assert 503 in await _codes_with_one_failing_engine("--max-instance-failover-reroute-attempts", "0")
    # 1: the failed attempt goes to the other engine
    assert await _codes_with_one_failing_engine("--max-instance-failover-reroute-attempts", "1") == [200, 200]


# ---- --prefix-min-match-length: the prefix-cache picker's minimum match ----------------------------------


def test_prefix_min_match_length_parses_in_characters() -> None:
    assert flags("--prefix-min-match-length", "4096") == {"prefix_min_match_length": 4096}


async def _second_reason(*argv: str) -> str:
    """The prefix picker's reason for the second of two equal long prompts."""
    prompt = [{"role": "user", "content": "the same long question about the handbook " * 40}]
    body = {"model": "stub-model", "messages": prompt, "max_tokens": 3}
    settings = flags("--routing-logic", "prefixaware", "--debug-headers", *argv)
    engines = StubEngine("a", ["stub-model"]), StubEngine("b", ["stub-model"])
    async with stubs(*engines) as urls, running_router(urls, **settings) as (url, _), http(url) as h:
        first = await h.post("/v1/chat/completions", json=body)
        assert route(first)["reason"] == "prefix_miss"
        return route(await h.post("/v1/chat/completions", json=body))["reason"]


async def test_a_match_shorter_than_the_minimum_is_placed_as_a_new_prefix() -> None:
    assert await _second_reason() == "prefix_hit"
    # the prompt's ~1,800 characters are all cached on one engine; a minimum above that ignores the match
    assert await _second_reason("--prefix-min-match-length", "100000") == "prefix_spread"
    assert await _second_reason("--prefix-min-match-length", "128") == "prefix_hit"
