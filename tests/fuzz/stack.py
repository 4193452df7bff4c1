"""A router (and optional stub engines) on an event loop in a background thread.

Schemathesis and Hypothesis drive synchronous clients (``requests``), while the router and the stub
engines run on asyncio; this runs the async side in its own thread so a plain test can call it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tests.fakes.stub_engine import serve
from tests.router.helpers import running_router

START_TIMEOUT = 30.0


@contextlib.contextmanager
def router_in_thread(
    backends: Sequence[str] = (),
    stub_apps: Sequence[Any] = (),
    wait_healthy: int | None = None,
    **settings: Any,
) -> Iterator[tuple[str, Callable[[Callable[[], Any]], Any]]]:
    """Yields (router URL, ``call``); ``call(fn)`` runs ``fn`` on the router's loop and returns its result.

    ``stub_apps`` are ASGI apps served first (their URLs are added to ``backends``).
    """
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        box["stop"] = lambda: loop.call_soon_threadsafe(stop.set)
        box["loop"] = loop
        try:
            async with contextlib.AsyncExitStack() as stack:
                urls = [await stack.enter_async_context(serve(app)) for app in stub_apps]
                all_backends = [*backends, *urls]
                url, router = await stack.enter_async_context(
                    running_router(all_backends, wait_healthy=wait_healthy, **settings)
                )
                box["url"], box["router"] = url, router
                ready.set()
                await stop.wait()
        except BaseException as exc:  # reported to the test thread
            box["error"] = exc
            ready.set()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="router-loop", daemon=True)
    thread.start()
    if not ready.wait(START_TIMEOUT):
        raise TimeoutError("router did not start")
    if "error" in box:
        raise box["error"]

    def call(fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), box["loop"]).result(10)

    try:
        yield box["url"], call
    finally:
        box["stop"]()
        thread.join(15)
