"""What the test cluster's API server enforces and reports, checked as a client sees it.

The other cluster tests rely on these without asking: the version the binaries were stamped with (so
`/version` is not `v0.0.0-master`), RBAC with ServiceAccount tokens the API server itself signed (a
token from the TokenRequest API is accepted, and allows exactly what a Role binds to it), and Pod IPs on
loopback (the only addresses test traffic may go to here).
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from vllm_stack_dev.cluster.control_plane import Cluster, tool_env
from vllm_stack_dev.gotools import KUBERNETES

pytestmark = pytest.mark.cluster

NAMESPACE = "control-plane-checks"


def test_version_is_the_stamped_release(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("get", "--raw", "/version").stdout)
    assert version["gitVersion"] == KUBERNETES.version, version
    assert (version["major"], version["minor"]) == tuple(KUBERNETES.version.lstrip("v").split(".")[:2])


def _eventually(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.3)


def _as(cluster: Cluster, kubeconfig: Path, *args: str) -> tuple[int, str]:
    """kubectl with another identity's kubeconfig (not the admin's): exit code and what it printed."""
    result = subprocess.run(
        [str(cluster.binaries["kubectl"]), f"--kubeconfig={kubeconfig}", *args],
        capture_output=True, text=True, timeout=60, env=tool_env(),
    )  # fmt: skip
    return result.returncode, result.stdout + result.stderr


def test_rbac_allows_a_service_account_exactly_what_its_role_binds(cluster: Cluster, tmp_path: Path) -> None:
    cluster.kubectl("create", "namespace", NAMESPACE)
    try:
        cluster.kubectl("create", "serviceaccount", "reader", "-n", NAMESPACE)
        kubeconfig = cluster.service_account_kubeconfig(NAMESPACE, "reader", tmp_path / "reader")
        rc, out = _as(cluster, kubeconfig, "get", "pods", "-n", NAMESPACE)
        assert rc != 0 and "forbidden" in out.lower() and "system:serviceaccount:" in out, out

        cluster.kubectl("create", "role", "pod-reader", "--verb=get,list", "--resource=pods", "-n", NAMESPACE)
        cluster.kubectl(
            "create", "rolebinding", "reader", "--role=pod-reader",
            f"--serviceaccount={NAMESPACE}:reader", "-n", NAMESPACE,
        )  # fmt: skip
        # the authorizer's informers see the binding a moment after it is created
        _eventually(
            lambda: _as(cluster, kubeconfig, "get", "pods", "-n", NAMESPACE)[0] == 0, 10.0, "the binding"
        )
        rc, out = _as(cluster, kubeconfig, "get", "secrets", "-n", NAMESPACE)
        assert rc != 0 and "forbidden" in out.lower(), out  # a verb on a resource the Role does not name
        rc, out = _as(cluster, kubeconfig, "get", "pods", "-n", "default")
        assert rc != 0 and "forbidden" in out.lower(), out  # another namespace

        forged = tmp_path / "forged"
        forged.write_text(kubeconfig.read_text().replace("token: ", "token: x", 1))
        rc, out = _as(cluster, forged, "get", "pods", "-n", NAMESPACE)
        assert rc != 0 and "unauthorized" in out.lower(), out  # a token it did not sign
    finally:
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def test_pods_get_loopback_ips(cluster: Cluster) -> None:
    namespace = NAMESPACE + "-pods"
    cluster.kubectl("create", "namespace", namespace)
    try:
        cluster.kubectl(
            "create", "deployment", "d", "--image=example.invalid/none", "--replicas=2", "-n", namespace
        )

        def ips() -> list[str]:
            pods = cluster.get("pods", "-n", namespace)["items"]
            found = [p.get("status", {}).get("podIP") for p in pods]  # type: ignore[union-attr]
            return [ip for ip in found if ip] if len(found) == 2 and all(found) else []

        _eventually(lambda: bool(ips()), 60.0, "two Pods with IPs")
        for ip in ips():
            assert ipaddress.ip_address(ip) in ipaddress.ip_network("127.0.0.0/8"), ip
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
