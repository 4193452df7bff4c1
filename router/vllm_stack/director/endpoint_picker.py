"""Gateway mode: each request's engine asked of an external endpoint picker (EPP) over ext_proc v3, as an
Envoy gateway with the Inference Extension asks it.

Per request, one gRPC stream: the request's headers (``:method``, ``:path``, ``:authority``, the
client's headers but its credentials, ``x-request-id``), then its body in chunks, the last with
end_of_stream, each message carrying the subset hint of the model's routable engines (the EPP may pick
only among the engines that serve the model). The EPP answers with the endpoint (``envoy.lb`` metadata,
fallbacks after it, or the ``x-gateway-destination-endpoint`` header) and the body back (possibly
changed: the engine gets the changed one), or with an ImmediateResponse, which is the client's answer.
Once the answer is over, its status and headers and its last bytes (where the usage is) are sent as
``response_headers`` and one ``response_body`` with end_of_stream, and the stream is closed. An Envoy
would pass every chunk of the answer through the EPP; here only its end is, so the relay keeps its
cost and the EPP still sees every request end (its completion bookkeeping runs).

A stream the EPP refuses before any answer, as a stopping EPP refuses the streams that crossed its
GOAWAY, is asked again once on a new stream (:data:`REFUSALS`), within the same ``timeout``. An EPP that
does not answer within ``timeout`` seconds, fails, or names an endpoint this router has no engine for is
a failure: the request is scheduled by the router itself (fail-open) or answered 503
``endpoint_picker_unavailable`` (fail-closed), and counted under its outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from vllm_stack.extproc import wire
from vllm_stack.metrics import RouterMetrics

log = logging.getLogger(__name__)

PICKED, IMMEDIATE, FAILED = "picked", "immediate", "failed"
CLOSE_TIMEOUT = 5.0  # seconds the EPP may take to answer the response messages before the stream is cut
#: How gRPC ends a stream that a stopping picker did not take (tests/router/test_endpoint_picker_stop.py: one
#: that came as its server shut down is CANCELLED; one still being sent, INTERNAL; one after, UNAVAILABLE).
REFUSALS = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL})
#: The client's headers that never go to the EPP: its credentials, and the framing the stream replaces.
PRIVATE_HEADERS = frozenset(
    {b"authorization", b"cookie", b"proxy-authorization", b"x-api-key", b"content-length"}
)


@dataclass(slots=True)
class PickAnswer:
    """What the EPP said: ``kind`` PICKED (``endpoints``, first the pick; ``body`` the body it sent back),
    IMMEDIATE (``status``, ``body``, ``headers``: the client's answer) or FAILED (``outcome``: why)."""

    kind: str
    endpoints: list[str] = field(default_factory=list)
    body: bytes = b""
    status: int = 0
    headers: list[tuple[str, str]] = field(default_factory=list)
    outcome: str = ""
    call: Any = None  # the open stream (PICKED), for the response messages


class EndpointPickerClient:
    """The channel to one EPP and what asking it costs."""

    def __init__(self, target: str, timeout: float, fail_open: bool, metrics: RouterMetrics) -> None:
        self.target = target.removeprefix("grpc://")
        self.timeout = timeout
        self.fail_open = fail_open
        self.metrics = metrics
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.ExternalProcessorStub | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._failing = False  # the last question failed (logged once until an answer comes again)

    def _open(self) -> pb_grpc.ExternalProcessorStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.target)
            self._stub = pb_grpc.ExternalProcessorStub(self._channel)
        return self._stub

    async def ask(
        self,
        method: str,
        path: str,
        authority: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        request_id: bytes,
        body: bytes,
        subset: list[str],
    ) -> PickAnswer:
        """The EPP's answer for one request; never raises (a failure is an answer of kind FAILED)."""
        started = time.perf_counter()
        calls: list[Any] = []  # the streams opened (a second after a refusal): the last is the answer's
        try:
            answer = await asyncio.wait_for(
                self._ask(calls, method, path, authority, headers, request_id, body, subset), self.timeout
            )
        except asyncio.CancelledError:  # the client left while the picker was asked
            for call in calls:
                call.cancel()
            raise
        except TimeoutError:
            answer = PickAnswer(FAILED, outcome="timeout")
            self._went_wrong(f"no answer within {self.timeout:g}s")
        except grpc.aio.AioRpcError as error:
            answer = PickAnswer(FAILED, outcome="error")
            self._went_wrong(f"{error.code().name} {error.details()}")
        except Exception as error:  # noqa: BLE001 - a broken answer is the EPP's failure, not the request's
            answer = PickAnswer(FAILED, outcome="error")
            self._went_wrong(f"unreadable answer: {type(error).__name__}: {error}")
        else:
            if self._failing:
                self._failing = False
                log.info("endpoint picker %s answers again", self.target)
        self.metrics.endpoint_picker_seconds.observe(time.perf_counter() - started)
        if answer.kind == PICKED:
            answer.call = calls[-1]
        else:
            for call in calls:
                call.cancel()
        if answer.kind != FAILED:
            self.metrics.endpoint_picker.child(answer.kind).inc()
        return answer

    async def _ask(self, calls: list[Any], *question: Any) -> PickAnswer:  # noqa: ANN401 - _exchange's
        """The exchange on a new stream; once more on another when the first failed before an answer as
        a stopping picker refuses the streams that crossed its GOAWAY (:data:`REFUSALS`). No engine has
        the request yet, so asking again is safe; after a GOAWAY the next stream goes on a new connection,
        which the picker's Service leads to another picker."""
        while True:
            call = self._open().Process()
            calls.append(call)
            try:
                return await self._exchange(call, *question)
            except grpc.aio.AioRpcError as error:
                call.cancel()
                if len(calls) > 1 or error.code() not in REFUSALS:
                    raise

    def _went_wrong(self, why: str) -> None:
        """Logged when the picker starts failing, not for every request while it fails (the metric counts
        each); its recovery is logged too."""
        if not self._failing:
            self._failing = True
            log.warning(
                "endpoint picker %s: %s; requests are %s until it answers again",
                self.target,
                why,
                "scheduled here" if self.fail_open else "answered 503",
            )

    def failed(self, outcome: str) -> None:
        """Count a failure the request found in the answer (``unknown_endpoint``) or in asking."""
        self.metrics.endpoint_picker.child(outcome).inc()

    async def _exchange(
        self,
        call: Any,  # noqa: ANN401 - grpc.aio.StreamStreamCall
        method: str,
        path: str,
        authority: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        request_id: bytes,
        body: bytes,
        subset: list[str],
    ) -> PickAnswer:
        hint = wire.subset_metadata(subset)
        pairs: list[tuple[str, str | bytes]] = [
            (":method", method),
            (":path", path),
            (":authority", authority),
            (":scheme", "http"),
        ]
        pairs += [
            (name.decode("latin-1"), value)
            for name, value in headers
            if name not in PRIVATE_HEADERS and name != b"x-request-id"
        ]
        pairs += [("x-request-id", request_id), ("content-length", str(len(body)))]
        await call.write(
            wire.ProcessingRequest(
                request_headers=wire.pb.HttpHeaders(headers=wire.header_map(pairs), end_of_stream=False),
                metadata_context=hint,
            )
        )
        for chunk, eos in wire.body_chunks(body):
            await call.write(
                wire.ProcessingRequest(
                    request_body=wire.pb.HttpBody(body=chunk, end_of_stream=eos), metadata_context=hint
                )
            )
        endpoints: list[str] = []
        returned: list[bytes] = []
        headers_seen = False
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                raise grpc.aio.AioRpcError(
                    grpc.StatusCode.UNAVAILABLE, None, None, "the stream ended before an answer"
                )
            kind = response.WhichOneof("response")
            if kind == "immediate_response":
                immediate = response.immediate_response
                return PickAnswer(
                    IMMEDIATE,
                    status=int(immediate.status.code) or 500,
                    body=immediate.body,
                    headers=[
                        (o.header.key.lower(), wire.header_value(o.header))
                        for o in immediate.headers.set_headers
                    ],
                )
            if kind == "request_headers":
                headers_seen = True
                _, endpoints = wire.destination_of(response)
            elif kind == "request_body":
                mutation = response.request_body.response.body_mutation
                which = mutation.WhichOneof("mutation")
                if which == "streamed_response":
                    returned.append(mutation.streamed_response.body)
                    if mutation.streamed_response.end_of_stream:
                        break
                elif which == "body":
                    returned.append(mutation.body)
                    break
                else:  # no mutation: the body stays as sent
                    returned = [body]
                    break
        if not headers_seen or not endpoints:
            raise ValueError("the answer named no endpoint")
        return PickAnswer(PICKED, endpoints=endpoints, body=b"".join(returned))

    def finish(
        self, answer: PickAnswer, status: int, content_type: bytes, answer_end: bytes, served: str
    ) -> None:
        """The request's answer is over: tell the EPP (its headers with the endpoint that served it, then
        its end), in the background."""
        call, answer.call = answer.call, None
        if call is None:
            return
        task = asyncio.ensure_future(self._finish(call, status, content_type, answer_end, served))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _finish(  # noqa: PLR0913
        self,
        call: Any,  # noqa: ANN401 - grpc.aio.StreamStreamCall
        status: int,
        content_type: bytes,
        answer_end: bytes,
        served: str,
    ) -> None:
        outcome = "told"
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT):
                pairs: list[tuple[str, str | bytes]] = [(":status", str(status))]
                if content_type:
                    pairs.append(("content-type", content_type))
                await call.write(
                    wire.ProcessingRequest(
                        response_headers=wire.pb.HttpHeaders(headers=wire.header_map(pairs)),
                        metadata_context=wire.served_metadata(served) if served else None,
                    )
                )
                await call.write(
                    wire.ProcessingRequest(
                        response_body=wire.pb.HttpBody(body=answer_end, end_of_stream=True)
                    )
                )
                await call.done_writing()
                while await call.read() is not grpc.aio.EOF:
                    pass
                if await call.code() != grpc.StatusCode.OK:
                    outcome = "cut"
        except TimeoutError:
            outcome = "timeout"
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            outcome = "cut"  # the request is over either way; counted, the EPP's bookkeeping is its own
        except asyncio.CancelledError:  # this router stops (close): not the picker's doing
            outcome = ""
            raise
        finally:
            call.cancel()
            if outcome:
                self.metrics.endpoint_picker_ends.child(outcome).inc()

    def abandon(self, answer: PickAnswer) -> None:
        """The request ended without an answer to tell (its client left): the stream is cut."""
        call, answer.call = answer.call, None
        if call is not None:
            call.cancel()

    async def close(self) -> None:
        """The answers' ends still being told are given their time (each is bounded), then the channel
        closes: a router that stops does not leave the picker with requests it never hears end."""
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=CLOSE_TIMEOUT)
        for task in list(self._closing):
            task.cancel()
        for task in list(self._closing):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._channel is not None:
            await self._channel.close()
