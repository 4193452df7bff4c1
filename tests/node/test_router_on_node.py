"""The chart's router on a real node: pulled through the local registry mirror, started by containerd and runc,
Running and Ready by the kubelet's own startup, liveness and readiness probes, with the chart's security
contexts enforced by the runtime, and finding its engine Pod with in-cluster configuration (the Service
account token the kubelet projects, the `kubernetes` Service through kube-proxy) under the chart's Role.

The engine is a stub (tests/node/stub_engine_server.py in the router image, answering `/v1/models`,
`/health`, `/metrics` and chat completions as vLLM does) labelled as the chart labels its engines: the
router's readiness needs one healthy engine, and the CPU engine image is not part of this first node test.
A client Pod then reaches the router through its Service, by the name CoreDNS resolves and by the
ClusterIP kube-proxy forwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.node import RealNode
from vllm_stack_dev.cluster.releases import Helm, pod_ready, wait_workloads_ready
from vllm_stack_dev.images import ROUTER
from vllm_stack_dev.paths import repo_root

from tests.node.containers import client_pod, ctr, finished_pod, get_from_node
from tests.node.stub_engine import stub_engine_objects

pytestmark = [
    pytest.mark.node,
    pytest.mark.node_full,
]  # the whole matrix only: test_engines_on_node covers this with the real engines in `make test`

RELEASE = "rt"
NAMESPACE = "node-router"
CHART = repo_root() / "helm"
VALUES = CHART / "examples" / "no-models.yaml"

CLIENT = """
import json, socket, urllib.request
name = "rt-router-service.node-router.svc.cluster.local"
result = {"resolved": socket.gethostbyname(name)}
for key, url in (("by_name", "http://rt-router-service.node-router.svc/v1/models"),
                 ("by_ip", "http://" + result["resolved"] + "/health")):
    with urllib.request.urlopen(url, timeout=10) as response:
        result[key] = [response.status, json.loads(response.read())]
with open("/dev/termination-log", "w") as out:
    json.dump(result, out)
"""


def _router_pod(cluster: Cluster) -> dict:
    pods = cluster.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=router")["items"]
    assert len(pods) == 1, [p["metadata"]["name"] for p in pods]  # type: ignore[union-attr]
    return pods[0]  # type: ignore[index]


def test_router_runs_on_a_real_node(node_cluster: tuple[Cluster, RealNode], tmp_path: Path) -> None:
    cluster, node = node_cluster
    image = ROUTER.reference()  # ghcr.io/vllm-stack/router:<appVersion>, as the chart renders it
    cluster.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}])
    cluster.apply(stub_engine_objects(image, NAMESPACE, RELEASE))
    Helm(cluster, 4).install(RELEASE, CHART, NAMESPACE, VALUES)
    wait_workloads_ready(cluster, NAMESPACE, timeout=300)

    pod = _router_pod(cluster)
    assert pod["spec"]["nodeName"] == node.name
    assert pod_ready(pod)
    status = pod["status"]["containerStatuses"][0]
    assert status["ready"] and status["restartCount"] == 0, status
    assert status["imageID"].startswith("ghcr.io/vllm-stack/router@sha256:"), status["imageID"]
    assert pod["status"]["podIP"].startswith("10.244."), pod["status"]

    # The chart's security contexts, as the runtime applied them (the container's OCI spec and process)
    container_id = status["containerID"].removeprefix("containerd://")
    spec = json.loads(ctr(node, "containers", "info", container_id).stdout)["Spec"]
    assert spec["process"]["user"]["uid"] == 10001 and spec["process"]["user"]["gid"] == 10001
    assert spec["root"].get("readonly") is True
    assert not spec["process"]["capabilities"].get("effective"), spec["process"]["capabilities"]
    assert spec["process"].get("noNewPrivileges") is True
    write = ctr(node, "tasks", "exec", "--exec-id", "probe-write", container_id,
                 "sh", "-c", "id -u; touch /written", check=False)  # fmt: skip
    assert write.returncode != 0 and "Read-only file system" in write.stderr + write.stdout, write
    assert write.stdout.split()[0] == "10001"

    # Discovery with in-cluster configuration: the projected token, the `kubernetes` Service via kube-proxy
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert any("projected" in v and name.startswith("kube-api-access-") for name, v in volumes.items())
    engines = get_from_node(node, f"http://{pod['status']['podIP']}:8000/engines")
    stub = cluster.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/name=stub-engine")["items"][0]  # type: ignore[index]
    text = json.dumps(engines)
    assert stub["status"]["podIP"] in text, yaml.safe_dump(engines)
    ready = get_from_node(node, f"http://{pod['status']['podIP']}:8000/ready")
    assert ready["ready"] and ready["discovery_running"] and ready["healthy_engines"] == 1, ready

    # A client Pod: the router Service by its DNS name (CoreDNS) and by its ClusterIP (kube-proxy)
    cluster.apply([client_pod("client", NAMESPACE, image, ["python3", "-c", CLIENT])])
    client = finished_pod(cluster, "client", NAMESPACE, timeout=90)
    terminated = client["status"]["containerStatuses"][0]["state"].get("terminated", {})  # type: ignore[index]
    assert client["status"]["phase"] == "Succeeded", terminated or client["status"]  # type: ignore[index]
    found = json.loads(terminated["message"])
    service = cluster.get("service", "rt-router-service", "-n", NAMESPACE)
    assert found["resolved"] == service["spec"]["clusterIP"], found  # type: ignore[index]
    assert found["by_name"][0] == 200 and found["by_name"][1]["data"][0]["id"] == "stub-model", found
    assert found["by_ip"] == [200, {"status": "ok"}], found
