"""grpcio's own floor for an ext_proc pick: an ExternalProcessor that does nothing but answer.

Why: our endpoint picker runs on grpcio's asyncio server (``vllm_stack.epp.server``); part of what a pick
costs it is grpcio's (HTTP/2 framing, protobuf, the stream's task). This servicer runs on the same kind of
server with nothing else: for each stream it reads the messages, answers the request headers with an
empty headers answer and the request body's end with an empty body answer naming a fixed endpoint in the
destination header, as a picker's answer is shaped. Its CPU per pick (``picker_cost.py --pickers
grpc-floor,...``) is the part of ours that no picking code can remove.

Usage: ``python benchmarks/router/extproc_floor.py --port 9100``.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

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


async def serve(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(FloorProcessor("127.0.0.1:8000"), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    asyncio.run(serve(parser.parse_args().port))


if __name__ == "__main__":
    main()
