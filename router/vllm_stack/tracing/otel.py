"""One trace per request with the OpenTelemetry SDK: the router's spans, and the W3C context the
engines continue.

Imported only when tracing is on (see the package docstring). Each proxied request gets a
:class:`RequestTrace` (``ctx.trace``) that holds its open spans:

- the server span ``POST /v1/chat/completions`` (continuing the client's ``traceparent`` when it
  sent one) with the OpenAI attributes: model, stream, prompt and completion tokens (read from the
  answer's ``usage``), status;
- ``admission`` around the admission hooks, ``queue`` while the request waits in its model's queue,
  and a span per awaited stage hook (``prepare``, ``pre_request``: a LoRA adapter load is the
  lora-affinity plugin's awaited pre-request hook, its adapter named on the span);
- ``schedule`` per scheduling decision: profile, picked engine, reason, predicted cached tokens;
- a client span per upstream leg: ``prefill`` and ``decode`` for a disaggregated request,
  ``upstream`` otherwise, one per attempt (a retry is the next attempt's span; the failed one
  carries why). Each leg sends its own span as ``traceparent``, so vLLM's ``llm_request`` span
  (engines started with ``--otlp-traces-endpoint``) is its child.

A request the sampler drops is an :class:`UnsampledTrace` instead: no span beyond the decision, which
its legs pass on. Spans go out in batches (the SDK's BatchSpanProcessor, its own thread) over OTLP, gRPC by default
(production-stack's ``--otel-endpoint host:4317``) or HTTP/protobuf. The provider is the router's,
never the process-global one.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from vllm_stack.endpoint_table import ENDPOINTS
from vllm_stack.tracing import TRACE_HEADERS
from vllm_stack.version import router_version

_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """Where spans go and how many: ``endpoint`` host:port (gRPC) or a URL (HTTP/protobuf)."""

    endpoint: str
    protocol: str = "grpc"
    service_name: str = "vllm-stack-router"
    insecure: bool = True  # gRPC without TLS (production-stack's --otel-secure turns TLS on)
    sample_ratio: float = 1.0  # of new traces; a client's sampled or unsampled parent is followed


def _exporter(settings: TracingSettings) -> SpanExporter:
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=settings.endpoint, insecure=settings.insecure)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    endpoint = settings.endpoint
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    if not endpoint.rstrip("/").endswith("/v1/traces"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return HttpExporter(endpoint=endpoint)


class RequestTracer:
    """The router's tracer: its own provider, sampler and exporter; makes one :class:`RequestTrace`
    per request. ``exporter`` replaces the OTLP one (tests keep spans in memory); ``operations``: each
    path's ``gen_ai.operation.name`` (OpenTelemetry's GenAI conventions; the router's endpoint table)."""

    def __init__(
        self,
        settings: TracingSettings,
        exporter: SpanExporter | None = None,
        operations: Mapping[str, str] = ENDPOINTS.operations,
    ) -> None:
        self.settings = settings
        self.operations = operations
        self.provider = TracerProvider(
            resource=Resource.create(
                {"service.name": settings.service_name, "service.version": router_version()}
            ),
            sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter or _exporter(settings)))
        self.tracer = self.provider.get_tracer("vllm_stack.router", router_version())
        self.propagator = TraceContextTextMapPropagator()

    def begin(
        self,
        method: str,
        path: str,
        headers: Sequence[tuple[bytes, bytes]],
        arrived: float,
        model: str,
        request_id: bytes,
        priority: int,
    ) -> RequestTrace | UnsampledTrace:
        """The request's server span, started at its arrival (``arrived``: perf_counter). A trace the
        sampler drops is an :class:`UnsampledTrace`: no more spans, its decision passed upstream."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in TRACE_HEADERS}
        parent = self.propagator.extract(carrier) if carrier else None
        start = time.time_ns() - int((time.perf_counter() - arrived) * 1e9)
        span = self.tracer.start_span(
            f"{method} {path}", context=parent, kind=SpanKind.SERVER, start_time=start
        )
        if not span.is_recording():
            return UnsampledTrace(span, self.traceparent(span))
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "url.path": path,
            "gen_ai.operation.name": self.operations.get(path) or path.rsplit("/", 1)[-1],
        }
        if model:
            attributes["gen_ai.request.model"] = model
        if request_id:
            attributes["vllm_stack.request_id"] = request_id.decode("latin-1")
            attributes["vllm_stack.priority"] = priority
        span.set_attributes(attributes)
        return RequestTrace(self, span)

    def traceparent(self, span: Span) -> bytes:
        """The header lines that make ``span`` the parent of what the engine does (W3C trace context)."""
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=set_span_in_context(span))
        return "".join(f"{k}: {v}\r\n" for k, v in carrier.items()).encode("latin-1")

    def answered_early(
        self, method: str, path: str, headers: Sequence[tuple[bytes, bytes]], arrived: float, status: int
    ) -> None:
        """A request the API layer answered itself (a bad body, an unknown model): its server span alone."""
        trace = self.begin(method, path, headers, arrived, "", b"", 0)
        trace.end(str(status), None)

    def shutdown(self) -> None:
        """Send what is buffered and stop the exporter (blocking: run it off the event loop)."""
        self.provider.shutdown()


class UnsampledTrace:
    """A request whose trace the sampler dropped: no span is made for it, but its legs send the
    server span's context (flag 00) so that the engines do not sample it either (parent-based)."""

    __slots__ = ("span", "header")
    trace_id = ""  # nothing is kept: no exemplar, no id in the log

    def __init__(self, span: Span, header: bytes) -> None:
        self.span = span  # non-recording
        self.header = header

    def stage_begin(self, name: str, **attributes: Any) -> None:  # noqa: ANN401
        pass

    def stage_end(self, refused: str = "") -> None:
        pass

    def queued(self) -> None:
        pass

    def dequeued(self, outcome: str) -> None:
        pass

    def schedule_begin(self) -> None:
        pass

    def schedule_end(
        self, profile: str, reason: str, engine: str | None, predicted_cached: int | None
    ) -> None:
        pass

    def leg_begin(self, kind: str, engine: str, address: str) -> bytes:
        return self.header

    def leg_end(self, status: int = 0, error: str = "", stream: bool | None = None) -> None:
        pass

    def end(self, status: str, answer_end: bytes | None) -> None:
        pass


