"""`engineKind: sglang` for a model: SGLang's server, command and flags as sglang 0.5.23 defines them
(sglang/srt/arg_groups/fields/*.py), the Pod label the router's Kubernetes discovery reads, and the
router's `models` entry naming the kind; a vLLM model renders as before."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helm.chart import container, engine_name, flag, one, render, render_error, router_name, values_file
from vllm_stack.config import load_config
from vllm_stack.engines.discovery.kubernetes import pod_endpoint
from vllm_stack.engines.kinds import KIND_LABEL, kind_named

pytestmark = pytest.mark.helm

SGLANG = {
    "name": "sg",
    "modelURL": "org/tiny",
    "engineKind": "sglang",
    "schedulingPolicy": "priority",
    "sglangConfig": {"device": "cpu", "extraArgs": ["--disable-overlap-schedule"]},
}
VLLM = {"name": "vl", "modelURL": "org/v"}


def _values(*models: dict, **spec: object) -> dict:
    return {"servingEngineSpec": {"modelSpec": list(models), **spec}}


@pytest.mark.parametrize("helm", ["helm3", "helm4"])
def test_an_sglang_model_runs_sglangs_server_labelled_for_the_router(tmp_path, helm: str) -> None:
    objs = render([values_file(tmp_path, _values(SGLANG, VLLM))], helm=helm)
    deployment = one(objs, "Deployment", engine_name("sg"))
    engine = container(deployment)
    assert engine["image"] == "lmsysorg/sglang:v0.5.23"
    assert engine["command"] == ["python3", "-m", "sglang.launch_server"]
    args = engine["args"]
    assert flag(args, "--model-path") == "org/tiny" and flag(args, "--served-model-name") == "org/tiny"
    assert (flag(args, "--host"), flag(args, "--port"), flag(args, "--page-size")) == (
        "0.0.0.0",
        "8000",
        "16",
    )
    assert flag(args, "--device") == "cpu"
    assert "--enable-metrics" in args and "--enable-priority-scheduling" in args
    assert args[-1] == "--disable-overlap-schedule"
    # KV events (prefixaware is the default routing): SGLang's KVEventsConfig, on the named ports
    events = json.loads(flag(args, "--kv-events-config") or "{}")
    assert events == {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    assert {p["name"]: p["containerPort"] for p in engine["ports"]} == {
        "http": 8000,
        "kv-events": 5557,
        "kv-replay": 5558,
    }
    # SGLang's /health generates a token: readiness and start-up ask /ready
    probes = {k: engine[k]["httpGet"]["path"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes == {"startupProbe": "/ready", "readinessProbe": "/ready", "livenessProbe": "/health"}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels[KIND_LABEL] == "sglang" and KIND_LABEL not in deployment["spec"]["selector"]["matchLabels"]
    # the vLLM model beside it: vLLM's command, no kind label (vLLM is the router's default)
    vllm = one(objs, "Deployment", engine_name("vl"))
    assert container(vllm)["command"] == ["vllm", "serve"]
    assert KIND_LABEL not in vllm["spec"]["template"]["metadata"]["labels"]
    # the router: the model's kind in its `models`, and a configuration it loads
    config = yaml.safe_load(one(objs, "ConfigMap", router_name("ConfigMap"))["data"]["config.yaml"])
    assert config["models"] == [
        {"name": "org/tiny", "engine_priority": True, "engine_kind": "sglang"},
        {"name": "org/v"},
    ]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert load_config({"static_backends": "http://e:8000"}, str(path)).models == tuple(config["models"])


def test_the_router_reads_the_rendered_pod_label(tmp_path) -> None:
    """What Kubernetes discovery makes of the rendered Pod template's labels."""
    from kubernetes_asyncio.client import V1ObjectMeta, V1Pod, V1PodCondition, V1PodStatus

    objs = render([values_file(tmp_path, _values(SGLANG))])
    labels = one(objs, "Deployment", engine_name("sg"))["spec"]["template"]["metadata"]["labels"]
    pod = V1Pod(
        metadata=V1ObjectMeta(name="sg-0", labels=labels),
        status=V1PodStatus(
            phase="Running", pod_ip="10.0.0.9", conditions=[V1PodCondition(type="Ready", status="True")]
        ),
    )
    endpoint = pod_endpoint(pod, 8000)
    assert endpoint is not None and kind_named(endpoint.kind).name == "sglang"


def test_sglang_lora_api_key_and_tp(tmp_path) -> None:
    model = {
        **SGLANG,
        "schedulingPolicy": "fcfs",
        "sglangConfig": {"enableLora": True, "maxLorasPerBatch": 4, "tpSize": 2, "pageSize": 32},
    }
    objs = render(
        [values_file(tmp_path, _values(model, vllmApiKey="secret-key"))],
    )
    args = container(one(objs, "Deployment", engine_name("sg")))["args"]
    assert (flag(args, "--max-loras-per-batch"), flag(args, "--tp-size"), flag(args, "--page-size")) == (
        "4",
        "2",
        "32",
    )
    assert "--enable-lora" in args and "--enable-priority-scheduling" not in args
    assert flag(args, "--api-key") == "$(VLLM_API_KEY)"  # the env var the chart's Secret fills


def test_an_unknown_engine_kind_is_refused(tmp_path) -> None:
    error = render_error([values_file(tmp_path, _values({**VLLM, "engineKind": "tgi"}))])
    assert "engineKind" in error


def test_keda_scales_an_sglang_model_on_sglangs_own_queue(tmp_path) -> None:
    """KEDA's default trigger reads the engine's queue by its own name: SGLang's `sglang:num_queue_reqs`,
    its total series only (`priority=""`: with priority scheduling SGLang adds one series per priority
    beside the total, and a sum over all would count every request twice); vLLM's model keeps
    `vllm:num_requests_waiting`."""
    keda = {"keda": {"enabled": True, "minReplicaCount": 1, "maxReplicaCount": 3}}
    objs = render([values_file(tmp_path, _values({**SGLANG, **keda}, {**VLLM, **keda}))])
    queries = {
        name: one(objs, "ScaledObject", engine_name(name, "ScaledObject"))["spec"]["triggers"][0]["metadata"][
            "query"
        ]
        for name in ("sg", "vl")
    }
    assert queries["sg"] == 'sum(sglang:num_queue_reqs{model_name="org/tiny",namespace="llm",priority=""})'
    assert queries["vl"] == 'sum(vllm:num_requests_waiting{model_name="org/v",namespace="llm"})'


def test_an_sglang_model_with_a_disaggregation_role_is_refused(tmp_path) -> None:
    """SGLang's prefill/decode hand-over (bootstrap, both engines at once) is not what the router drives
    (vLLM's sequential legs): a role on an SGLang model fails the render with the reason."""
    error = render_error([values_file(tmp_path, _values({**SGLANG, "role": "prefill"}, VLLM))])
    assert "engineKind sglang cannot take a prefill/decode role yet" in error
