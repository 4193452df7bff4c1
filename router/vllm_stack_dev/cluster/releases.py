"""Helm releases on the test cluster: install, upgrade, roll back, uninstall, and what the API server holds.

Helm runs as it would against any cluster (the admin kubeconfig; Helm 4 applies server-side, Helm 3 with
three-way merges). What a test asks afterwards comes from the API server, never from Helm's own account:
the objects a release's manifest names, whether its Pods are Running and Ready, what an uninstall left.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import yaml

from vllm_stack_dev.cluster.control_plane import Cluster, ClusterError, tool_env
from vllm_stack_dev.cluster.placement import claims_wanted, node_ports, nodes_wanted
from vllm_stack_dev.paths import helm_binary

KEEP_ANNOTATION = "helm.sh/resource-policy"
HELM_TIMEOUT = 180.0


@dataclass(frozen=True)
class ObjectRef:
    """One object of a manifest, as kubectl names it."""

    kind: str
    api_version: str
    name: str
    namespace: str | None
    keep: bool  # annotated helm.sh/resource-policy: keep (Helm leaves it on uninstall)

    @property
    def resource(self) -> str:
        group = self.api_version.rpartition("/")[0]
        return f"{self.kind}.{group}" if group else self.kind


class Helm:
    """One Helm binary (3 or 4) against the cluster."""

    def __init__(self, cluster: Cluster, major: int) -> None:
        self.cluster = cluster
        self.major = major
        self.binary = helm_binary(major)

    def run(
        self, *args: str, check: bool = True, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.binary), f"--kubeconfig={self.cluster.kubeconfig}", *args],
            capture_output=True, text=True, timeout=HELM_TIMEOUT, cwd=cwd, env=tool_env(),
        )  # fmt: skip
        if check and result.returncode != 0:
            raise ClusterError(
                f"helm{self.major} {' '.join(args)} failed ({result.returncode}):\n{result.stderr}"
            )
        return result

    def install(
        self, release: str, chart: Path, namespace: str, *values: Path, sets: tuple[str, ...] = ()
    ) -> None:
        self.run(
            "install", release, str(chart), "-n", namespace, "--create-namespace", *_values_args(values, sets)
        )

    def upgrade(
        self, release: str, chart: Path, namespace: str, *values: Path, sets: tuple[str, ...] = ()
    ) -> None:
        self.run("upgrade", release, str(chart), "-n", namespace, *_values_args(values, sets))

    def template(
        self, release: str, chart: Path, namespace: str, *values: Path, sets: tuple[str, ...] = ()
    ) -> list[dict]:
        """The documents ``install`` would apply (rendered client-side, as `helm template` does)."""
        text = self.run("template", release, str(chart), "-n", namespace, *_values_args(values, sets)).stdout
        return [doc for doc in yaml.safe_load_all(text) if doc]

    def rollback(self, release: str, namespace: str, revision: int) -> None:
        self.run("rollback", release, str(revision), "-n", namespace)

    def uninstall(self, release: str, namespace: str) -> None:
        self.run("uninstall", release, "-n", namespace)

    def manifest(self, release: str, namespace: str) -> list[ObjectRef]:
        text = self.run("get", "manifest", release, "-n", namespace).stdout
        return manifest_objects(text, namespace)

    def status(self, release: str, namespace: str) -> tuple[str, int]:
        """The release's status and revision, as Helm records them."""
        doc = yaml.safe_load(self.run("status", release, "-n", namespace, "-o", "yaml").stdout)
        return doc["info"]["status"], int(doc["version"])


def _values_args(values: tuple[Path, ...], sets: tuple[str, ...]) -> list[str]:
    args: list[str] = []
    for path in values:
        args += ["-f", str(path)]
    for item in sets:
        args += ["--set", item]
    return args


def manifest_objects(text: str, namespace: str) -> list[ObjectRef]:
    """Every object of a rendered manifest (namespaced ones in ``namespace`` unless they name one)."""
    refs = []
    for doc in yaml.safe_load_all(text):
        if not doc:
            continue
        meta = doc.get("metadata") or {}
        annotations = meta.get("annotations") or {}
        refs.append(
            ObjectRef(
                kind=doc["kind"],
                api_version=doc["apiVersion"],
                name=meta["name"],
                namespace=meta.get("namespace") or namespace,
                keep=annotations.get(KEEP_ANNOTATION) == "keep",
            )
        )
    return refs


