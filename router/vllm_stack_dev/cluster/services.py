"""Where a Service's name would take a client, read from the API server: its selector's Ready Pods.

The test cluster has no kube-proxy and no CNI, and the API server refuses loopback Pod IPs in
EndpointSlices, so a Service's ClusterIP leads nowhere here. What a client naming the Service would
reach is still fully decided by objects the API server holds: the Service's selector and port, the
Pods that match the selector and are Ready, and the container port its ``targetPort`` names. This module
resolves that, as kube-proxy would, so a test can address a release by its Service names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.releases import pod_ready


@dataclass(frozen=True)
class Backend:
    """One Ready Pod behind a Service port: its IP (loopback here) and the container port."""

    pod: str
    ip: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


def service_backends(cluster: Cluster, namespace: str, service: str, port: str | int) -> list[Backend]:
    """The Ready Pods behind ``service``'s port (its name or number), each with the resolved target port.

    A Pod being deleted is not a backend (kube-proxy drops it once its deletion starts); a Pod that does
    not expose a named targetPort is skipped, as kube-proxy skips it.
    """
    svc: dict[str, Any] = cluster.get("service", service, "-n", namespace)
    selector = svc["spec"].get("selector") or {}
    if not selector:
        return []
    ports = [p for p in svc["spec"]["ports"] if port in (p.get("name"), p.get("port"))]
    if not ports:
        raise ValueError(f"service {namespace}/{service} has no port {port!r}: {svc['spec']['ports']}")
    target = ports[0].get("targetPort", ports[0]["port"])
    labels = ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
    pods: list[dict[str, Any]] = cluster.get("pods", "-n", namespace, "-l", labels)["items"]  # type: ignore[assignment]
    backends = []
    for pod in pods:
        if pod["metadata"].get("deletionTimestamp") or not pod_ready(pod) or not pod["status"].get("podIP"):
            continue
        number = _container_port(pod, target)
        if number is not None:
            backends.append(Backend(pod["metadata"]["name"], pod["status"]["podIP"], number))
    return backends


def _container_port(pod: dict[str, Any], target: str | int) -> int | None:
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in pod["spec"]["containers"]:
        for declared in container.get("ports") or ():
            if declared.get("name") == target:
                return int(declared["containerPort"])
    return None
