"""Serving an application: listen, dispatch each request, time out idle or stuck connections, drain.

The server knows nothing of routing: it hands every complete request to the application's
``dispatch`` (:class:`ServedApp`; the router sends proxied paths to its director and the rest to its
ASGI app through :class:`~.asgi_bridge.AsgiCall`) and asks it for its limits.

Stopping (SIGTERM from Kubernetes, or :meth:`RouterServer.stop`): the listening socket closes at once;
the requests being read or answered may finish within the grace period, and every answer that begins from
then on says ``connection: close`` (its connection is closed after it). A keep-alive connection (idle, or
one whose answer began before the stop and promised keep-alive) is closed once it has been idle for
``drain_idle`` seconds (at once if it already has); a request that arrives on it before that is answered,
with ``connection: close``. Whatever is left at the end of the grace period is cut, and the router's
background tasks stop last.

Why not close kept-alive connections at once: a client sending requests one after another on a keep-alive
connection (an SDK's pool under steady traffic) sends its next request as soon as an answer ends, maybe
before it could see a close; closed then, the client sees the connection end without an answer, and a
POST is not retried (seen in a rolling upgrade on a real node: a reset 1 ms after the request was sent). A
connection idle for ``drain_idle`` belongs to a client that is not sending; the race is then as unlikely as
at any keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from typing import Protocol

from vllm_stack.errors import RouterError
from vllm_stack.server.budget import BodyBudget
from vllm_stack.server.http1 import HttpConnection, HttpRequest
from vllm_stack.server.memory import Allocator

log = logging.getLogger(__name__)

KEEP_ALIVE_TIMEOUT = 75.0  # idle keep-alive connections are closed after this (above common LB idle timeouts)
DRAIN_IDLE = 1.0  # stopping: seconds an idle keep-alive connection stays open for a request already sent
DRAIN_POLL = 0.05  # stopping: how often the connections are looked at
SWEEP_INTERVAL = 1.0
TRIM_EVERY = 5  # sweeps between two trims of the allocator's free pages (when one is given)


class ServedApp(Protocol):
    """What the server needs of the application it serves."""

    #: The most request body bytes all connections together may hold, and the requests of one client
    #: key (see :class:`~.budget.BudgetLimits`).
    buffered_body_limit: int
    key_body_limit: int

    def body_limit(self) -> int: ...

    def check_head(
        self, method: str, path: str, headers: list[tuple[bytes, bytes]]
    ) -> RouterError | None: ...

    def body_holder(self, path: str, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """See :meth:`vllm_stack.server.http1.ServerContext.body_holder`."""
        ...

    #: Paths whose request bodies may be handed over as they arrive (``body_stream_limit`` says).
    stream_paths: frozenset[str]
    #: Paths answered even on connections past the connection limit: the probes must not fail under a flood.
    reserved_paths: frozenset[str]
    #: A path prefix the server takes off the targets under it ("": none; http1.strip_root).
    root_path: str

    def body_stream_limit(self, method: str, path: str) -> int:
        """See :meth:`vllm_stack.server.http1.ServerContext.body_stream_limit`."""
        ...

    def connection_limit(self) -> int: ...

    def request_timeout(self) -> float: ...

    def head_timeout(self) -> float:
        """Seconds a request head may take to arrive whole; then 408 and close."""
        ...

    def body_timeout(self) -> float:
        """Seconds a request body (buffered or streamed) may send nothing; then 408 and close."""
        ...

    def dispatch(self, conn: HttpConnection, request: HttpRequest) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class RouterServer:
    """One listening socket serving one application, the router (also the connections'
    :class:`~.http1.ServerContext`)."""

    def __init__(
        self,
        router: ServedApp,
        host: str,
        port: int,
        shutdown_grace: float = 30.0,
        keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT,
        allocator: Allocator | None = None,
        drain_idle: float = DRAIN_IDLE,
    ) -> None:
        self.router = router
        self.host = host
        self.port = port
        self.shutdown_grace = shutdown_grace
        self.drain_idle = drain_idle
        self.keep_alive_timeout = keep_alive_timeout
        self.allocator = allocator  # set by the entry point: its free pages are trimmed by the sweep
        self.connections: set[HttpConnection] = set()
        self.draining = False
        self.reserved_paths: frozenset[str] = router.reserved_paths
        self.root_path: str = router.root_path
        self.budget = BodyBudget(router)  # the request bodies connections hold (HttpConnection._reserve)
        self.stream_paths: frozenset[str] = router.stream_paths
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        # The application's own methods, bound here: one call less per request than delegating.
        self.dispatch = router.dispatch  # type: ignore[method-assign]
        self.body_limit = router.body_limit  # type: ignore[method-assign]
        self.check_head = router.check_head  # type: ignore[method-assign]
        self.body_holder = router.body_holder  # type: ignore[method-assign]

    # ---- ServerContext ---------------------------------------------------------------------------------
    def body_limit(self) -> int:
        """Replaced in ``__init__`` by the application's own ``body_limit``."""
        return self.router.body_limit()

    @property
    def buffered_body_bytes(self) -> int:
        """Request body bytes all connections hold now (what tests and diagnostics read)."""
        return self.budget.held

    def body_timeout(self) -> float:
        return self.router.body_timeout()

    def check_head(self, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> RouterError | None:
        """Replaced in ``__init__`` by the application's own ``check_head``."""
        return self.router.check_head(method, path, headers)

    def body_holder(self, path: str, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """Replaced in ``__init__`` by the application's own ``body_holder``."""
        return self.router.body_holder(path, headers)

    def body_stream_limit(self, method: str, path: str) -> int:
        return self.router.body_stream_limit(method, path)

    def connection_limit(self) -> int:
        return self.router.connection_limit()

    def dispatch(self, conn: HttpConnection, request: HttpRequest) -> None:
        """Replaced in ``__init__`` by the application's own ``dispatch`` (one call less per request)."""
        self.router.dispatch(conn, request)

    # ---- lifecycle -------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        await self.router.start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: HttpConnection(self), self.host, self.port, backlog=4096, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._sweeper = loop.create_task(self._sweep())
        log.info("router listening on %s:%d", self.host, self.port)

    async def _sweep(self) -> None:
        """Timeouts of every kind, checked together: idle keep-alive, slow requests, silent engines;
        and, every few sweeps, free heap pages handed back (see :mod:`.memory`)."""
        sweeps = 0
        while True:
            head_timeout, body_timeout = self.router.head_timeout(), self.router.body_timeout()
            await asyncio.sleep(
                min(SWEEP_INTERVAL, self.router.request_timeout() / 4, head_timeout / 4, body_timeout / 4)
            )
            sweeps += 1
            if self.allocator is not None and sweeps % TRIM_EVERY == 0:
                self.allocator.trim()
            now = time.monotonic()
            tick = time.perf_counter()  # the clock exchanges stamp their activity with
            for conn in list(self.connections):
                handler = conn.handler
                if handler is not None:
                    handler.check_timeout(tick)
                elif conn.idle_since and not conn.busy and now - conn.idle_since > self.keep_alive_timeout:
                    conn.close()
                if conn.head_started:  # a request being read: its head, or its body
                    conn.check_reading(now, head_timeout, body_timeout)

    async def stop(self) -> None:
        """Stop accepting, let answers under way finish within the grace period (see the module docstring
        for idle keep-alive connections), then stop the router."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        started = time.monotonic()
        deadline = started + self.shutdown_grace
        under_way = sum(1 for c in self.connections if not c.idle_since)
        log.info(
            "stopping: %d requests under way, %d idle connections",
            under_way,
            len(self.connections) - under_way,
        )
        while self._close_idle(time.monotonic()) and time.monotonic() < deadline:  # noqa: ASYNC110 - polled only while stopping; an event would cost every request
            await asyncio.sleep(DRAIN_POLL)
        left = [c for c in self.connections if not c.closed]
        if left:
            log.warning("grace period (%.0f s) over: %d connections cut", self.shutdown_grace, len(left))
        else:
            log.info("drained in %.1f s", time.monotonic() - started)
        for conn in list(self.connections):
            conn.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.router.stop()

    def _close_idle(self, now: float) -> bool:
        """Close the connections idle for ``drain_idle`` seconds; True while any other is open (a request
        being read or answered, or a connection idle for less)."""
        open_left = False
        for conn in list(self.connections):
            if conn.closed:
                continue
            if conn.idle_since and not conn.busy and now - conn.idle_since >= self.drain_idle:
                conn.close()
            else:
                open_left = True
        return open_left


async def serve_forever(server: RouterServer) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully."""
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await server.start()
    await stopping.wait()
    await server.stop()
