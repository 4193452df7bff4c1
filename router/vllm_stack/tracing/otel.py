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

Spans go out in batches (the SDK's BatchSpanProcessor, its own thread) over OTLP, gRPC by default
(production-stack's ``--otel-endpoint host:4317``) or HTTP/protobuf. The provider is the router's,
never the process-global one.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from vllm_stack.tracing import TRACE_HEADERS
from vllm_stack.version import router_version

PROTOCOLS = ("grpc", "http/protobuf")

_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')

#: gen_ai.operation.name of the proxied paths (OpenTelemetry's GenAI conventions)
_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
}


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
    per request. ``exporter`` replaces the OTLP one (tests keep spans in memory)."""

    def __init__(self, settings: TracingSettings, exporter: SpanExporter | None = None) -> None:
        self.settings = settings
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
    ) -> RequestTrace:
        """The request's server span, started at its arrival (``arrived``: perf_counter)."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in TRACE_HEADERS}
        parent = self.propagator.extract(carrier) if carrier else None
        start = time.time_ns() - int((time.perf_counter() - arrived) * 1e9)
        attributes: dict[str, Any] = {
            "http.request.method": method,
            "url.path": path,
            "gen_ai.operation.name": _OPERATIONS.get(path, path.rsplit("/", 1)[-1]),
        }
        if model:
            attributes["gen_ai.request.model"] = model
        if request_id:
            attributes["vllm_stack.request_id"] = request_id.decode("latin-1")
            attributes["vllm_stack.priority"] = priority
        span = self.tracer.start_span(
            f"{method} {path}", context=parent, kind=SpanKind.SERVER, start_time=start, attributes=attributes
        )
        return RequestTrace(self, span)

    def answered_early(
        self, method: str, path: str, headers: Sequence[tuple[bytes, bytes]], arrived: float, status: int
    ) -> None:
        """A request the API layer answered itself (a bad body, an unknown model): its server span alone."""
        trace = self.begin(method, path, headers, arrived, "", b"", 0)
        trace.end(str(status), None)

    def shutdown(self) -> None:
        """Send what is buffered and stop the exporter (blocking: run it off the event loop)."""
        self.provider.shutdown()


class RequestTrace:
    """One request's spans (see the module docstring). Every method is called by the director with
    tracing on; spans still open when the request ends are ended with it."""

    __slots__ = (
        "tracer",
        "span",
        "context",
        "trace_id",
        "stage",
        "queue",
        "schedule",
        "leg",
        "leg_kind",
        "attempts",
        "prefilled",
    )

    def __init__(self, tracer: RequestTracer, span: Span) -> None:
        self.tracer = tracer
        self.span = span
        self.context: Context = set_span_in_context(span)
        span_context = span.get_span_context()
        # The id logs and TTFT exemplars carry: only for a trace that is kept (sampled).
        self.trace_id = format(span_context.trace_id, "032x") if span_context.trace_flags.sampled else ""
        self.stage: Span | None = None  # admission, or an awaited stage hook
        self.queue: Span | None = None
        self.schedule: Span | None = None
        self.leg: Span | None = None
        self.leg_kind = ""
        self.attempts = 0  # legs sent (a prefill leg, decode legs, retries)
        self.prefilled = False  # a prefill leg was answered: the next leg is the decode leg

    def _child(self, name: str, kind: SpanKind = SpanKind.INTERNAL, **attributes: Any) -> Span:  # noqa: ANN401
        return self.tracer.tracer.start_span(name, context=self.context, kind=kind, attributes=attributes)

    # ---- stages ------------------------------------------------------------------------------------
    def stage_begin(self, name: str, **attributes: Any) -> None:  # noqa: ANN401
        if self.stage is not None:
            self.stage.end()
        self.stage = self._child(name, **attributes)

    def stage_end(self, refused: str = "") -> None:
        stage = self.stage
        if stage is not None:
            self.stage = None
            if refused:
                stage.set_status(Status(StatusCode.ERROR, refused))
                stage.set_attribute("vllm_stack.refused", refused)
            stage.end()

    def queued(self) -> None:
        if self.queue is None:
            self.queue = self._child("queue")

    def dequeued(self, outcome: str) -> None:
        queue = self.queue
        if queue is not None:
            self.queue = None
            queue.set_attribute("vllm_stack.queue.outcome", outcome)
            queue.end()

    def schedule_begin(self) -> None:
        if self.schedule is not None:
            self.schedule.end()
        self.schedule = self._child("schedule")

    def schedule_end(
        self, profile: str, reason: str, engine: str | None, predicted_cached: int | None
    ) -> None:
        span = self.schedule
        if span is None:
            return
        self.schedule = None
        span.set_attribute("vllm_stack.profile", profile)
        span.set_attribute("vllm_stack.reason", reason)
        if engine is not None:
            span.set_attribute("vllm_stack.engine", engine)
        if predicted_cached is not None:
            span.set_attribute("vllm_stack.predicted_cached_tokens", predicted_cached)
        span.end()

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
            **{"vllm_stack.engine": engine, "server.address": address, "vllm_stack.attempt": self.attempts},
        )
        carrier: dict[str, str] = {}
        self.tracer.propagator.inject(carrier, context=set_span_in_context(span))
        return "".join(f"{k}: {v}\r\n" for k, v in carrier.items()).encode("latin-1")

    def leg_end(self, status: int = 0, error: str = "", stream: bool | None = None) -> None:
        """The leg's answer (``status``), or why it failed (``error``: no answer, a retry's reason)."""
        span = self.leg
        if span is None:
            return
        self.leg = None
        if self.leg_kind == "prefill" and status == 200 and not error:
            self.prefilled = True
        if status:
            span.set_attribute("http.response.status_code", status)
        if stream is not None:
            self.span.set_attribute("gen_ai.request.stream", stream)  # what the engine answered with
        if error:
            span.set_attribute("vllm_stack.leg.error", error)
            span.set_status(Status(StatusCode.ERROR, error))
        elif status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    # ---- the end -----------------------------------------------------------------------------------
    def end(self, status: str, answer_end: bytes | None) -> None:
        """The request ended with the request counter's ``status`` label ("200", "client_closed", ...)."""
        self.stage_end()
        self.dequeued(status)
        if self.schedule is not None:
            self.schedule.end()
            self.schedule = None
        self.leg_end(error=status if not status.isdigit() else "")
        span = self.span
        if status.isdigit():
            code = int(status)
            span.set_attribute("http.response.status_code", code)
            if code >= 500:
                span.set_status(Status(StatusCode.ERROR))
        else:
            span.set_attribute("vllm_stack.outcome", status)
            if status != "client_closed":
                span.set_status(Status(StatusCode.ERROR, status))
        if answer_end:
            prompt = _PROMPT_TOKENS.findall(answer_end)
            completion = _COMPLETION_TOKENS.findall(answer_end)
            if prompt:
                span.set_attribute("gen_ai.usage.input_tokens", int(prompt[-1]))
            if completion:
                span.set_attribute("gen_ai.usage.output_tokens", int(completion[-1]))
        span.end()
