"""Faults on real vLLM engines (CPU build), with the router's and chart's default health, scrape and
breaker settings: a killed engine, a hung one (SIGSTOP), a busy one, one restarted on its port.

What must hold (issue 9): no request that had not started streaming fails when an engine is killed
under load, and the dead engine is ejected within 1 s; a hung engine's circuit opens within 5 s and
new requests go elsewhere, SIGCONT brings it back; an engine busy for 20 s is not ejected; an engine
restarted at the same address gets traffic within 2 s of being ready and no request fails on a
stale pooled connection. The module starts one engine of its own (``victim``) beside the session's
``engines[0]`` (the survivor), and restarts it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator

import openai
import pytest

from tests.router.helpers import client, running_router, wait_for
from vllm_stack.discovery.circuit import BreakerState
from vllm_stack.testbed.engines import EngineSpec, launch, wait_ready

pytestmark = pytest.mark.engine

MODEL = "tiny-llama"
LONG_TOKENS = 1800  # one non-streamed answer: the engine sends nothing for its whole generation
DEFAULTS = {  # the chart's routerSpec defaults (helm/values.yaml), not the fast test settings
    "health_check_interval": 5.0,
    "engine_scrape_interval": 1.0,
    "health_failure_threshold": 3,
    "health_success_threshold": 2,
}


@pytest.fixture(scope="module")
def victim(tiny_model_dir, engine_logs_dir):  # noqa: ANN001, ANN201
    spec = EngineSpec(tiny_model_dir, MODEL, kv_events=False, enable_lora=False)
    engine = launch(spec, name="victim", cpu=None, log_dir=engine_logs_dir)
    holder = {"engine": engine, "spec": spec}
    try:
        wait_ready([engine], 420)
        yield holder
    finally:
        holder["engine"].signal(signal.SIGCONT)
        holder["engine"].stop()


class Load:
    """``workers`` clients sending short non-streamed completions in a loop; every outcome counted."""

    def __init__(self, url: str, workers: int = 4) -> None:
        self.client = client(url).with_options(timeout=120)
        self.workers = workers
        self.ok = 0
        self.failed: list[str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _worker(self) -> None:
        while not self._stop.is_set():
            try:
                await self.client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
                self.ok += 1
            except openai.APIError as exc:
                self.failed.append(f"{type(exc).__name__}: {exc}")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Load]:
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(self.workers)]
        try:
            yield self
        finally:
            self._stop.set()
            await asyncio.gather(*self._tasks)


async def test_busy_engine_is_not_ejected(victim, engines) -> None:
    """A request that keeps the engine silent for 20 s (non-streamed, long generation) is not a
    failure: scrapes and health checks are answered by vLLM's API server meanwhile."""
    engine_proc = victim["engine"]
    async with running_router([engine_proc.url], **DEFAULTS) as (url, router):
        engine = router.registry.get(engine_proc.address)
        assert engine is not None
        c = client(url).with_options(timeout=300)
        long = asyncio.ensure_future(
            c.completions.create(model=MODEL, prompt="a", max_tokens=LONG_TOKENS, extra_body={"ignore_eos": True})
        )
        started = time.monotonic()
        states = set()
        while not long.done():
            states.add((engine.healthy, engine.breaker.state))
            await asyncio.sleep(0.1)
        busy_for = time.monotonic() - started
        result = long.result()
        assert result.usage.completion_tokens == LONG_TOKENS
        assert states == {(True, BreakerState.CLOSED)}, states
        print(f"engine busy (silent) for {busy_for:.1f} s without ejection")
        assert busy_for >= 20, f"the long request took only {busy_for:.1f} s"


async def test_hung_engine_opens_its_circuit_and_comes_back(victim, engines) -> None:
    engine_proc = victim["engine"]
    async with running_router([engine_proc.url, engines[0].url], routing_logic="roundrobin", **DEFAULTS) as (
        url,
        router,
    ):
        engine = router.registry.get(engine_proc.address)
        assert engine is not None
        load = Load(url, workers=2)
        async with load.running():
            await wait_for(lambda: load.ok >= 10, 60, "requests flowing")
            engine_proc.signal(signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                await wait_for(lambda: engine.breaker.state is BreakerState.OPEN, 10, "the circuit to open")
                opened_after = time.monotonic() - stopped
                ok_then = load.ok
                await wait_for(lambda: load.ok >= ok_then + 10, 60, "requests served elsewhere")
            finally:
                engine_proc.signal(signal.SIGCONT)
            resumed = time.monotonic()
            await wait_for(lambda: engine.breaker.state is BreakerState.CLOSED, 10, "the circuit to close")
            closed_after = time.monotonic() - resumed
            before = engine_proc.metric_value("vllm:request_success_total")
            await wait_for(
                lambda: engine_proc.metric_value("vllm:request_success_total") > before + 2, 30, "traffic back"
            )
        print(f"circuit open {opened_after:.1f} s after SIGSTOP, closed {closed_after:.1f} s after SIGCONT")
        assert opened_after <= 5.0
        # requests caught on the hung engine waited for it (they were not lost); none failed
        assert load.failed == []


async def test_killed_engine_loses_no_request_and_restart_gets_traffic(
    victim, engines, engine_logs_dir
) -> None:
    engine_proc = victim["engine"]
    async with running_router([engine_proc.url, engines[0].url], routing_logic="roundrobin", **DEFAULTS) as (
        url,
        router,
    ):
        engine = router.registry.get(engine_proc.address)
        assert engine is not None
        load = Load(url, workers=4)
        async with load.running():
            await wait_for(lambda: load.ok >= 20 and engine.in_flight > 0, 60, "load on both engines")
            engine_proc.kill()
            killed = time.monotonic()
            await wait_for(lambda: not engine.healthy, 5, "ejection")
            ejected_after = time.monotonic() - killed
            ok_then = load.ok
            await wait_for(lambda: load.ok >= ok_then + 20, 60, "requests served by the survivor")
            # Restart on the same port: pooled connections to the old process are stale by now.
            new = launch(
                victim["spec"], name="victim-restarted", cpu=None, log_dir=engine_logs_dir, port=engine_proc.port
            )
            victim["engine"] = new
            await asyncio.to_thread(wait_ready, [new], 420)
            ready = time.monotonic()
            await wait_for(
                lambda: new.metric_value("vllm:request_success_total") >= 1, 10, "traffic on the restarted engine"
            )
            traffic_after = time.monotonic() - ready
            ok_then = load.ok
            await wait_for(lambda: load.ok >= ok_then + 20, 60, "more requests after the restart")
        print(f"ejected {ejected_after:.2f} s after SIGKILL; traffic {traffic_after:.2f} s after ready")
        assert load.failed == [], load.failed[:5]
        assert ejected_after <= 1.0
        assert traffic_after <= 2.0
