"""grpcio's own floor for an ext_proc pick: an ExternalProcessor that does nothing but answer.

Why: our endpoint picker runs on grpcio's asyncio server (``vllm_stack.epp.server``); part of what a pick
costs it is grpcio's (HTTP/2 framing, protobuf, the stream's task). This servicer runs on the same kind of
server with nothing else: for each stream it reads the messages, answers the request headers with an
empty headers answer and the request body's end with an empty body answer naming a fixed endpoint in the
destination header, as a picker's answer is shaped. Its CPU per pick (``picker_cost.py --pickers
grpc-floor,...``) is the part of ours that no picking code can remove.

Two other ways to serve it, each measured (``picker_cost.py --pickers grpc-floor-sync,grpc-floor-raw,...``)
to see what they could save our picker before porting it: ``--server sync``, grpcio's synchronous server
(a thread per stream from a pool) instead of grpc.aio; ``--raw``, a generic handler with identity
(de)serialisers: each message stays bytes (the pick's answers pre-serialised, the request's messages
counted, never parsed), the most that hand-parsing only the fields a pick needs could save.

Usage: ``python benchmarks/router/extproc_floor.py --port 9100 [--server aio|sync] [--raw]``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent import futures

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from vllm_stack.extproc import wire

DESTINATION = "x-gateway-destination-endpoint"


class FloorProcessor(pb_grpc.ExternalProcessorServicer):
    """Answers each request's headers and its body's end; nothing is parsed, scheduled or counted."""

    def __init__(self, endpoint: str) -> None:
        mutation = wire.set_headers([(DESTINATION, endpoint)])
        self.headers_answer = wire.ProcessingResponse(request_headers=wire.pb.HeadersResponse())
        self.body_answer = wire.ProcessingResponse(
            request_body=wire.pb.BodyResponse(response=wire.pb.CommonResponse(header_mutation=mutation))
        )

    async def Process(  # noqa: N802 (the gRPC method's name)
        self, request_iterator: AsyncIterator[wire.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wire.ProcessingResponse]:
        async for message in request_iterator:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                if message.request_headers.end_of_stream:
                    yield self.body_answer
                    return
            elif kind == "request_body" and message.request_body.end_of_stream:
                yield self.headers_answer
                yield self.body_answer
                return


class SyncFloorProcessor(FloorProcessor):
    """The same answers from grpcio's synchronous server: a pool thread runs each stream."""

    def Process(  # type: ignore[override]  # noqa: N802 (the gRPC method's name)
        self, request_iterator: Iterator[wire.ProcessingRequest], context: grpc.ServicerContext
    ) -> Iterator[wire.ProcessingResponse]:
        for message in request_iterator:
            kind = message.WhichOneof("request")
            if kind == "request_headers":
                if message.request_headers.end_of_stream:
                    yield self.body_answer
                    return
            elif kind == "request_body" and message.request_body.end_of_stream:
                yield self.headers_answer
                yield self.body_answer
                return


METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class RawHandler(grpc.GenericRpcHandler):
    """Process with identity (de)serialisers: the driver's second message (the body's end) is answered
    with the two answers as bytes, serialised once; nothing is parsed."""

    def __init__(self, processor: FloorProcessor, sync: bool) -> None:
        answers = (processor.headers_answer.SerializeToString(), processor.body_answer.SerializeToString())

        async def process_aio(requests: AsyncIterator[bytes], context: object) -> AsyncIterator[bytes]:
            seen = 0
            async for _ in requests:
                seen += 1
                if seen == 2:
                    for answer in answers:
                        yield answer
                    return

        def process_sync(requests: Iterator[bytes], context: object) -> Iterator[bytes]:
            seen = 0
            for _ in requests:
                seen += 1
                if seen == 2:
                    yield from answers
                    return

        self.handler = grpc.stream_stream_rpc_method_handler(process_sync if sync else process_aio)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self.handler if handler_call_details.method == METHOD else None  # type: ignore[attr-defined]


async def serve(port: int, raw: bool) -> None:
    server = grpc.aio.server()
    processor = FloorProcessor("127.0.0.1:8000")
    if raw:
        server.add_generic_rpc_handlers((RawHandler(processor, sync=False),))
    else:
        pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_sync(port: int, raw: bool) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    processor = SyncFloorProcessor("127.0.0.1:8000")
    if raw:
        server.add_generic_rpc_handlers((RawHandler(processor, sync=True),))
    else:
        pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--server", choices=("aio", "sync"), default="aio")
    parser.add_argument("--raw", action="store_true", help="identity (de)serialisers, nothing parsed")
    args = parser.parse_args()
    if args.server == "sync":
        serve_sync(args.port, args.raw)
    else:
        asyncio.run(serve(args.port, args.raw))


if __name__ == "__main__":
    main()
