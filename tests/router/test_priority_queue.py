"""The router's per-model queue on its own: strict priority, FIFO within a class, bounds, displacement,
removal and compaction. Plain objects stand in for requests (the queue only asks them to try), so
the order is exact; the same queue under real HTTP is in test_priority.py, under real engines in
test_priority_engines.py."""

from __future__ import annotations

import asyncio

from vllm_stack.director.queue import RequestQueue
from vllm_stack.metrics import RouterMetrics


class Req:
    def __init__(self, name: str, priority: int, log: list[str], room: list[int]) -> None:
        self.name = name
        self.priority = priority
        self.queue_seq = 0
        self.queued_at = 0.0
        self.log = log
        self.room = room  # engines free now (shared by every request of a test)
        self.was_displaced = False
        self.held_back = False  # never past its share here (the tenant headroom: test_tenant_headroom)
        self.tenant = (
            "default"  # one tenant: the order within a band is arrival's (fairness: test_fair_queue)
        )

    def try_dispatch(self) -> str | None:
        if not self.room[0]:
            return None
        self.room[0] -= 1
        self.log.append(self.name)
        return "dispatched"

    def displaced(self) -> None:
        self.was_displaced = True


async def test_leaves_strictly_by_priority_then_in_arrival_order() -> None:
    queue = RequestQueue(RouterMetrics(), max_per_model=100)
    log: list[str] = []
    room = [0]
    order = [("s1", 0), ("c1", 5), ("s2", 0), ("low", -1), ("c2", 5), ("c0", 1), ("s3", 0)]
    for name, priority in order:
        assert queue.add("m", Req(name, priority, log, room))
    assert queue.length == 7 and queue.ahead("m", 0) and queue.ahead("m", 5) and not queue.ahead("m", 6)
    queue.dispatch("m")
    assert log == []  # no room: everyone keeps their place
    room[0] = 3
    queue.dispatch("m")
    assert log == ["c1", "c2", "c0"]
    room[0] = 10
    queue.kick("m")
    await asyncio.sleep(0)  # kicks run on the next loop turn, never inside the caller
    assert log == ["c1", "c2", "c0", "s1", "s2", "s3", "low"]
    assert queue.length == 0 and queue.describe() == {}
    queue.close()


async def test_a_full_queue_refuses_equals_and_displaces_the_newest_of_lower_priority() -> None:
    metrics = RouterMetrics()
    queue = RequestQueue(metrics, max_per_model=3)
    log: list[str] = []
    room = [0]
    s1, s2, s3 = (Req(f"s{i}", 0, log, room) for i in (1, 2, 3))
    for r in (s1, s2, s3):
        assert queue.add("m", r)
    assert not queue.add("m", Req("s4", 0, log, room))  # full of its equals: the caller answers 429
    critical = Req("c", 1, log, room)
    assert queue.add("m", critical)
    assert s3.was_displaced and not s1.was_displaced and not s2.was_displaced
    assert queue.length == 3
    room[0] = 5
    queue.dispatch("m")
    assert log == ["c", "s1", "s2"]
    sample = metrics.registry.get_sample_value
    labels = {"model": "m", "class": "standard"}
    assert sample("vllm_stack_router_queue_exits_total", {**labels, "outcome": "displaced"}) == 1
    assert sample("vllm_stack_router_queue_exits_total", {**labels, "outcome": "dispatched"}) == 2
    assert sample("vllm_stack_router_queue_wait_seconds_count", {"model": "m", "class": "critical"}) == 1
    assert sample("vllm_stack_router_queue_length", {"model": "m"}) == 0
    queue.close()


async def test_requests_that_leave_are_dropped_and_the_heap_stays_bounded() -> None:
    queue = RequestQueue(RouterMetrics(), max_per_model=10_000)
    log: list[str] = []
    room = [0]
    keep = Req("keep", 0, log, room)
    assert queue.add("m", keep)
    for i in range(5000):  # clients that come and go while the head cannot leave, of one tenant or many
        r = Req(f"gone{i}", 0, log, room)
        r.tenant = "default" if i % 2 else f"tenant{i}"
        assert queue.add("m", r)
        queue.remove("m", r, "client_closed")
    band = queue._queues["m"].bands[0]  # noqa: SLF001 - the bound is what is tested
    assert len(band.heap) <= 2 * 2 + 16 + 1 and queue.length == 1  # (two tenants wait at the most)
    assert list(band.flows) == ["default"] and len(band.flows["default"].requests) == 1
    room[0] = 1
    queue.dispatch("m")
    assert log == ["keep"] and queue.length == 0
    queue.close()


async def test_queues_of_models_are_independent() -> None:
    queue = RequestQueue(RouterMetrics(), max_per_model=1)
    log: list[str] = []
    room = [0]
    assert queue.add("a", Req("a1", 0, log, room))
    assert queue.add("b", Req("b1", 0, log, room))  # another model's bound
    assert not queue.ahead("b", 1) and queue.ahead("b", 0)
    room[0] = 1
    queue.dispatch("b")
    assert log == ["b1"] and queue.describe() == {"a": 1}
    queue.close()
