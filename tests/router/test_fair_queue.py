"""Fair queueing (docs/tenants.md): within a priority band waiting requests leave by tenant in turn,
weighted, not in arrival order; bands stay strict; each band is bounded, a full one pushing out the
heaviest tenant's newest request before refusing a lighter tenant's. The queue on its own with plain
objects standing in for requests (the order is exact), then the bounds' answers over real HTTP.

Each order asserted here fails on the queue before tenants (one heap by priority, then arrival):
the quiet tenant's requests came after all of the noisy one's, departures followed arrivals 1:1
whatever the weights, and a full queue refused every request of the band's priority."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.fakes.stub_engine import StubEngine
from tests.router.helpers import http, running_router, stubs, wait_for
from tests.router.test_priority_queue import Req
from vllm_stack.director.queue import RETURNING_BOUND, RequestQueue
from vllm_stack.metrics import RouterMetrics
from vllm_stack.tenants.declaration import TenantSpec, TenantTable

BASE = "stub-model"
CHAT = {"model": BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
FAIRNESS = "x-llm-d-inference-fairness-id"


def req(name: str, tenant: str, log: list[str], room: list[int], priority: int = 0) -> Req:
    r = Req(name, priority, log, room)
    r.tenant = tenant
    return r


def drain(queue: RequestQueue, room: list[int], n: int) -> None:
    """``n`` engines free up one after another, each taken by the queue's head."""
    for _ in range(n):
        room[0] = 1
        queue.dispatch("m")


async def test_a_tenant_sending_ten_times_more_cannot_put_another_behind_all_of_its_own() -> None:
    queue = RequestQueue(RouterMetrics(), max_per_model=100)
    log: list[str] = []
    room = [0]
    for i in range(10):
        assert queue.add("m", req(f"noisy{i}", "noisy", log, room))
    for i in range(2):
        assert queue.add("m", req(f"quiet{i}", "quiet", log, room))
    drain(queue, room, 4)
    # in turn: the quiet tenant's two leave among the first four, not after ten of the noisy one's
    assert log == ["noisy0", "quiet0", "noisy1", "quiet1"]
    drain(queue, room, 8)
    assert log[4:] == [f"noisy{i}" for i in range(2, 10)]  # each tenant's own stay in arrival order
    assert queue.length == 0
    queue.close()


async def test_weights_two_to_one_give_two_to_one_departures_under_saturation() -> None:
    tenants = TenantTable([TenantSpec("gold", weight=2.0), TenantSpec("bronze", weight=1.0)])
    queue = RequestQueue(RouterMetrics(), max_per_model=1000, tenants=tenants)
    log: list[str] = []
    room = [0]
    for i in range(60):
        assert queue.add("m", req(f"bronze{i}", "bronze", log, room))
    for i in range(60):
        assert queue.add("m", req(f"gold{i}", "gold", log, room))
    drain(queue, room, 60)
    gold = sum(name.startswith("gold") for name in log)
    assert (gold, 60 - gold) == (40, 20), log
    # and at every point, not only on the whole: no run of one tenant longer than its share
    for k in range(3, 61, 3):
        assert abs(sum(n.startswith("gold") for n in log[:k]) - 2 * k / 3) <= 1, log[:k]
    queue.close()


async def test_a_higher_priority_never_waits_behind_a_lower_band_whatever_its_tenant() -> None:
    queue = RequestQueue(RouterMetrics(), max_per_model=100)
    log: list[str] = []
    room = [0]
    for i in range(5):
        assert queue.add("m", req(f"std{i}", "noisy", log, room))
    assert queue.add("m", req("crit", "quiet", log, room, priority=1))
    assert queue.add("m", req("shed", "quiet", log, room, priority=-1))
    assert queue.ahead("m", 1) and not queue.ahead("m", 2)
    drain(queue, room, 7)
    assert log == ["crit", "std0", "std1", "std2", "std3", "std4", "shed"]
    queue.close()


