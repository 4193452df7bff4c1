"""Request tracing with OpenTelemetry: one trace per request, router to engine.

Off by default. With an OTLP endpoint set (``--otlp-traces-endpoint``, or production-stack's
``--otel-endpoint``), :mod:`vllm_stack.tracing.otel` is imported by the router's assembly and each
proxied request gets a :class:`~vllm_stack.tracing.otel.RequestTrace` in its context (``ctx.trace``).
With tracing off nothing here is imported: this package's ``__init__`` imports nothing, and the
request path only tests ``ctx.trace is None``.
"""

#: The request headers a trace continues from; with tracing on the router sends its own upstream.
TRACE_HEADERS = frozenset({b"traceparent", b"tracestate"})
