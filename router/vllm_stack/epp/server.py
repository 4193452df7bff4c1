"""The endpoint picker's gRPC server: Envoy's ExternalProcessor service on the router's event loop.

It is a part of the router process (``vllm-stack epp`` is ``vllm-stack router --ext-proc-port 9002``):
the same registry, scraper, KV-event index, plugins, queue and metrics serve both the router's own
requests and the gateway's. Plain gRPC (no TLS): the gateway reaches it inside the cluster.

Bounded: at most ``max_streams`` streams at once (more are refused by gRPC with RESOURCE_EXHAUSTED), each
message at most 1 MiB (a header block, a body chunk), each request body at most ``max_body_bytes``, and all
bodies being gathered at most ``max_buffered_body_bytes`` together (past it: 503 ``body_buffers_full``), as
for the router's own connections.
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
from vllm_stack.epp.stream import Exchange
from vllm_stack.extproc import wire

if TYPE_CHECKING:
    from vllm_stack.api.state import RouterState

log = logging.getLogger(__name__)

SWEEP_INTERVAL = 1.0
FALLBACKS = 2  # endpoints listed after the picked one in the envoy.lb metadata
MAX_MESSAGE_BYTES = 1 << 20


class PickerService(pb_grpc.ExternalProcessorServicer):
    """ExternalProcessor.Process: one :class:`~.stream.Exchange` per stream."""

    def __init__(self, router: RouterState, objectives: Objectives, buffer_limit: int) -> None:
        self.router = router
        self.metrics = router.metrics
        self.objectives = objectives
        self.fallbacks = FALLBACKS
        self.buffer_limit = buffer_limit
        self.buffered = 0
        self.exchanges: set[Exchange] = set()

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
        exchange = Exchange(self)
        self.exchanges.add(exchange)
        try:
            async for message in request_iterator:
                for answer in await exchange.receive(message):
                    yield answer
                if exchange.closed:
                    return
        finally:
            self.exchanges.discard(exchange)
            exchange.end()

    async def sweep(self) -> None:
        """Requests waiting in the queue or on a stage past their timeouts are refused."""
        while True:
            await asyncio.sleep(SWEEP_INTERVAL)
            now = time.perf_counter()
            for exchange in list(self.exchanges):
                request = exchange.request
                if request is not None:
                    request.check_timeout(now)


class PickerServer:
    """The gRPC server and its tasks (the sweep, the InferenceObjective watch)."""

    def __init__(
        self,
        router: RouterState,
        host: str,
        port: int,
        objectives: Objectives,
        buffer_limit: int,
        max_streams: int,
    ) -> None:
        self.service = PickerService(router, objectives, buffer_limit)
        self.host = host
        self.port = port
        self.max_streams = max_streams
        self._server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        server = self._server = grpc.aio.server(
            maximum_concurrent_rpcs=self.max_streams,
            # one message (a header block, a body chunk) at most this large: gateways send bodies in
            # chunks of tens of KiB, and each stream holds at most one header block
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
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
        if self._server is not None:
            await self._server.stop(grace)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
