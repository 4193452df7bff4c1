"""What a test sees of a container on the real node: its OCI spec and commands run in it, through containerd's
`ctr` inside the node's namespaces (the API server cannot reach the kubelet's port there, so `kubectl exec` and
`kubectl logs` are not available; the kubelet writes container logs under the node's `pod-logs` folder)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.node import RealNode

CONTAINERD_SOCKET = "/run/containerd/containerd.sock"


def ctr(
    node: RealNode, *args: str, check: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`ctr -n k8s.io ARGS` in the node (the kubelet's containerd namespace)."""
    command = node.in_node(["ctr", "--address", CONTAINERD_SOCKET, "-n", "k8s.io", *args])
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"ctr {' '.join(args)} failed ({result.returncode}): {result.stderr}")
    return result


def container_id(pod: dict, name: str) -> str:
    """The containerd ID of the running container ``name`` of ``pod`` (a Pod object from the API server)."""
    for status in pod["status"].get("containerStatuses", []):
        if status["name"] == name and status.get("containerID"):
            return status["containerID"].removeprefix("containerd://")
    raise AssertionError(f"{pod['metadata']['name']} has no container {name} running: {pod['status']}")


def oci_spec(node: RealNode, cid: str) -> dict:
    """The OCI runtime spec containerd gave runc for the container: what the runtime enforced."""
    return json.loads(ctr(node, "containers", "info", cid).stdout)["Spec"]


def exec_in(node: RealNode, cid: str, exec_id: str, script: str) -> subprocess.CompletedProcess[str]:
    """`sh -c SCRIPT` in the running container, as its own user (ctr exec inherits the container's process)."""
    return ctr(node, "tasks", "exec", "--exec-id", exec_id, cid, "sh", "-c", script, check=False)


def assert_hardened(spec: dict, uid: int) -> None:
    """Non-root ``uid``, read-only root file system, no capabilities, no privilege escalation."""
    process = spec["process"]
    assert process["user"]["uid"] == uid, process["user"]
    assert spec["root"].get("readonly") is True, spec["root"]
    assert not process["capabilities"].get("effective"), process["capabilities"]
    assert not process["capabilities"].get("bounding"), process["capabilities"]
    assert process.get("noNewPrivileges") is True


def pod_log(node: RealNode, pod: dict, container: str) -> str:
    """The container's log as the kubelet wrote it (all restarts), for failure messages."""
    meta = pod["metadata"]
    folder = node.workdir / "pod-logs" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / container
    return "\n".join(path.read_text(errors="replace") for path in sorted(Path(folder).glob("*.log")))


def client_pod(name: str, namespace: str, image: str, command: list[str]) -> dict[str, object]:
    """A run-to-completion Pod in the cluster network, hardened as the chart's Pods are; what it finds comes
    back as its termination message (it writes /dev/termination-log; 4096 bytes at most)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "runAsUser": 10001},
            "containers": [
                {
                    "name": "client",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": command,
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                        "readOnlyRootFilesystem": True,
                    },
                }
            ],
        },
    }


def finished_pod(cluster: Cluster, name: str, namespace: str, timeout: float) -> dict:
    """The Pod once it Succeeded or Failed; fails naming the Pod and its state after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        pod = cluster.get("pod", name, "-n", namespace)
        if pod["status"].get("phase") in ("Succeeded", "Failed"):  # type: ignore[union-attr]
            return pod
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {name} not finished within {timeout:.0f} s: {pod['status']}")
        time.sleep(0.5)


def text_from_node(node: RealNode, url: str) -> str:
    """GET ``url`` from the node's network namespace (Pod IPs are reachable only there); its body."""
    code = f"import urllib.request,sys; sys.stdout.write(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    return node.run_in_node([sys.executable, "-c", code], timeout=30)


def get_from_node(node: RealNode, url: str) -> dict:
    """GET ``url`` from the node's network namespace; its JSON."""
    return json.loads(text_from_node(node, url))
