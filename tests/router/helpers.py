"""Helpers for router tests: a router on its own server (and stub engines on uvicorn) inside the test's loop."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.stub_engine import StubEngine, serve
from vllm_stack.app import Router, build_router
from vllm_stack.server import RouterServer

FAST = {
    "health_check_interval": 0.2,
    "engine_scrape_interval": 0.2,
    "health_failure_threshold": 1,
    "health_success_threshold": 1,
}

#: Over real CPU engines: a probe of /v1/models that takes over its 2 s once, on a loaded two-core machine,
#: is no outage; three in a row (the router's default) are.
REAL_ENGINE_HEALTH = {"health_failure_threshold": 3}


async def wait_for(predicate: Callable[[], bool], within: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def logged(caplog: pytest.LogCaptureFixture, text: str) -> Callable[[], bool]:
    """A :func:`wait_for` predicate: a record holding ``text`` was logged, e.g. the router's "config
    reload rejected", the one sign of a reload that changed nothing."""
    return lambda: any(text in record.getMessage() for record in caplog.records)


@contextlib.asynccontextmanager
async def running_router(
    backends: Sequence[str],
    environ: dict[str, str] | None = None,
    wait_healthy: int | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[str, Router]]:
    """A router on an ephemeral port over ``backends``; waits until ``wait_healthy`` engines are healthy."""
    # Relay, failover and HTTP tests need a placement they can predict (round-robin, not the default
    # prefixaware); the routing strategies have their own tests.
    cli = {**FAST, "routing_logic": "roundrobin", "static_backends": ",".join(backends), **settings}
    router = build_router(cli, environ=environ or {})
    async with serving(router) as url:
        need = len(backends) if wait_healthy is None else wait_healthy
        await wait_for(lambda: router.registry.healthy_count >= need, what=f"{need} healthy engines")
        yield url, router


STOP_WITHIN = 30.0  # seconds a test's router may take to stop (its grace period is 2 s)


@contextlib.asynccontextmanager
async def serving(router: Router) -> AsyncIterator[str]:
    """Serve ``router`` on its own server at an ephemeral port; yields the base URL; stops on exit, within
    :data:`STOP_WITHIN` or with an error that names what was still running (never a silent hang)."""
    # drain_idle 0: a test's clients often leave their connections open; the router's stop would otherwise
    # keep each one a second for a request that will not come (tests/router/test_relay.py tests the wait)
    server = RouterServer(router, "127.0.0.1", 0, shutdown_grace=2.0, drain_idle=0.0)
    await server.start()
    try:
        yield server.url
    finally:
        await bounded(server.stop(), STOP_WITHIN, "the router to stop")


async def bounded(awaitable: Any, within: float, what: str) -> Any:  # noqa: ANN401 - whatever it returns
    """``awaitable``'s result, or an AssertionError after ``within`` seconds naming ``what`` it waited for,
    where it was suspended, and the tasks and threads still running then."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=within)
    if done:
        return task.result()
    where = _awaiting(task.get_coro())
    task.cancel()
    with contextlib.suppress(BaseException):
        await asyncio.wait({task}, timeout=5)
    raise AssertionError(f"timed out after {within:g}s waiting for {what} (at {where}); {running_now(task)}")


def _awaiting(awaitable: Any) -> str:  # noqa: ANN401 - a coroutine, or any awaitable
    """Where a coroutine was suspended, innermost last (its chain of awaits)."""
    chain = []
    while awaitable is not None:
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "ag_frame", None)
        if frame is not None:
            chain.append(
                f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {frame.f_code.co_name}"
            )
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "ag_await", None)
    return " -> ".join(chain) or repr(awaitable)


def running_now(*also_skip: asyncio.Task[Any]) -> str:
    """The event loop's other tasks (where each waits) and the threads alive: what a stuck wait waits on."""
    import threading

    current = asyncio.current_task()
    tasks = []
    for task in asyncio.all_tasks():
        if task is current or task in also_skip:
            continue
        frames = task.get_stack(limit=1)
        where = f"{frames[0].f_code.co_filename.rsplit('/', 2)[-1]}:{frames[0].f_lineno}" if frames else "?"
        tasks.append(f"{task.get_coro().__qualname__} at {where}")
    frames = sys._current_frames()  # noqa: SLF001 - where each thread is, for the failure's message
    threads = [
        f"{t.name} at {' <- '.join(_where(f) for f in traceback.extract_stack(frames[t.ident])[-4:][::-1])}"
        for t in threading.enumerate()
        if t is not threading.main_thread() and t.ident in frames
    ]
    return f"tasks: {sorted(tasks)}; threads: {sorted(threads)}"


def _where(frame: traceback.FrameSummary) -> str:
    return f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} {frame.name}"


@contextlib.asynccontextmanager
async def stubs(*engines: StubEngine) -> AsyncIterator[list[str]]:
    """Serve stub engines; yields their URLs."""
    async with contextlib.AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serve(e)) for e in engines]
        yield urls


def client(url: str, api_key: str = "none") -> openai.AsyncOpenAI:
    """The official OpenAI client pointed at the router, without its own retries."""
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=30)


def http(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=30)


def metric_value(router: Router, name: str, **labels: str) -> float:
    value = router.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value