class RequestTrace:
    """One sampled request's spans (see the module docstring). Every method is called by the director
    with tracing on; spans still open when the request ends are ended with it. Attributes are given
    when a span starts or in one call before it ends: each ``set_attribute`` of the SDK takes the
    span's lock, and this runs for every request."""

    __slots__ = (
        "tracer",
        "span",
        "context",
        "trace_id",
        "stage",
        "queue",
        "schedule_started",
        "leg",
        "leg_kind",
        "attempts",
        "prefilled",
        "stream",
    )

    def __init__(self, tracer: RequestTracer, span: Span) -> None:
        self.tracer = tracer
        self.span = span
        self.context: Context = set_span_in_context(span)
        # The id logs and TTFT exemplars carry (the trace is kept: the sampler chose it)
        self.trace_id = format(span.get_span_context().trace_id, "032x")
        self.stage: Span | None = None  # admission, or an awaited stage hook
        self.queue: Span | None = None
        self.schedule_started = 0  # time.time_ns() when the decision under way began
        self.leg: Span | None = None
        self.leg_kind = ""
        self.attempts = 0  # legs sent (a prefill leg, decode legs, retries)
        self.prefilled = False  # a prefill leg was answered: the next leg is the decode leg
        self.stream: bool | None = None  # what the engine answered with (an SSE stream or not)

    def _child(
        self, name: str, kind: SpanKind, attributes: dict[str, Any] | None, start: int | None = None
    ) -> Span:
        return self.tracer.tracer.start_span(
            name, context=self.context, kind=kind, attributes=attributes, start_time=start
        )

    # ---- stages ------------------------------------------------------------------------------------
    def stage_begin(self, name: str, **attributes: Any) -> None:  # noqa: ANN401
        if self.stage is not None:
            self.stage.end()
        self.stage = self._child(name, SpanKind.INTERNAL, attributes)

    def stage_end(self, refused: str = "") -> None:
        stage = self.stage
        if stage is not None:
            self.stage = None
            if refused:
                stage.set_attribute("vllm_stack.refused", refused)
                stage.set_status(Status(StatusCode.ERROR, refused))
            stage.end()

    def queued(self) -> None:
        if self.queue is None:
            self.queue = self._child("queue", SpanKind.INTERNAL, None)

    def dequeued(self, outcome: str) -> None:
        queue = self.queue
        if queue is not None:
            self.queue = None
            queue.set_attribute("vllm_stack.queue.outcome", outcome)
            queue.end()

    def schedule_begin(self) -> None:
        self.schedule_started = time.time_ns()

    def schedule_end(
        self, profile: str, reason: str, engine: str | None, predicted_cached: int | None
    ) -> None:
        """The decision's span, from schedule_begin to now, its outcome in its attributes."""
        attributes: dict[str, Any] = {"vllm_stack.profile": profile, "vllm_stack.reason": reason}
        if engine is not None:
            attributes["vllm_stack.engine"] = engine
        if predicted_cached is not None:
            attributes["vllm_stack.predicted_cached_tokens"] = predicted_cached
        self._child("schedule", SpanKind.INTERNAL, attributes, self.schedule_started or None).end()

    # ---- legs --------------------------------------------------------------------------------------
    def leg_begin(self, kind: str, engine: str, address: str) -> bytes:
        """Start the leg's span; the ``traceparent`` (and ``tracestate``) header lines it sends."""
        if self.leg is not None:
            self.leg.end()
        if kind == "upstream" and self.prefilled:
            kind = "decode"
        self.attempts += 1
        self.leg_kind = kind
        span = self.leg = self._child(
            kind,
            SpanKind.CLIENT,
            {"vllm_stack.engine": engine, "server.address": address, "vllm_stack.attempt": self.attempts},
        )
        return self.tracer.traceparent(span)

    def leg_end(self, status: int = 0, error: str = "", stream: bool | None = None) -> None:
        """The leg's answer (``status``), or why it failed (``error``: no answer, a retry's reason)."""
        span = self.leg
        if span is None:
            return
        self.leg = None
        if stream is not None:
            self.stream = stream
        if self.leg_kind == "prefill" and status == 200 and not error:
            self.prefilled = True
        if error:
            attributes: dict[str, Any] = {"vllm_stack.leg.error": error}
            if status:
                attributes["http.response.status_code"] = status
            span.set_attributes(attributes)
            span.set_status(Status(StatusCode.ERROR, error))
        elif status:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        span.end()

    # ---- the end -----------------------------------------------------------------------------------
    def end(self, status: str, answer_end: bytes | None) -> None:
        """The request ended with the request counter's ``status`` label ("200", "client_closed", ...)."""
        self.stage_end()
        self.dequeued(status)
        if self.leg is not None:
            self.leg_end(error=status if not status.isdigit() else "")
        span = self.span
        attributes: dict[str, Any] = {}
        if self.stream is not None:
            attributes["gen_ai.request.stream"] = self.stream
        if answer_end:
            prompt = _PROMPT_TOKENS.findall(answer_end)
            completion = _COMPLETION_TOKENS.findall(answer_end)
            if prompt:
                attributes["gen_ai.usage.input_tokens"] = int(prompt[-1])
            if completion:
                attributes["gen_ai.usage.output_tokens"] = int(completion[-1])
        if status.isdigit():
            code = int(status)
            attributes["http.response.status_code"] = code
            span.set_attributes(attributes)
            if code >= 500:
                span.set_status(Status(StatusCode.ERROR))
        else:
            attributes["vllm_stack.outcome"] = status
            span.set_attributes(attributes)
            if status != "client_closed":
                span.set_status(Status(StatusCode.ERROR, status))
        span.end()