async def test_a_tenant_that_was_idle_banks_no_credit() -> None:
    queue = RequestQueue(RouterMetrics(), max_per_model=100)
    log: list[str] = []
    room = [0]
    for i in range(6):
        assert queue.add("m", req(f"a{i}", "a", log, room))
    drain(queue, room, 4)  # "a" alone for a while: b was not waiting
    for i in range(3):
        assert queue.add("m", req(f"b{i}", "b", log, room))
    drain(queue, room, 5)
    # b starts at the band's virtual time (a's last departure), not at 0: one turn ahead, then in turn
    assert log == ["a0", "a1", "a2", "a3", "b0", "a4", "b1", "a5", "b2"], log
    queue.close()


async def test_a_full_band_pushes_out_the_heaviest_tenants_newest_before_refusing_a_lighter_one() -> None:
    metrics = RouterMetrics()
    queue = RequestQueue(metrics, max_per_model=100, max_per_band=3)
    log: list[str] = []
    room = [0]
    noisy = [req(f"noisy{i}", "noisy", log, room) for i in range(3)]
    for r in noisy:
        assert queue.add("m", r)
    assert not queue.add("m", req("noisy3", "noisy", log, room))  # its own band is full of its own
    assert queue.add("m", req("quiet0", "quiet", log, room))  # room made: the noisy tenant's newest out
    assert noisy[2].was_displaced and not noisy[0].was_displaced and not noisy[1].was_displaced
    assert queue.add("m", req("other0", "other", log, room))
    assert noisy[1].was_displaced
    # now 1 each: a second of any tenant would make it the heaviest, so it is refused
    assert not queue.add("m", req("quiet1", "quiet", log, room))
    assert queue.add("m", req("crit", "noisy", log, room, priority=1))  # another band, its own bound
    drain(queue, room, 4)
    assert log == ["crit", "noisy0", "quiet0", "other0"]
    sample = metrics.registry.get_sample_value
    labels = {"model": "m", "class": "standard"}
    assert sample("vllm_stack_router_queue_exits_total", {**labels, "outcome": "displaced"}) == 2
    queue.close()


async def test_a_tenant_that_keeps_one_request_waiting_takes_turns_with_a_backlogged_one() -> None:
    """Tenant a sends its next request whenever its last one left; b has a backlog, same weight. They
    leave in turn (was: a came back at the band's time, its own last tag, and took every turn)."""
    queue = RequestQueue(RouterMetrics(), max_per_model=100)
    log: list[str] = []
    room = [0]
    for i in range(20):
        assert queue.add("m", req(f"b{i}", "b", log, room))
    sent = 0
    for _ in range(20):
        if sent == 0 or f"a{sent - 1}" in log:  # its last one left: it sends the next
            assert queue.add("m", req(f"a{sent}", "a", log, room))
            sent += 1
        drain(queue, room, 1)
    a_turns = sum(r.startswith("a") for r in log)
    assert 9 <= a_turns <= 11, log  # half the turns, not all of them
    queue.close()


async def test_the_tags_a_band_remembers_stay_bounded_with_many_tenants_coming_and_going() -> None:
    """Each of 3,000 tenants (named by a header: the client's to make up) waits once and leaves ahead of
    the band's time, beside a backlogged one: what the band keeps of them stays bounded."""
    queue = RequestQueue(RouterMetrics(), max_per_model=10_000)
    log: list[str] = []
    room = [0]
    for i in range(3000):
        assert queue.add("m", req(f"b{i}", "b", log, room))
    for i in range(3000):
        assert queue.add("m", req(f"x{i}", f"made-up-{i}", log, room))
        drain(queue, room, 1)
        assert len(queue._queues["m"].bands[0].returning) <= RETURNING_BOUND
    queue.close()


async def test_among_equally_heavy_tenants_the_one_that_began_waiting_last_gives_way() -> None:
    """As docs/tenants.md says: a full band pushes out the newest request of its heaviest tenant; among
    equals, the tenant that began waiting last (was: the first, whose oldest requests waited longest)."""
    queue = RequestQueue(RouterMetrics(), max_per_model=100, max_per_band=4)
    log: list[str] = []
    room = [0]
    a = [req(f"a{i}", "a", log, room) for i in range(2)]
    b = [req(f"b{i}", "b", log, room) for i in range(2)]
    for r in (a[0], a[1], b[0], b[1]):
        assert queue.add("m", r)
    assert queue.add("m", req("c0", "c", log, room))
    assert b[1].was_displaced
    assert not any(r.was_displaced for r in (a[0], a[1], b[0]))
    queue.close()


