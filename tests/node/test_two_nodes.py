"""Two real nodes and the network between them (vllm_stack_dev.cluster.node_network): Pods on one node reach
Pods on the other by Pod IP, by their Service's ClusterIP (the client node's kube-proxy) and by the
Service's DNS name (the one CoreDNS, on node-0, reached from node-1's Pods over the link).

A server Pod pinned to each node (nodeSelector `kubernetes.io/hostname`) answers with the node it runs on
and the address the connection came from; a client Pod pinned to the other node asks it three ways and
returns what it got as its termination message (Pod IPs are reachable only inside the nodes' namespaces).
The server seeing the client's own Pod IP shows the path is routed, not translated, both ways.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator

import pytest
from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.node import RealNode
from vllm_stack_dev.cluster.releases import pod_ready
from vllm_stack_dev.images import ROUTER

pytestmark = [
    pytest.mark.node,
    pytest.mark.node_full,
]  # the whole matrix only (make test-node): make test runs one node

NAMESPACE = "two-nodes"
PORT = 8000

SERVER = f"""
import http.server, json, os
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({{"node": os.environ["NODE_NAME"], "peer": self.client_address[0]}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", {PORT}), Handler).serve_forever()
"""

# Resolving is retried for a bounded time (CoreDNS learns a new Service from its watch); a connection is
# not: the test waits for the client node's kube-proxy rules before it starts the client.
CLIENT = f"""
import json, os, socket, time, urllib.request
name = os.environ["SERVICE_NAME"]
deadline = time.monotonic() + 20
while True:
    try:
        resolved = socket.gethostbyname(name)
        break
    except OSError as error:
        if time.monotonic() > deadline:
            raise SystemExit(f"{{name}} not resolved within 20 s: {{error}}")
        time.sleep(0.5)
result = {{"resolved": resolved}}
for key, host in (("by_pod_ip", os.environ["SERVER_IP"]), ("by_cluster_ip", os.environ["CLUSTER_IP"]),
                  ("by_name", name)):
    with urllib.request.urlopen(f"http://{{host}}:{PORT}/", timeout=10) as response:
        result[key] = json.loads(response.read())
with open("/dev/termination-log", "w") as out:
    json.dump(result, out)
"""

CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
}


def _pod(name: str, node: str, code: str, env: dict[str, str], restart: str) -> dict[str, object]:
    """A Pod of the router image (python3 in it) running ``code``, pinned to ``node``."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": name}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "restartPolicy": restart,
            "terminationGracePeriodSeconds": 1,
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
            "containers": [
                {
                    "name": "main",
                    "image": ROUTER.reference(),
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python3", "-c", code],
                    "env": [
                        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                        *({"name": k, "value": v} for k, v in env.items()),
                    ],
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "securityContext": CONTAINER_SECURITY,
                }
            ],
        },
    }


def _server(node: str) -> list[dict[str, object]]:
    """The server Pod `server-<node>` and its Service (same name, port 8000)."""
    name = f"server-{node}"
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"selector": {"app": name}, "ports": [{"port": PORT, "targetPort": PORT}]},
    }
    readiness = {"readinessProbe": {"httpGet": {"path": "/", "port": PORT}, "periodSeconds": 1}}
    pod = _pod(name, node, SERVER, {}, "Always")
    pod["spec"]["containers"][0].update(readiness)  # type: ignore[index]
    return [pod, service]


def _finished(cluster: Cluster, name: str, timeout: float = 90.0) -> dict:
    """The Pod once its phase is Succeeded or Failed (a failed client fails the test at once, with its
    log as the termination message)."""
    deadline = time.monotonic() + timeout
    while True:
        pod = cluster.get("pod", name, "-n", NAMESPACE)
        if pod["status"].get("phase") in ("Succeeded", "Failed"):  # type: ignore[union-attr]
            return pod
        if time.monotonic() > deadline:
            raise AssertionError(
                f"pod {name} neither Succeeded nor Failed within {timeout:.0f} s: {pod['status']}"
            )
        time.sleep(0.5)


