"""The chart's endpoint picker (``inferenceExtension.epp``) installed on the real API server, serving with
exactly the chart's Role.

One release (model ``tiny``, one engine Pod, the router off, the Inference Extension and our picker on),
installed with Helm 4. For each Pod kwok reports Running, the test bed starts what its container would run
(vllm_stack_dev.cluster.pod_processes): a real vLLM engine at the engine Pod's IP, and our picker at the
picker Pod's IP with the chart's rendered arguments (``--ext-proc-port 9002 --inference-pool ...``) and a
token of the chart's ``<release>-epp`` ServiceAccount (never the admin's). What is shown: the InferencePool
names our picker's Service; the picker reads its pool and the pool's Pods and InferenceObjectives under that
Role alone (its log holds no "forbidden"); and a gateway's request (the Envoy-like driver, to the picker
Pod's IP and port 9002) is answered with the engine Pod's address.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.pod_processes import PodProcesses, RouterProcess
from vllm_stack_dev.cluster.releases import Helm, place, wait_workloads_ready
from vllm_stack_dev.testbed.extproc_driver import exchange
from vllm_stack_dev.waiting import wait_http_ok

from tests.cluster.serving import wait_for
from tests.cluster.test_install import RELEASE
from tests.conftest import CHAT_MODEL, READY_TIMEOUT
from tests.helm.chart import CHART

pytestmark = pytest.mark.cluster

NAMESPACE = "epp-chart"
VALUES = {
    "servingEngineSpec": {"modelSpec": [{"name": "tiny", "modelURL": CHAT_MODEL, "replicaCount": 1}]},
    "routerSpec": {"enableRouter": False, "routingLogic": "prefixaware", "healthCheckInterval": 1},
    "inferenceExtension": {"enabled": True, "epp": {"enabled": True}},
}


class Picker:
    def __init__(self, process: RouterProcess, pods: PodProcesses) -> None:
        self.process = process
        self.pods = pods
        self.client = httpx.Client(base_url=process.url, timeout=30)
        self.host = process.url.removeprefix("http://").rsplit(":", 1)[0]

    def routable(self) -> set[str]:
        self.pods.check()
        engines = self.client.get("/engines", timeout=5).json()["engines"]
        return {
            e["url"].partition("://")[2].rstrip("/")
            for e in engines
            if e["healthy"] and CHAT_MODEL in e["models"]
        }


@pytest.fixture(scope="module")
def picker(
    cluster: Cluster, tiny_model_dir: Path, engine_logs_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Picker, dict[str, Any]]]:
    work = tmp_path_factory.mktemp("epp-chart")
    values = work / "values.yaml"
    values.write_text(json.dumps(VALUES))
    helm = Helm(cluster, 4)
    documents = helm.template(RELEASE, CHART, NAMESPACE, values)
    try:
        with place(cluster, documents, NAMESPACE):
            helm.install(RELEASE, CHART, NAMESPACE, values)
            wait_workloads_ready(cluster, NAMESPACE)
        pools = cluster.get("inferencepools.inference.networking.k8s.io", "-n", NAMESPACE)["items"]
        account = f"{RELEASE}-epp"
        kubeconfig = cluster.service_account_kubeconfig(NAMESPACE, account, work / "epp.kubeconfig")
        pods = PodProcesses(
            cluster, NAMESPACE, documents, model_dir=tiny_model_dir, workdir=work / "pods",
            log_dir=engine_logs_dir, router_env={"KUBECONFIG": str(kubeconfig)},
        )  # fmt: skip
        with pods, pods.follow():
            wait_for(
                lambda: pods.check() or (pods.routers and pods.engines), 60, "the picker and engine processes"
            )
            (process,) = pods.routers.values()
            wait_http_ok(f"{process.url}/health", 60, process.process)
            found = Picker(process, pods)
            try:
                wait_for(
                    lambda: len(found.routable()) == 1,
                    READY_TIMEOUT,
                    "the pool's engine routable by the picker",
                )
                yield found, pools[0]  # type: ignore[index]
            finally:
                found.client.close()
    finally:
        helm.run("uninstall", RELEASE, "-n", NAMESPACE, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", "--ignore-not-found", check=False)


def test_the_pool_names_our_picker_and_it_serves_under_the_charts_role(picker: tuple[Picker, dict]) -> None:
    found, pool = picker
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == f"{RELEASE}-tiny-epp" and ref["port"]["number"] == 9002
    body = orjson.dumps({"model": CHAT_MODEL, "prompt": "hello there", "max_tokens": 2})
    headers = [(":method", "POST"), (":path", "/v1/completions"), ("content-type", "application/json")]
    ex = asyncio.run(exchange(f"{found.host}:9002", headers, body))
    assert ex.kinds == ["request_headers", "request_body"]
    assert ex.endpoint in found.routable()
    log = found.process.log.read_text(errors="replace")
    assert "forbidden" not in log.lower(), log[-3000:]
    assert "InferenceObjectives in" not in log  # no failure of the objectives' list or watch was logged
