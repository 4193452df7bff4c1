"""An InferencePool on a test cluster whose Pods are addresses for engines started by the caller.

For a benchmark that starts its own engines (the routing-quality benchmark) and must also offer them to
a picker that reads Pods from an API server (the upstream EPP): a control plane is started
(:mod:`vllm_stack_dev.cluster.control_plane`, kwok reporting each Pod Running and Ready at a loopback IP),
with one Pod per engine, an InferencePool selecting them on one port, and a ServiceAccount with what a
picker reads (pods, inferencepools, inferenceobjectives, inferencemodelrewrites). The caller then starts
each engine at its Pod's IP and that port (loopback addresses: 127.16.0.0/12), so the endpoint a picker
names (``podIP:port``) is the engine's own address, the one every router is given.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_stack_dev.cluster.control_plane import Cluster, ClusterOptions, running_cluster
from vllm_stack_dev.testbed.engines import port_for_later

NAMESPACE = "routing-bench"
POOL = "bench-pool"
ACCOUNT = "picker"
_LABELS = {"app": POOL}
_READ = ["get", "list", "watch"]


@dataclass(frozen=True)
class PoolSite:
    """What the engines and the pickers need: the Pods' IPs, the port, and the picker's credentials."""

    cluster: Cluster
    kubeconfig: Path
    namespace: str
    pool: str
    hosts: list[str]
    port: int
    #: The port every engine publishes its KV events on, at its own Pod IP: llm-d's precise profile
    #: dials ``tcp://<PodIP>:<port>``, one port for the whole pool.
    kv_events_port: int


def _objects(count: int, port: int) -> list[dict[str, Any]]:
    meta = {"namespace": NAMESPACE}
    rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": _READ},
        {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": _READ},
        {"apiGroups": ["inference.networking.x-k8s.io"],
         "resources": ["inferenceobjectives", "inferencemodelrewrites"], "verbs": _READ},
    ]  # fmt: skip
    pods = [
        {"apiVersion": "v1", "kind": "Pod", "metadata": {**meta, "name": f"engine-{i}", "labels": _LABELS},
         "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai",
                                  "ports": [{"name": "http", "containerPort": port}]}]}}
        for i in range(count)
    ]  # fmt: skip
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {**meta, "name": ACCOUNT}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {**meta, "name": ACCOUNT},
         "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {**meta, "name": ACCOUNT},
         "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ACCOUNT}},
        {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {**meta, "name": POOL},
         "spec": {"selector": {"matchLabels": _LABELS}, "targetPorts": [{"number": port}],
                  "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}},
        *pods,
    ]  # fmt: skip


def _ready_ips(cluster: Cluster, count: int) -> list[str] | None:
    pods = cluster.get("pods", "-n", NAMESPACE, "-l", f"app={POOL}")["items"]
    ips = []
    for pod in pods:  # type: ignore[union-attr]
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        if ready and status.get("podIP"):
            ips.append(status["podIP"])
    return sorted(ips) if len(ips) == count else None


@contextlib.contextmanager
def pool_site(workdir: Path, count: int, port: int, timeout: float = 120.0) -> Iterator[PoolSite]:
    """A cluster with the pool and ``count`` Ready Pods for the ``with`` block, stopped afterwards (the
    CRDs from the control plane's default folder, the InferencePool's among them)."""
    with running_cluster(ClusterOptions(workdir=workdir / "cluster", nodes=1)) as cluster:
        cluster.apply(_objects(count, port))
        deadline = time.monotonic() + timeout
        while (hosts := _ready_ips(cluster, count)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the pool's {count} Pods were not Ready with an IP within {timeout:.0f} s"
                )
            time.sleep(0.2)
        if not all(h.startswith("127.") for h in hosts):
            raise RuntimeError(f"Pod IPs outside loopback: {hosts}")
        kubeconfig = cluster.service_account_kubeconfig(NAMESPACE, ACCOUNT, workdir / "picker.kubeconfig")
        yield PoolSite(cluster, kubeconfig, NAMESPACE, POOL, hosts, port, port_for_later())
