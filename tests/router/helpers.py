"""Helpers for router tests: a router on its own server (and stub engines on uvicorn) inside the test's loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
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


@contextlib.asynccontextmanager
async def serving(router: Router) -> AsyncIterator[str]:
    """Serve ``router`` on its own server at an ephemeral port; yields the base URL; stops on exit."""
    server = RouterServer(router, "127.0.0.1", 0, shutdown_grace=2.0)
    await server.start()
    try:
        yield server.url
    finally:
        await server.stop()


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