@pytest.fixture(scope="module")
def two_nodes(two_node_cluster: tuple[Cluster, list[RealNode]]) -> Iterator[tuple[Cluster, list[RealNode]]]:
    """two_node_cluster with this module's namespace, deleted at the end (its Pods on node-1 are deleted
    by two_node_cluster before node-1 stops)."""
    cluster, _ = two_node_cluster
    cluster.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}])
    try:
        yield two_node_cluster
    finally:
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def test_two_real_nodes_are_ready_on_one_network(two_nodes: tuple[Cluster, list[RealNode]]) -> None:
    cluster, nodes = two_nodes
    found = {n["metadata"]["name"]: n for n in cluster.get("nodes")["items"]}  # type: ignore[index,union-attr]
    for node in nodes:
        status = found[node.name]["status"]
        assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True", status
        assert status["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://"), status["nodeInfo"]
        assert {"type": "InternalIP", "address": node.ip} in status["addresses"], status["addresses"]
    assert [node.pod_cidr for node in nodes] == ["10.244.0.0/24", "10.244.1.0/24"]

    # Each node routes the other's Pods via its node IP and nothing anywhere else (no default route)
    for node, other in zip(nodes, nodes[::-1], strict=True):
        routes = node.run_in_node(["ip", "route"])
        assert f"{other.pod_cidr} via {other.ip} dev node0" in routes, routes
        assert "default" not in routes, routes
    # The host's own network namespace has none of those addresses or routes (podman's own cni-podman0,
    # 10.88.0.1/16, may be there: it is podman's, not the nodes')
    addresses = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, check=True).stdout
    for node in nodes:
        assert f"inet {node.ip}/" not in addresses, addresses
    assert "10.244." not in addresses + routes, addresses + routes


def test_pods_reach_pods_of_the_other_node(two_nodes: tuple[Cluster, list[RealNode]]) -> None:
    cluster, nodes = two_nodes
    names = [node.name for node in nodes]
    cluster.apply([obj for name in names for obj in _server(name)])
    cluster.kubectl("wait", "pod", "-n", NAMESPACE, "-l", "app in (server-node-0,server-node-1)",
                    "--for=condition=Ready", "--timeout=120s", check=False)  # fmt: skip
    servers = {}
    for node in nodes:
        pod = cluster.get("pod", f"server-{node.name}", "-n", NAMESPACE)
        assert pod_ready(pod), pod["status"]  # type: ignore[arg-type]
        assert pod["spec"]["nodeName"] == node.name  # type: ignore[index]
        pod_ip = pod["status"]["podIP"]  # type: ignore[index]
        assert pod_ip.startswith(node.pod_cidr.rsplit(".", 1)[0] + "."), (node.pod_cidr, pod_ip)
        service = cluster.get("service", f"server-{node.name}", "-n", NAMESPACE)
        servers[node.name] = (pod_ip, service["spec"]["clusterIP"])  # type: ignore[index]

    # Each client asks the other node's server; its own kube-proxy must lead the ClusterIP there first
    clients = {"node-0": "node-1", "node-1": "node-0"}
    for node in nodes:
        node.wait_proxied(f"{NAMESPACE}/server-{clients[node.name]}", servers[clients[node.name]][0])
    cluster.apply([
        _pod(f"client-{client}", client, CLIENT, {
            "SERVICE_NAME": f"server-{server}.{NAMESPACE}.svc.cluster.local",
            "SERVER_IP": servers[server][0], "CLUSTER_IP": servers[server][1]}, "Never")
        for client, server in clients.items()
    ])  # fmt: skip
    for client, server in clients.items():
        pod = _finished(cluster, f"client-{client}")
        terminated = pod["status"]["containerStatuses"][0]["state"].get("terminated", {})  # type: ignore[index]
        assert pod["status"]["phase"] == "Succeeded", (client, terminated or pod["status"])  # type: ignore[index]
        assert pod["spec"]["nodeName"] == client  # type: ignore[index]
        found = json.loads(terminated["message"])
        client_ip = pod["status"]["podIP"]  # type: ignore[index]
        assert found["resolved"] == servers[server][1], found
        answer = {"node": server, "peer": client_ip}
        assert found["by_pod_ip"] == answer and found["by_cluster_ip"] == answer, (client, found)
        assert found["by_name"] == answer, (client, found)
