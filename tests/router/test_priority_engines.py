"""Request priority against real vLLM engines: the burst the issue names, and vLLM's own priority
scheduling receiving each request's priority.

The engine here runs two sequences at once (``--max-num-seqs 2``), so a handful of requests saturate
it, and schedules its own queue by priority (``--scheduling-policy priority``). The router's limits
are lowered to that engine's size: saturated at one waiting request, critical requests held at three.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest
from vllm_stack_dev.testbed.engines import Engine

from tests.router.helpers import running_router, wait_for

pytestmark = pytest.mark.engine

MODEL = "tiny-llama"
PRIO = "x-request-priority"
# Longer than the test needs them to run: the priority engine's --max-model-len is 4096.
HELD_TOKENS = 4000


def chat(max_tokens: int) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a story."}],
        "max_tokens": max_tokens,
        "min_tokens": max_tokens,  # random weights may stop at once: each request does its work
        "stream": True,
    }


async def streamed(
    h: httpx.AsyncClient, body: dict[str, object], headers: dict[str, str]
) -> tuple[int, float]:
    """(status, monotonic time of its first byte of answer)."""
    async with h.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        first = None
        async for _ in r.aiter_bytes():
            if first is None:
                first = time.monotonic()
        return r.status_code, first if first is not None else time.monotonic()


async def test_a_burst_larger_than_capacity_sheds_sheddable_and_drains_by_priority(
    priority_engine: Engine,
) -> None:
    settings = {
        "models": [{"name": MODEL, "engine_priority": True}],
        "saturation_max_waiting": 1,
        "critical_max_waiting": 3,
        "queue_timeout": 120,
        "routing_logic": "leastloaded",
    }
    environ = {"VLLM_STACK_PRIORITY_API_KEYS": "k"}
    done_before = priority_engine.metric_value("vllm:request_success_total")
    async with running_router([priority_engine.url], environ=environ, **settings) as (url, router):
        engine = router.registry.engines()[0]
        async with httpx.AsyncClient(base_url=url, timeout=180, headers={"authorization": "Bearer k"}) as h:
            # Fill it: two run, four wait (the engine's queue, as its /metrics says).
            fillers = [asyncio.create_task(streamed(h, chat(96), {})) for _ in range(6)]
            await wait_for(
                lambda: (t := engine.fresh_telemetry()) is not None and t.waiting >= 3,
                60,
                "the engine queuing",
            )
            # The burst, classes interleaved in arrival order.
            burst: list[tuple[str, asyncio.Task[tuple[int, float]]]] = []
            for i in range(18):
                cls = ("standard", "critical", "sheddable")[i % 3]
                burst.append((cls, asyncio.create_task(streamed(h, chat(8), {PRIO: cls}))))
                await asyncio.sleep(0.01)
            await wait_for(lambda: router.queue.length >= 10, 30, "critical and standard queued")
            results = [(cls, await task) for cls, task in burst]
            filled = [await f for f in fillers]
    by_class: dict[str, list[tuple[int, float]]] = {}
    for cls, outcome in results:
        by_class.setdefault(cls, []).append(outcome)
    assert [s for s, _ in filled] == [200] * 6
    assert [s for s, _ in by_class["critical"]] == [200] * 6
    assert [s for s, _ in by_class["standard"]] == [200] * 6
    assert [s for s, _ in by_class["sheddable"]] == [429] * 6  # shed at once, never queued
    # Drained by priority: every critical request of the burst started before any standard one.
    assert max(t for _, t in by_class["critical"]) < min(t for _, t in by_class["standard"])
    # Nothing lost or answered twice: the engine finished exactly the requests answered 200.
    done = priority_engine.metric_value("vllm:request_success_total") - done_before
    assert done == 6 + 6 + 6
    assert router.queue.length == 0


async def held(h: httpx.AsyncClient, streaming: asyncio.Event) -> None:
    """A request long enough to hold one of the engine's two sequences until the test cancels it
    (the client leaves, the router closes its upstream connection, the engine aborts it); sets
    ``streaming`` at its first byte of answer: it runs in the engine then, no longer waits there."""
    async with h.stream("POST", "/v1/chat/completions", json=chat(HELD_TOKENS)) as r:
        assert r.status_code == 200, await r.aread()
        async for _ in r.aiter_bytes():
            streaming.set()
    raise AssertionError(f"a held request ended by itself ({HELD_TOKENS} tokens) before the test let it go")


async def test_an_engine_scheduling_by_priority_gets_each_requests_priority(priority_engine: Engine) -> None:
    """With the router's own priority chains off, every request goes straight to the engine; the
    engine then runs critical requests (vLLM priority -1, written by the router) before standard
    ones that were waiting there first, which it would not do had the field not reached it.

    The engine's two sequences are held by requests that end only when the test lets them go, once
    its queue holds all six others: had they ended by their length (64 tokens took 0.8-2.6 s here,
    0.07-0.5 s after the critical requests reached the queue), a standard request could take a freed
    sequence before the critical ones arrived, and did on a loaded machine."""
    settings = {
        "models": [{"name": MODEL, "engine_priority": True}],
        "priority_scheduling": False,
        "routing_logic": "leastloaded",
    }
    environ = {"VLLM_STACK_PRIORITY_API_KEYS": "k"}
    async with running_router([priority_engine.url], environ=environ, **settings) as (url, router):
        engine = router.registry.engines()[0]

        def waiting_there(n: int) -> Callable[[], bool]:
            return lambda: (t := engine.fresh_telemetry()) is not None and t.waiting >= n

        async with httpx.AsyncClient(base_url=url, timeout=180, headers={"authorization": "Bearer k"}) as h:
            streaming = [asyncio.Event() for _ in range(2)]
            holders = [asyncio.create_task(held(h, e)) for e in streaming]
            await wait_for(lambda: all(e.is_set() for e in streaming), 60, "two held requests running")
            first_come = [asyncio.create_task(streamed(h, chat(8), {})) for _ in range(4)]
            await wait_for(waiting_there(4), 60, "four standard requests waiting in the engine")
            critical = [asyncio.create_task(streamed(h, chat(8), {PRIO: "critical"})) for _ in range(2)]
            await wait_for(waiting_there(6), 60, "two critical requests waiting there too")
            for holder in holders:
                assert not holder.done(), holder.exception()
                holder.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            waited = [await t for t in first_come]
            urgent = [await t for t in critical]
    assert [s for s, _ in waited + urgent] == [200] * 6
    assert max(t for _, t in urgent) < min(t for _, t in waited)
