"""KEDA scales the chart's engines on a real API server: its operator and metrics adapter built from Go
modules, the controller manager's HPA controller, a real Prometheus scraping the Pods, real engines.

The release (the chart's ScaledObjects as rendered, with polling, cooldown and the HPA's stabilization
windows shortened through values, so that the test takes minutes and not the defaults' quarter hour):
- `tiny-llama`: one to two replicas on the chart's default trigger, the model's `vllm:num_requests_waiting`
  summed over its Pods; engines take two sequences at a time (`--max-num-seqs 2`), so a few concurrent
  requests make a queue;
- `cold-llama`: zero to one replica, woken by the chart's activation trigger on the router's own series
  (requests waiting in its queue for a model without engines).

As in tests/cluster/test_discovery.py, every engine Pod gets a real vLLM engine at its IP once kwok runs it
(vllm_stack_dev.cluster.pod_processes) and the router runs as the chart's ServiceAccount. Prometheus scrapes
the Pods the API server lists (vllm_stack_dev.cluster.prometheus).
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.keda import Keda
from vllm_stack_dev.cluster.pod_processes import PodProcesses
from vllm_stack_dev.cluster.prometheus import PodTargets, start_cluster_prometheus
from vllm_stack_dev.cluster.releases import Helm, place, wait_workloads_ready
from vllm_stack_dev.testbed.engines import port_for_later, stop_group
from vllm_stack_dev.waiting import wait_http_ok

from tests.cluster.serving import Load, arrivals
from tests.cluster.serving import wait_for as wait_for_state
from tests.cluster.test_discovery import SERVICE_ACCOUNT
from tests.cluster.test_install import RELEASE
from tests.conftest import CHAT_MODEL, READY_TIMEOUT
from tests.helm.chart import CHART

pytestmark = pytest.mark.cluster

NAMESPACE = "autoscaling"
COLD_MODEL = "cold-llama"
HOT = f"{RELEASE}-tiny-deployment-vllm"
COLD = f"{RELEASE}-cold-deployment-vllm"
FAST_KEDA = {"pollingInterval": 1, "cooldownPeriod": 5,
             "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                 "scaleUp": {"stabilizationWindowSeconds": 0},
                 "scaleDown": {"stabilizationWindowSeconds": 5, "policies": [
                     {"type": "Pods", "value": 1, "periodSeconds": 1}]}}}}}  # fmt: skip


#: serving.wait_for at half-second polls: most conditions here run kubectl, a process each.
wait_for = functools.partial(wait_for_state, interval=0.5)


def values(prometheus: str) -> dict:
    return {
        "keda": {"prometheusServerAddress": prometheus},
        "servingEngineSpec": {
            "modelSpec": [
                {
                    "name": "tiny",
                    "modelURL": CHAT_MODEL,
                    "replicaCount": 1,
                    "vllmConfig": {"extraArgs": ["--max-num-seqs", "2"]},
                    "keda": {
                        "enabled": True,
                        "minReplicaCount": 1,
                        "maxReplicaCount": 2,
                        **FAST_KEDA,
                        "triggers": [
                            {
                                "type": "prometheus",
                                "metadata": {"query": "vllm:num_requests_waiting", "threshold": "1"},
                            }
                        ],
                    },
                },
                {
                    "name": "cold",
                    "modelURL": COLD_MODEL,
                    "replicaCount": 0,
                    "keda": {
                        "enabled": True,
                        "minReplicaCount": 0,
                        "maxReplicaCount": 1,
                        **FAST_KEDA,
                        "activation": {"enabled": True, "threshold": 0, "window": "10s"},
                    },
                },
            ],
        },  # fmt: skip
        "routerSpec": {
            "routingLogic": "roundrobin",
            "healthCheckInterval": 1,
            "priority": {"queue": {"timeoutSeconds": 300}},
        },
    }


class Autoscaled:
    def __init__(self, cluster: Cluster, pods: PodProcesses, router_url: str) -> None:
        self.cluster = cluster
        self.pods = pods
        self.url = router_url

    def replicas(self, deployment: str) -> int:
        return int(self.cluster.get("deployment", deployment, "-n", NAMESPACE)["spec"].get("replicas") or 0)

    def engine_pods(self, deployment: str) -> set[str]:
        return {p["metadata"]["name"] for p in self.pods.pods()
                if p["metadata"]["name"].startswith(deployment + "-")}  # fmt: skip

    def routable(self) -> dict[str, list[str]]:
        self.pods.check()  # a Pod's process that failed to start fails the test now, not at a timeout
        engines = httpx.get(f"{self.url}/engines", timeout=5).json()["engines"]
        return {e["name"]: e["models"] for e in engines if e["healthy"]}


@pytest.fixture(scope="module")
def autoscaled(
    scaling_cluster: Cluster,
    tiny_model_dir: Path,
    engine_logs_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Autoscaled]:
    cluster = scaling_cluster
    work = tmp_path_factory.mktemp("keda")
    prometheus_port = port_for_later()
    values_file = work / "values.yaml"
    values_file.write_text(json.dumps(values(f"http://127.0.0.1:{prometheus_port}")))
    helm = Helm(cluster, 4)
    documents = helm.template(RELEASE, CHART, NAMESPACE, values_file)
    with Keda(cluster, work / "keda"):
        with place(cluster, documents, NAMESPACE):
            helm.install(RELEASE, CHART, NAMESPACE, values_file)
            wait_workloads_ready(cluster, NAMESPACE)
        targets = PodTargets(work / "prometheus-targets")
        prometheus = start_cluster_prometheus(targets, work / "prometheus", prometheus_port)
        try:
            kubeconfig = cluster.service_account_kubeconfig(
                NAMESPACE, SERVICE_ACCOUNT, work / "router.kubeconfig"
            )
            pods = PodProcesses(cluster, NAMESPACE, documents, model_dir=tiny_model_dir, workdir=work / "pods",
                                log_dir=engine_logs_dir, router_env={"KUBECONFIG": str(kubeconfig)},
                                on_pods=targets.update)  # fmt: skip
            with pods, pods.follow():
                wait_for(lambda: pods.check() or pods.routers, 30, "the router Pod's process started")
                (router,) = pods.routers.values()
                wait_http_ok(f"{router.url}/health", 60, router.process)
                stack = Autoscaled(cluster, pods, router.url)
                wait_for(lambda: any(CHAT_MODEL in m for m in stack.routable().values()), READY_TIMEOUT,
                         "the tiny-llama engine routable")  # fmt: skip
                yield stack
        finally:
            stop_group(prometheus)


def test_the_charts_scaled_objects_are_accepted_and_drive_hpas(autoscaled: Autoscaled) -> None:
    cluster = autoscaled.cluster
    for deployment in (HOT, COLD):
        (scaled,) = [o for o in cluster.get("scaledobjects", "-n", NAMESPACE)["items"]
                     if o["spec"]["scaleTargetRef"]["name"] == deployment]  # fmt: skip
        name = scaled["metadata"]["name"]
        wait_for(lambda n=name: _condition(cluster.get("scaledobject", n, "-n", NAMESPACE), "Ready") == "True",
                 60, f"ScaledObject {name} Ready")  # fmt: skip
        hpa = wait_for(lambda n=name: _get_or_none(cluster, "hpa", f"keda-hpa-{n}"), 60, f"the HPA of {name}")
        assert hpa["spec"]["scaleTargetRef"]["name"] == deployment
        assert hpa["spec"]["metrics"][0]["type"] == "External"


def test_a_queue_scales_the_engines_up_the_router_serves_the_new_pod_and_idle_scales_back(
    autoscaled: Autoscaled,
) -> None:
    first = autoscaled.engine_pods(HOT)
    with Load(autoscaled.url, threads=6, max_tokens=48) as load:
        wait_for(lambda: autoscaled.replicas(HOT) == 2, 90, "the HPA scales the engines to 2 on the queue")
        new = wait_for(lambda: autoscaled.engine_pods(HOT) - first, 30, "a second engine Pod")
        (new_pod,) = new
        wait_for(lambda: new_pod in autoscaled.routable(), READY_TIMEOUT, f"{new_pod}'s engine routable")
        engine = autoscaled.pods.engine_of(new_pod)
        wait_for(lambda: arrivals(engine) > 0, 60, f"requests served by {new_pod}")
    assert load.codes and set(load.codes) == {200}, f"answers other than 200: {sorted(set(load.codes))}"
    wait_for(lambda: autoscaled.replicas(HOT) == 1, 120, "idle: back to one engine")
    wait_for(lambda: len(autoscaled.engine_pods(HOT)) == 1, 60, "one engine Pod left")


def test_a_model_at_zero_is_woken_by_its_queued_request_and_goes_back_to_zero(autoscaled: Autoscaled) -> None:
    assert autoscaled.replicas(COLD) == 0 and not autoscaled.engine_pods(COLD)
    answer: list[httpx.Response] = []
    body = {"model": COLD_MODEL, "prompt": "wake up", "max_tokens": 2}
    asking = threading.Thread(
        target=lambda: answer.append(httpx.post(f"{autoscaled.url}/v1/completions", json=body, timeout=400)),
        daemon=True,
    )
    asking.start()
    wait_for(lambda: autoscaled.replicas(COLD) == 1, 60, "KEDA activates the model on the router's queue")
    asking.join(timeout=READY_TIMEOUT + 60)
    assert answer and answer[0].status_code == 200, answer[0].text if answer else "no answer"
    wait_for(lambda: autoscaled.replicas(COLD) == 0, 120, "idle past the cooldown: back to zero")


def _condition(obj: dict, kind: str) -> str | None:
    for condition in obj.get("status", {}).get("conditions", []):
        if condition["type"] == kind:
            return condition["status"]
    return None


def _get_or_none(cluster: Cluster, kind: str, name: str) -> dict | None:
    result = cluster.kubectl("get", kind, name, "-n", NAMESPACE, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None
