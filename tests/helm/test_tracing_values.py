"""Tracing in the chart: production-stack's routerSpec.otel turns the router's tracing on as its chart
does, servingEngineSpec.tracing turns vLLM's on (its OTEL_* env alone does not, and NOTES says so),
the router dashboard's TTFT panel asks for exemplars, and the chart's Grafana datasource links an
exemplar's trace_id to the trace. What the router does with the flags: tests/router/test_tracing*.py."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helm.chart import CHART, container, env_of, flag, one, render, router_name, values_file
from tests.helm.test_production_stack_files import load, manifest_and_notes

pytestmark = pytest.mark.helm

MODEL = {"name": "m", "modelURL": "org/m", "repository": "vllm/vllm-openai", "tag": "v0.32.0"}


def _router_args(objs: list[dict]) -> list[str]:
    return container(one(objs, "Deployment", router_name()))["args"]


def _engine(objs: list[dict]) -> dict:
    (engine,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] != router_name()]
    return container(engine)


def test_routerSpec_otel_renders_the_routers_tracing_flags(tmp_path) -> None:  # noqa: N802 - the key's name
    otel = {"endpoint": "otel-collector:4317", "secure": True, "protocol": "grpc", "sampleRatio": 0.25}
    args = _router_args(render([values_file(tmp_path, {"routerSpec": {"otel": otel}})]))
    assert flag(args, "--otel-endpoint") == "otel-collector:4317"
    assert flag(args, "--otel-service-name") == "vllm-router"  # production-stack's default
    assert "--otel-secure" in args
    assert flag(args, "--otlp-traces-protocol") == "grpc" and flag(args, "--trace-sample-ratio") == "0.25"
    quiet = _router_args(
        render([values_file(tmp_path, {"routerSpec": {"otel": {"serviceName": "x"}}}, "b.yaml")])
    )
    assert not [a for a in quiet if a.startswith(("--otel", "--otlp", "--trace"))]  # no endpoint: off


def test_servingEngineSpec_tracing_turns_vllms_tracing_on(tmp_path) -> None:  # noqa: N802
    values = {
        "servingEngineSpec": {
            "tracing": {"endpoint": "otel-collector:4317", "protocol": "http/protobuf"},
            "modelSpec": [{**MODEL, "env": [{"name": "OTEL_SERVICE_NAME", "value": "mine"}]}],
        }
    }
    engine = _engine(render([values_file(tmp_path, values)]))
    assert flag(engine["args"], "--otlp-traces-endpoint") == "otel-collector:4317"
    env = env_of(engine)
    assert env["OTEL_SERVICE_NAME"]["value"] == "mine"  # the model's own wins
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"]["value"] == "http/protobuf"
    off = _engine(render([values_file(tmp_path, {"servingEngineSpec": {"modelSpec": [MODEL]}}, "off.yaml")]))
    assert "--otlp-traces-endpoint" not in off["args"] and "OTEL_SERVICE_NAME" not in env_of(off)


def test_production_stacks_tutorial_12_traces_the_router_and_says_what_its_engine_env_does_not() -> None:
    objs, notes = manifest_and_notes(load("tutorials__values-12-otel-vllm.yaml"))
    args = _router_args(objs)
    assert flag(args, "--otel-endpoint") == "otel-collector:4317"
    assert flag(args, "--otel-service-name") == "vllm-router"
    text = "\n".join(notes)
    assert "the router sends its spans to otel-collector:4317 (service.name vllm-router)" in text
    assert "opt125m: OTEL_EXPORTER_OTLP_* in env alone starts no vLLM tracing" in text
    assert "Deviations" not in text or "otel" not in text.split("Deviations", 1)[1]


def test_the_ttft_panel_asks_for_exemplars() -> None:
    dashboard = json.loads((CHART / "files" / "dashboards" / "router.json").read_text())
    (panel,) = [p for p in dashboard["panels"] if p.get("title") == "Time to first token, with traces"]
    assert panel["targets"] and all(t.get("exemplar") is True for t in panel["targets"])
    assert all("vllm_stack_router_ttft_seconds_bucket" in t["expr"] for t in panel["targets"])


@pytest.mark.parametrize(
    "traces, destination",
    [
        (
            {"tracesUrl": "http://jaeger:16686/trace/${__value.raw}"},
            {"url": "http://jaeger:16686/trace/${__value.raw}"},
        ),
        ({"tracesDatasourceUid": "tempo"}, {"datasourceUid": "tempo"}),
    ],
)
def test_the_grafana_datasource_links_an_exemplars_trace_id_to_its_trace(
    tmp_path, traces, destination
) -> None:
    """The exemplar label is the router's (``trace_id``, vllm_stack.metrics); Grafana opens its destination."""
    grafana = {"enabled": True, "prometheusUrl": "http://prometheus:9090", **traces}
    objs = render([values_file(tmp_path, {"monitoring": {"grafanaDatasource": grafana}})])
    configmap = [
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("grafana-datasource")
    ]
    (datasource,) = yaml.safe_load(configmap[0]["data"]["vllm-stack-datasource.yaml"])["datasources"]
    assert datasource["type"] == "prometheus" and datasource["url"] == "http://prometheus:9090"
    assert datasource["jsonData"]["exemplarTraceIdDestinations"] == [{"name": "trace_id", **destination}]
    assert configmap[0]["metadata"]["labels"]["grafana_datasource"] == "1"
