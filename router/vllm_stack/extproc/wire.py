"""The endpoint picker protocol on ext_proc v3: keys, and the messages both sides build and read.

What a gateway (Envoy, with the ext_proc filter in FULL_DUPLEX_STREAMED mode) and an endpoint picker (EPP)
exchange for one HTTP request, one bidirectional gRPC stream per request, as the Inference Extension's
upstream EPP v1.5.0 implements it:

gateway -> EPP                              EPP -> gateway
request_headers (end_of_stream=false)       (nothing yet)
request_body chunks, the last with eos      request_headers response: set_headers with the picked endpoint
                                            (``x-gateway-destination-endpoint``) and Content-Length,
                                            clear_route_cache; dynamic_metadata ``envoy.lb`` with the
                                            endpoint list; then the body back (streamed_response chunks
                                            of at most 62000 bytes, the last with eos).
                                            Or, instead of both: an ImmediateResponse (429, 503, 400...).
response_headers                            response_headers response (at once)
response_body chunks, the last with eos     each chunk back as a streamed_response
response_trailers (gRPC answers only)       an empty trailers response

The subset hint (``envoy.lb.subset_hint`` metadata, key ``x-gateway-destination-endpoint-subset``, a list of
``ip:port``) restricts the endpoints a request may go to.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

#: The picked endpoint (``ip:port``): a request header for the gateway's original-destination cluster.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
#: Dynamic metadata namespace (and its key, DESTINATION_HEADER) the gateway's load balancer reads: the
#: picked endpoint, then fallbacks, comma-separated.
LB_NAMESPACE = "envoy.lb"
#: Metadata namespace and key of the gateway's subset hint: the endpoints the request may go to.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
#: Key (in the LB_NAMESPACE metadata of the response's messages) of the endpoint that served the request,
#: which the gateway reports (it may have used a fallback).
SERVED_KEY = "x-gateway-destination-endpoint-served"
#: Request header naming the InferenceObjective (its priority) the request belongs to.
OBJECTIVE_HEADER = "x-gateway-inference-objective"
#: What the upstream EPP adds to every response-headers answer (a gateway may check it was there).
RESPONSE_MARK = "x-went-into-resp-headers"
#: Headers the EPP owns: never echoed back from the request (the protocol's "system-owned" headers).
SYSTEM_HEADERS = frozenset(
    {
        "x-gateway-inference-fairness-id",
        OBJECTIVE_HEADER,
        "x-gateway-model-name-rewrite",
        "x-gateway-destination-endpoint-subset",
        DESTINATION_HEADER,
        "x-gateway-destination-endpoint-served",
        "content-length",
    }
)
#: The largest body chunk one message carries (the upstream EPP's limit; Envoy's default is larger).
BODY_CHUNK = 62_000

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse


def header_value(header: base_pb2.HeaderValue) -> str:
    """A header's value: ``raw_value`` when the gateway sends raw values, else ``value``."""
    return header.raw_value.decode("latin-1") if header.raw_value else header.value


def headers_of(message: pb.HttpHeaders) -> list[tuple[str, str]]:
    """The (lower-case name, value) pairs of a headers message."""
    return [(h.key.lower(), header_value(h)) for h in message.headers.headers]


def header_map(pairs: Iterable[tuple[str, str | bytes]]) -> base_pb2.HeaderMap:
    """A HeaderMap with raw values, as Envoy sends them with ``send_header_raw_value``."""
    header_map = base_pb2.HeaderMap()
    add = header_map.headers.add
    for k, v in pairs:
        header = add()
        header.key = k
        header.raw_value = v if isinstance(v, bytes) else v.encode("latin-1")
    return header_map


def set_headers(pairs: Iterable[tuple[str, str]]) -> pb.HeaderMutation:
    """A mutation setting each pair (raw values)."""
    mutation = pb.HeaderMutation()
    _fill(mutation, pairs)
    return mutation


