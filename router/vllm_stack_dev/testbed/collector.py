"""A real OpenTelemetry Collector for the tracing tests: OTLP in, every span written to a file, read back.

The collector is the distribution `vllm_stack_dev.gotools.OTELCOL` builds (the OTLP receiver, the batch
processor and contrib's file exporter, compiled from their published modules). It listens on loopback
ports of its own for OTLP over gRPC (the router's default and vLLM's) and HTTP, and its file exporter
writes each batch as one line of OTLP JSON. :meth:`Collector.spans` parses those lines into
:class:`SpanRecord` objects, so a test asserts the tree it received: services, names, parent links,
attributes.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_stack_dev.gotools import collector_binary
from vllm_stack_dev.testbed.engines import free_port, spawn_logged, stop_process
from vllm_stack_dev.waiting import tcp_open, wait_until

#: OTLP's span kinds (SpanKind in the protocol's JSON)
KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _value(value: dict[str, Any]) -> Any:  # noqa: ANN401 - an OTLP AnyValue
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in value:
            return value[key]
    if "intValue" in value:
        return int(value["intValue"])  # OTLP JSON writes 64-bit integers as strings
    if "arrayValue" in value:
        return [_value(v) for v in value["arrayValue"].get("values", [])]
    return None


def _attributes(entries: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {entry["key"]: _value(entry.get("value", {})) for entry in entries or []}


@dataclass(frozen=True)
class SpanRecord:
    """One span as the collector received it (ids in lower-case hex, as OTLP JSON writes them)."""

    service: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root span
    attributes: dict[str, Any] = field(default_factory=dict)
    status: str = "unset"  # unset, ok, error


def parse_lines(lines: Iterator[str]) -> list[SpanRecord]:
    """The spans of the file exporter's OTLP JSON lines (ExportTraceServiceRequest, one per line)."""
    spans: list[SpanRecord] = []
    for line in lines:
        if not line.strip():
            continue
        for resource_spans in json.loads(line).get("resourceSpans", []):
            service = str(
                _attributes(resource_spans.get("resource", {}).get("attributes")).get("service.name", "")
            )
            for scope_spans in resource_spans.get("scopeSpans", []):
                for span in scope_spans.get("spans", []):
                    code = span.get("status", {}).get("code", 0)
                    spans.append(
                        SpanRecord(
                            service=service,
                            name=span["name"],
                            kind=KINDS.get(span.get("kind", 0), str(span.get("kind"))),
                            trace_id=span["traceId"].lower(),
                            span_id=span["spanId"].lower(),
                            parent_id=span.get("parentSpanId", "").lower(),
                            attributes=_attributes(span.get("attributes")),
                            status={0: "unset", 1: "ok", 2: "error"}.get(code, str(code)),
                        )
                    )
    return spans


class Collector:
    """The collector process, started by :meth:`start` in ``folder`` (its config, output and log)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.grpc_port = free_port()
        self.http_port = free_port()
        self.output = folder / "traces.jsonl"
        self.log_path = folder / "collector.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def grpc_endpoint(self) -> str:
        """host:port, as the router's --otlp-traces-endpoint and vLLM's take it for gRPC."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/v1/traces"

    def config(self) -> dict[str, Any]:
        return {
            "receivers": {
                "otlp": {
                    "protocols": {
                        "grpc": {"endpoint": self.grpc_endpoint},
                        "http": {"endpoint": f"127.0.0.1:{self.http_port}"},
                    }
                }
            },
            "processors": {"batch": {"timeout": "100ms"}},
            "exporters": {"file": {"path": str(self.output), "flush_interval": "100ms"}},
            "service": {
                "pipelines": {
                    "traces": {"receivers": ["otlp"], "processors": ["batch"], "exporters": ["file"]}
                },
                "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "warn"}},
            },
        }

    def start(self, timeout: float = 60.0) -> Collector:
        """Start it and wait until both receivers accept connections (or raise with its log)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        config = self.folder / "collector.yaml"
        config.write_text(json.dumps(self.config(), indent=1))
        self.process = spawn_logged([str(collector_binary()), "--config", str(config)], self.log_path, None)
        try:
            wait_until(
                lambda: tcp_open(self.grpc_port) and tcp_open(self.http_port),
                timeout,
                self.process,
                "the collector",
            )
        except RuntimeError as error:
            self.stop()
            raise RuntimeError(f"{error}; its log:\n{self.log_path.read_text()[-3000:]}") from None
        return self

    def spans(self) -> list[SpanRecord]:
        """Every span received and written so far."""
        if not self.output.exists():
            return []
        with self.output.open() as lines:
            return parse_lines(line for line in lines if line.endswith("\n"))

    def wait_for(
        self, predicate: Callable[[list[SpanRecord]], bool], timeout: float = 30.0
    ) -> list[SpanRecord]:
        """The spans once ``predicate`` holds for them (a span reaches the file within a second or so)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise TimeoutError(f"the collector's spans never matched; it has {len(spans)}: {names}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None

    def __enter__(self) -> Collector:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
