"""The endpoint picker's gRPC server: Envoy's ExternalProcessor service on the router's event loop.

It is a part of the router process (``vllm-stack epp`` is ``vllm-stack router --ext-proc-port 9002``):
the same registry, scraper, KV-event index, plugins, queue and metrics serve both the router's own
requests and the gateway's. Plain gRPC (no TLS): the gateway reaches it inside the cluster.

Bounded (:class:`~.limits.PickerLimits`): at most ``max_streams`` streams at once (at the cap, one that
waited in silence for its request gives way, :mod:`.slots`; else RESOURCE_EXHAUSTED); each message at
most 1 MiB (a header block, a body chunk), each request body at most ``max_body_bytes``, and all bodies
being gathered at most ``max_buffered_body_bytes`` together (past it: 503 ``body_buffers_full``), as for
the router's own connections. A stream silent for ``idle_timeout`` while its request arrives is answered
408 (its body's budget given back); one silent for ``answer_timeout`` after its pick has its engine
booking released and is ended with DEADLINE_EXCEEDED. Connections are bounded by gRPC
(:meth:`~.limits.PickerLimits.server_options`).

Silence is timed by the sweep, which cancels a silent stream's read (:meth:`~.stream.Exchange.expire`),
only ever while the stream's task waits in that read: the handler then answers for it in its own task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from vllm_stack.epp.inference_objects import Objectives
from vllm_stack.epp.limits import PickerLimits
from vllm_stack.epp.slots import StreamSlots
from vllm_stack.epp.stream import Exchange
from vllm_stack.extproc import wire

if TYPE_CHECKING:
    from vllm_stack.api.state import RouterState

log = logging.getLogger(__name__)

SWEEP_INTERVAL = 1.0
DRAIN_POLL = 0.05  # stopping: how often the streams under way are counted
FALLBACKS = 2  # endpoints listed after the picked one in the envoy.lb metadata


class PickerService(pb_grpc.ExternalProcessorServicer):
    """ExternalProcessor.Process: one :class:`~.stream.Exchange` per stream."""

    def __init__(self, router: RouterState, objectives: Objectives, limits: PickerLimits) -> None:
        self.router = router
        self.metrics = router.metrics
        self.objectives = objectives
        self.fallbacks = FALLBACKS
        self.limits = limits
        self.buffer_limit = limits.buffer_limit
        self.buffered = 0
        self.slots = StreamSlots(limits.max_streams)

    def reserve(self, size: int) -> bool:
        if self.buffered + size > self.buffer_limit:
            return False
        self.buffered += size
        return True

    def release(self, size: int) -> None:
        self.buffered -= size

    async def Process(  # noqa: N802 - the generated servicer's name
        self, request_iterator: AsyncIterator[wire.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wire.ProcessingResponse]:
        slots = self.slots
        if not slots.admit(time.monotonic()):
            self.metrics.ext_proc_streams.child("refused").inc()
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the endpoint picker serves at most {slots.limit} streams at once",
            )
        task = asyncio.current_task()
        assert task is not None  # a gRPC handler runs in its own task
        exchange = Exchange(self, task)
        slots.add(exchange, time.monotonic())
        messages = aiter(request_iterator)
        try:
            while True:
                exchange.listen(time.monotonic())
                try:
                    message = await anext(messages)
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if not exchange.expired or task.uncancel() > 0:  # not (only) the sweep's
                        raise
                    answers = exchange.silent()
                    for answer in answers:
                        yield answer
                    if not answers:  # in the middle of the answer: nothing to say but an error
                        await context.abort(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no message of the answer for {self.limits.answer_timeout:g}s "
                            "(ext_proc_answer_timeout)",
                        )
                    return
                finally:
                    exchange.reading = False
                for answer in await exchange.receive(message):
                    yield answer
                if exchange.closed:
                    return
        finally:
            slots.remove(exchange)
            exchange.end()

    async def sweep(self) -> None:
        """Requests waiting in the queue or on a stage past their timeouts are refused; streams silent
        past theirs are ended (:meth:`~.stream.Exchange.expire`). A sweep instead of a timer per read:
        arming and cancelling a timer for every message (each token of a streamed answer) costs more
        than looking at every stream a few times a second."""
        limits = self.limits
        interval = min(SWEEP_INTERVAL, limits.idle_timeout / 4, limits.answer_timeout / 4)
        while True:
            await asyncio.sleep(interval)
            now = time.perf_counter()
            clock = time.monotonic()
            for exchange in list(self.slots.open):
                request = exchange.request
                if request is not None:
                    request.check_timeout(now)
                if exchange.overdue(clock):
                    exchange.expire()


class PickerServer:
    """The gRPC server and its tasks (the sweep, the InferenceObjective watch)."""

    def __init__(
        self, router: RouterState, host: str, port: int, objectives: Objectives, limits: PickerLimits
    ) -> None:
        self.service = PickerService(router, objectives, limits)
        self.host = host
        self.port = port
        self.limits = limits
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        limits = self.limits
        server = self._server = grpc.aio.server(
            maximum_concurrent_rpcs=limits.stream_cap(),
            options=limits.server_options(),
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(self.service, server)
        bound = server.add_insecure_port(f"{_bracketed(self.host)}:{self.port}")
        if not bound:
            raise OSError(f"the endpoint picker could not bind {self.host}:{self.port}")
        self.port = bound
        await server.start()
        self._tasks.append(asyncio.ensure_future(self.service.sweep()))
        if self.service.objectives.namespace:
            self._tasks.append(asyncio.ensure_future(self.service.objectives.run()))
        log.info("endpoint picker (ext_proc) listening on %s:%d", self.host, self.port)

    async def stop(self, grace: float) -> None:
        """New streams are refused at once (gRPC sends its GOAWAY: a gateway opens a new connection, which
        its Service sends to another picker); the streams under way have ``grace`` seconds to end."""
        if self._server is not None:
            streams = self.service.slots.open
            log.info("endpoint picker stopping: %d streams under way", len(streams))
            started = time.monotonic()
            stopping = asyncio.ensure_future(self._server.stop(grace))
            while streams and not stopping.done() and time.monotonic() - started < grace:  # noqa: ASYNC110 - polled only while stopping
                await asyncio.sleep(DRAIN_POLL)
            left = len(streams)
            await stopping
            if left:
                log.warning("grace period (%.0f s) over: %d endpoint picker streams cut", grace, left)
            else:
                log.info("endpoint picker drained in %.1f s", time.monotonic() - started)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