def _fill(mutation: pb.HeaderMutation, pairs: Iterable[tuple[str, str]]) -> None:
    """Each pair into ``mutation``'s set_headers, field by field with ``add()``: a third of the CPU of
    nested constructors with keyword arguments, and every pick's answer carries a dozen headers."""
    add = mutation.set_headers.add
    for k, v in pairs:
        header = add().header
        header.key = k
        header.raw_value = v.encode("latin-1")


def destination_answer(pairs: Iterable[tuple[str, str]], endpoints: str) -> pb.ProcessingResponse:
    """The answer to the request headers that names the pick: ``pairs`` set (the destination header among
    them), the route cache cleared, and ``endpoints`` (the picked one, then fallbacks) as the ``envoy.lb``
    metadata. Built in place, as :func:`set_headers`."""
    answer = pb.ProcessingResponse()
    common = answer.request_headers.response
    common.clear_route_cache = True
    _fill(common.header_mutation, pairs)
    answer.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[
        DESTINATION_HEADER
    ].string_value = endpoints
    return answer


def subset_hint(message: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the gateway allows for this request (``ip:port`` or ``ip``), or None: any."""
    if not message.HasField("metadata_context"):
        return None
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    return [
        item.string_value for item in value.list_value.values if item.WhichOneof("kind") == "string_value"
    ]


def subset_metadata(endpoints: Iterable[str]) -> base_pb2.Metadata:
    hint = struct_pb2.Struct()
    hint.fields[SUBSET_KEY].list_value.values.extend(struct_pb2.Value(string_value=e) for e in endpoints)
    metadata = base_pb2.Metadata()
    metadata.filter_metadata[SUBSET_NAMESPACE].CopyFrom(hint)
    return metadata


def served_endpoint(message: pb.ProcessingRequest) -> str | None:
    """The endpoint the gateway says served the request (response messages), or None."""
    if not message.HasField("metadata_context"):
        return None
    namespace = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if namespace is None or SERVED_KEY not in namespace.fields:
        return None
    return namespace.fields[SERVED_KEY].string_value or None


def served_metadata(endpoint: str) -> base_pb2.Metadata:
    metadata = base_pb2.Metadata()
    metadata.filter_metadata[LB_NAMESPACE].fields[SERVED_KEY].string_value = endpoint
    return metadata


def destination_of(response: pb.ProcessingResponse) -> tuple[str, list[str]]:
    """The picked endpoint and the whole list (fallbacks after it) of a request-headers answer: from the
    ``envoy.lb`` metadata when it is there, else from the header."""
    listed = ""
    if response.HasField("dynamic_metadata"):
        lb = response.dynamic_metadata.fields.get(LB_NAMESPACE)
        if lb is not None and DESTINATION_HEADER in lb.struct_value.fields:
            listed = lb.struct_value.fields[DESTINATION_HEADER].string_value
    if not listed:
        for option in response.request_headers.response.header_mutation.set_headers:
            if option.header.key.lower() == DESTINATION_HEADER:
                listed = header_value(option.header)
    endpoints = [e.strip() for e in listed.split(",") if e.strip()]
    return (endpoints[0] if endpoints else ""), endpoints


def body_chunks(body: bytes, end_of_stream: bool = True) -> Iterator[tuple[bytes, bool]]:
    """``body`` in chunks of at most BODY_CHUNK bytes, ``end_of_stream`` on the last (one empty chunk for
    an empty body)."""
    if not body:
        yield b"", end_of_stream
        return
    for start in range(0, len(body), BODY_CHUNK):
        end = start + BODY_CHUNK
        yield body[start:end], end_of_stream and end >= len(body)


def streamed_body(direction: str, chunk: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    """A ``request_body`` or ``response_body`` answer carrying ``chunk`` back (full-duplex mode). Field by
    field, as :func:`set_headers`: every body chunk of every answer passes here."""
    answer = pb.ProcessingResponse()
    streamed = getattr(answer, direction).response.body_mutation.streamed_response
    streamed.body = chunk
    streamed.end_of_stream = end_of_stream  # (setting a field marks the messages above it present)
    return answer


def immediate(status: int, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),  # type: ignore[arg-type]
            headers=set_headers(headers),
            body=body,
        )
    )
