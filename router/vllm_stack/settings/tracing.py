"""Tracing (vllm_stack.tracing): off unless an OTLP endpoint is given."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_stack.settings.declare import ConfigError, setting

TRACE_PROTOCOLS = ("grpc", "http/protobuf")  # OTLP exporters (vllm_stack.tracing.otel)
TRACER = "the tracer and its exporter are built at start"


@dataclass(frozen=True)
class TracingGroup:
    """OpenTelemetry traces: vLLM's flag names, and production-stack's (its chart renders
    ``--otel-endpoint host:4317``)."""

    __slots__ = ()

    otlp_traces_endpoint: str | None = setting(
        None,
        doc="send OpenTelemetry traces here (OTLP: host:port for grpc, a URL for http/protobuf); off when unset",
        aliases=("--otel-endpoint",),
        restart=TRACER,
        chart="routerSpec.otel.endpoint",
    )
    otlp_traces_protocol: str = setting(
        "grpc",
        doc="OTLP transport (default grpc)",
        choices=TRACE_PROTOCOLS,
        restart=TRACER,
        chart="routerSpec.otel.protocol",
    )
    otel_service_name: str = setting(
        "vllm-stack-router",
        doc="service.name of the router's spans (default vllm-stack-router)",
        restart=TRACER,
        chart="routerSpec.otel.serviceName",
    )
    otel_secure: bool = setting(
        False, doc="OTLP over gRPC with TLS", restart=TRACER, chart="routerSpec.otel.secure"
    )
    trace_sample_ratio: float = setting(
        1.0,
        doc="share of new traces kept, 0..1 (default 1; a client's traceparent decides)",
        restart="the tracer's sampler is built at start",
        chart="routerSpec.otel.sampleRatio",
    )

    def check(self) -> None:
        """Raise :class:`ConfigError` on tracing settings that cannot work."""
        if self.otlp_traces_protocol not in TRACE_PROTOCOLS:
            raise ConfigError(f"otlp_traces_protocol must be one of {', '.join(TRACE_PROTOCOLS)}")
        if not 0 <= self.trace_sample_ratio <= 1:
            raise ConfigError("trace_sample_ratio must be in [0, 1]")