async def test_a_full_model_pushes_out_its_lowest_bands_heaviest_tenant() -> None:
    queue = RequestQueue(RouterMetrics(), max_per_model=3)
    log: list[str] = []
    room = [0]
    a1, a2, b1 = req("a1", "a", log, room), req("a2", "a", log, room), req("b1", "b", log, room)
    for r in (a1, b1, a2):
        assert queue.add("m", r)
    assert queue.add("m", req("crit", "c", log, room, priority=1))
    assert a2.was_displaced and not a1.was_displaced and not b1.was_displaced
    queue.close()


async def test_over_http_a_full_band_answers_429_queue_full_with_the_reason_header() -> None:
    a = StubEngine("a", [BASE])
    a.waiting = 9  # saturated: standard requests wait in the queue
    async with (
        stubs(a) as urls,
        running_router(urls, queue_max_per_band=2, queue_timeout=30) as (url, router),
        http(url) as h,
    ):
        await wait_for(
            lambda: (t := router.registry.engines()[0].fresh_telemetry()) is not None and t.waiting == 9,
            what="the engine's saturation scraped",
        )

        def post(tenant: str) -> asyncio.Task[httpx.Response]:
            return asyncio.create_task(h.post("/v1/chat/completions", json=CHAT, headers={FAIRNESS: tenant}))

        noisy = [post("noisy"), post("noisy")]
        await wait_for(lambda: router.queue.length == 2, what="two of the noisy tenant's waiting")
        refused = await post("noisy")
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert refused.headers["x-llm-d-request-dropped-reason"] == "queue_full"
        assert refused.headers["retry-after"] == "1"
        quiet = post("quiet")
        pushed_out = await asyncio.wait_for(noisy[1], 10)  # the noisy tenant's newest made room
        assert pushed_out.status_code == 429 and pushed_out.headers["x-llm-d-request-dropped-reason"] == (
            "queue_full"
        )
        assert router.queue.length == 2
        a.waiting = 0
        assert (await asyncio.wait_for(quiet, 10)).status_code == 200
        assert (await asyncio.wait_for(noisy[0], 10)).status_code == 200


async def test_tenants_metrics_count_waits_and_rejections_under_bounded_labels() -> None:
    metrics = RouterMetrics()
    queue = RequestQueue(
        metrics, max_per_model=100, max_per_band=2, tenants=TenantTable([TenantSpec("gold", weight=1.0)])
    )
    log: list[str] = []
    room = [0]
    made_up = [req(f"x{i}", f"made-up-{i}", log, room) for i in range(2)]
    for r in made_up:
        assert queue.add("m", r)
    assert not queue.add("m", req("x2", "made-up-2", log, room))  # 1 each already: refused
    gold = req("g", "gold", log, room)
    assert queue.add("m", gold) is False  # no tenant is heavier than gold would be: refused too
    queue.remove("m", made_up[0], "timeout")
    assert queue.add("m", gold)
    drain(queue, room, 2)
    sample = metrics.registry.get_sample_value
    rejected = "vllm_stack_router_tenant_rejections_total"
    assert sample(rejected, {"tenant": "other", "reason": "queue_full"}) == 1
    assert sample(rejected, {"tenant": "gold", "reason": "queue_full"}) == 1
    assert sample(rejected, {"tenant": "other", "reason": "queue_timeout"}) == 1
    waits = "vllm_stack_router_tenant_queue_wait_seconds_count"
    assert sample(waits, {"model": "m", "class": "standard", "tenant": "other"}) == 2
    assert sample(waits, {"model": "m", "class": "standard", "tenant": "gold"}) == 1
    # the other developers' reasons are declared; nothing else is counted
    metrics.tenant_rejected("gold", "rate_limited")
    metrics.tenant_rejected("gold", "evicted")
    with pytest.raises(ValueError, match="not a tenant rejection reason"):
        metrics.tenant_rejected("gold", "made_up")
    metrics.tenant_tokens_child("gold").set(1234)
    assert sample("vllm_stack_router_tenant_tokens", {"tenant": "gold"}) == 1234
    assert {
        s.labels["tenant"]
        for f in metrics.registry.collect()
        if f.name.startswith("vllm_stack_router_tenant")
        for s in f.samples
    } <= {"gold", "other"}
    queue.close()
