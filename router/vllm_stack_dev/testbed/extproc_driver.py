"""Drive an endpoint picker as an Envoy gateway would, recording every answer: the conformance tests'
client for our picker and the upstream one alike.

A stand-in for Envoy, which cannot run here: it sends the ext_proc v3 messages of one request in
FULL_DUPLEX_STREAMED mode (request headers; the body in chunks, the last with end_of_stream; then, once
a pick came, the response headers and body chunks), with the subset hint on every request message when
one is given, as the Inference Extension's own integration tests do. What a real gateway does beyond
this (apply the header mutations, connect to the endpoint, retry on fallbacks, time the picker out) is
not exercised here; the router's gateway mode does the connecting and falling back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from vllm_stack.extproc import wire


@dataclass
class Exchange:
    """What one request's stream gave back, in order (``kinds``: the oneof names of the answers)."""

    answers: list[wire.ProcessingResponse] = field(default_factory=list)

    @property
    def kinds(self) -> list[str]:
        return [str(a.WhichOneof("response")) for a in self.answers]

    def first(self, kind: str) -> wire.ProcessingResponse:
        return next(a for a in self.answers if a.WhichOneof("response") == kind)

    @property
    def endpoint(self) -> str:
        return wire.destination_of(self.first("request_headers"))[0]

    def set_header_keys(self, kind: str) -> list[str]:
        answer = self.first(kind)
        common = getattr(answer, kind).response
        return sorted(o.header.key.lower() for o in common.header_mutation.set_headers)

    def header(self, kind: str, name: str) -> str | None:
        common = getattr(self.first(kind), kind).response
        for option in common.header_mutation.set_headers:
            if option.header.key.lower() == name:
                return wire.header_value(option.header)
        return None

    def body(self, kind: str) -> bytes:
        """The body chunks of ``request_body`` or ``response_body`` answers, joined."""
        return b"".join(
            getattr(a, kind).response.body_mutation.streamed_response.body
            for a in self.answers
            if a.WhichOneof("response") == kind
        )

    def metadata_keys(self) -> dict[str, list[str]]:
        answer = self.first("request_headers")
        return {ns: sorted(v.struct_value.fields) for ns, v in answer.dynamic_metadata.fields.items()}


async def exchange(
    target: str,
    headers: Sequence[tuple[str, str]],
    body: bytes,
    *,
    subset: Sequence[str] | None = None,
    chunk: int = 0,
    response: tuple[Sequence[tuple[str, str]], Sequence[bytes]] | None = None,
    served: str | None = None,
    stream_timeout: float = 30.0,
) -> Exchange:
    """One request through the picker at ``target`` (``host:port``). ``chunk``: split the body into
    pieces of this size (0: one message). ``response``: the engine's answer (headers, body chunks) to
    send after a pick, as the gateway relays it; without it the stream is closed after the pick.
    ``served``: the endpoint the gateway reports as the one that served it (``envoy.lb`` metadata
    ``x-gateway-destination-endpoint-served`` on the response headers, as the protocol has it)."""
    recorded = Exchange()
    hint = wire.subset_metadata(subset) if subset is not None else None
    async with grpc.aio.insecure_channel(target) as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process(timeout=stream_timeout)

        def message(**kwargs: object) -> wire.ProcessingRequest:
            if hint is not None:
                kwargs["metadata_context"] = hint
            return wire.ProcessingRequest(**kwargs)  # type: ignore[arg-type]

        header_map = wire.header_map(headers)
        await call.write(
            message(request_headers=wire.pb.HttpHeaders(headers=header_map, end_of_stream=not body))
        )
        pieces = (
            [body[i : i + chunk] for i in range(0, len(body), chunk)]
            if chunk and body
            else [body]
            if body
            else []
        )

        async def send_body() -> None:
            for index, piece in enumerate(pieces):
                last = index == len(pieces) - 1
                await call.write(message(request_body=wire.pb.HttpBody(body=piece, end_of_stream=last)))

        # The body goes out while the answers are read, as a gateway relays it: the picker may answer
        # before the body's end (413 past the limit) and end the stream, and a write after that fails
        # and takes down the call, so the answer must already be read by then.
        writer = asyncio.ensure_future(send_body())
        whole = False  # the picker answered the whole request (it was all sent)
        try:
            while True:
                answer = await call.read()
                if answer is grpc.aio.EOF:
                    return recorded
                recorded.answers.append(answer)
                kind = answer.WhichOneof("response")
                if kind == "immediate_response":
                    return recorded
                if kind == "request_headers" and not body:
                    break
                if (
                    kind == "request_body"
                    and answer.request_body.response.body_mutation.streamed_response.end_of_stream
                ):
                    break
            whole = True
        finally:
            if not whole:  # the stream ended first: what was left of the body is not sent
                writer.cancel()
                with contextlib.suppress(
                    asyncio.CancelledError, grpc.aio.AioRpcError, asyncio.InvalidStateError
                ):
                    await writer
        await writer
        if response is not None:
            # The answer is relayed as it comes: its headers, then every body chunk, without waiting for
            # the picker between them (full duplex). A picker may pass each chunk back at once (a
            # streamed answer) or hold them and send the whole body at the end (the upstream EPP does
            # for an answer that is not streamed); what it sent, in order, is read until the body's end.
            response_headers, chunks = response
            await call.write(
                wire.ProcessingRequest(
                    response_headers=wire.pb.HttpHeaders(
                        headers=wire.header_map(response_headers), end_of_stream=not chunks
                    ),
                    metadata_context=wire.served_metadata(served) if served else None,
                )
            )
            for index, piece in enumerate(chunks):
                last = index == len(chunks) - 1
                await call.write(
                    wire.ProcessingRequest(response_body=wire.pb.HttpBody(body=piece, end_of_stream=last))
                )
            while True:
                answer = await call.read()
                if answer is grpc.aio.EOF:
                    return recorded
                recorded.answers.append(answer)
                kind = answer.WhichOneof("response")
                if kind == "immediate_response" or (kind == "response_headers" and not chunks):
                    break
                if (
                    kind == "response_body"
                    and answer.response_body.response.body_mutation.streamed_response.end_of_stream
                ):
                    break
        await call.done_writing()
        call.cancel()
    return recorded