def existing(cluster: Cluster, refs: list[ObjectRef]) -> list[ObjectRef]:
    """Those of ``refs`` the API server has (one `kubectl get` per namespace)."""
    found: list[ObjectRef] = []
    by_namespace: dict[str | None, list[ObjectRef]] = {}
    for ref in refs:
        by_namespace.setdefault(ref.namespace, []).append(ref)
    for namespace, group in by_namespace.items():
        names = [f"{ref.resource}/{ref.name}" for ref in group]
        scope = ["-n", namespace] if namespace else []
        out = cluster.kubectl("get", *names, *scope, "--ignore-not-found", "-o", "name").stdout
        present = {line.strip() for line in out.splitlines() if line.strip()}
        found += [ref for ref in group if f"{ref.resource.lower()}/{ref.name}" in present]
    return found


class PortLocks(Protocol):
    """Mutual exclusion per fixed nodePort (tests running releases side by side provide one)."""

    def holding(self, keys: Iterator[int] | set[int]) -> contextlib.AbstractContextManager[None]: ...


@contextlib.contextmanager
def place(
    cluster: Cluster, documents: list[dict], namespace: str, ports: PortLocks | None = None
) -> Iterator[None]:
    """Ready a release's ground: nodes carrying the labels its Pods require (added once, kept), the
    claims its Pods mount but do not create (in ``namespace``, created here), and, while the block runs,
    the fixed nodePorts its Services claim (so that two releases never race for one: the API server
    would refuse the second)."""
    for name, labels in nodes_wanted(documents).items():
        cluster.add_node(name, labels)
    claims = claims_wanted(documents)
    if claims:
        cluster.apply(
            [namespace_object(namespace), *(claim_object(name, namespace) for name in sorted(claims))]
        )
    held = ports.holding(node_ports(documents)) if ports is not None else contextlib.nullcontext()
    with held:
        yield


def namespace_object(name: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def claim_object(name: str, namespace: str) -> dict[str, object]:
    """A claim of the user's own (the default StorageClass provisions it)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "10Gi"}}},
    }


def wait_workloads_ready(cluster: Cluster, namespace: str, timeout: float = 90.0) -> None:
    """Every Deployment of ``namespace`` Available with all its replicas, every Pod Running and Ready.

    Deployments first: their Pods may not exist yet when this is called; `kubectl wait` on Pods would
    find none and return at once. A Deployment counts once its controller has seen its latest spec
    (``observedGeneration``; right after an upgrade or a rollback the status still describes the previous
    one) and its rollout is over: every replica updated and ready, and no Pod of an older template left.
    """
    deadline = time.monotonic() + timeout
    while True:
        doc = cluster.get("deployments", "-n", namespace)
        pending = [
            d["metadata"]["name"]
            for d in doc["items"]  # type: ignore[union-attr]
            if not _rolled_out(d)
        ]
        pods = cluster.get("pods", "-n", namespace)["items"]
        not_ready = [
            p["metadata"]["name"]
            for p in pods  # type: ignore[union-attr]
            if p["metadata"].get("deletionTimestamp") is None and not pod_ready(p)
        ]
        if not pending and not not_ready:
            return
        if time.monotonic() > deadline:
            events = cluster.kubectl("get", "events", "-n", namespace, "--sort-by=.lastTimestamp").stdout
            raise ClusterError(
                f"in {namespace}: Deployments not ready {pending}, Pods not Ready {not_ready}\n"
                + "\n".join(events.splitlines()[-15:])
            )
        time.sleep(0.5)


def _rolled_out(deployment: dict) -> bool:
    wanted = deployment["spec"].get("replicas") or 0
    status = deployment.get("status") or {}
    return (
        (status.get("observedGeneration") or 0) >= deployment["metadata"].get("generation", 0)
        and (status.get("updatedReplicas") or 0) == wanted
        and (status.get("readyReplicas") or 0) == wanted
        and (status.get("replicas") or 0) == wanted
    )


def pod_ready(pod: dict) -> bool:
    status = pod.get("status") or {}
    if status.get("phase") != "Running":
        return False
    return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or ())
