"""KEDA's operator and metrics adapter, built from its Go module, running against a test cluster.

What KEDA's own Helm chart deploys, as local processes on loopback (no container runtime here):
- its CRDs (from the module's `config/crd/bases`);
- the operator (`keda`): reads ScaledObjects, creates and owns their HorizontalPodAutoscalers, scales a
  Deployment between zero and one itself (activation), and serves the scalers' metric values over gRPC;
- the metrics adapter (`keda-adapter`): an aggregated API server for `external.metrics.k8s.io`, asking the
  operator over gRPC (mutual TLS, one CA of its own) for each value the HPA controller requests;
- the APIService `v1beta1.external.metrics.k8s.io`, pointing at a Service of type ExternalName `localhost`
  so that the API server's aggregator reaches the adapter's loopback port (the serving certificate names
  the Service's DNS name, which the aggregator checks against the APIService's `caBundle`).

Both run with the cluster admin's kubeconfig, not KEDA's ServiceAccount and ClusterRoles (this project's
RBAC is under test here, not KEDA's). The HPA controller is the controller manager's own.
"""

from __future__ import annotations

import base64
import subprocess
import time
from pathlib import Path

from vllm_stack_dev.cluster.control_plane import (
    LOOPBACK,
    Cluster,
    ClusterError,
    probe,
    tool_env,
    unverified_tls,
)
from vllm_stack_dev.cluster.pki import make_tls_bundle
from vllm_stack_dev.gotools import KEDA
from vllm_stack_dev.testbed.engines import port_for_later, spawn_logged, stop_group
from vllm_stack_dev.waiting import wait_until

NAMESPACE = "keda"
ADAPTER_SERVICE = "keda-metrics-apiserver"
API_SERVICE = "v1beta1.external.metrics.k8s.io"
START_TIMEOUT = 120.0


def keda_binaries() -> dict[str, Path]:
    return {name: KEDA.binary(name) for name, _ in KEDA.binaries}


def keda_crds_dir() -> Path:
    return KEDA.folder / "crds"


class Keda:
    """The operator and the adapter for one cluster; :meth:`start` returns once the external metrics API
    is Available, :meth:`stop` ends both (a context manager too)."""

    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.operator_log = self.logs / "keda-operator.log"
        self.adapter_log = self.logs / "keda-adapter.log"
        self._processes: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Keda:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        missing = [str(path) for path in keda_binaries().values() if not path.is_file()]
        if missing:
            raise ClusterError(f"KEDA binaries missing ({', '.join(missing)}): run `make install`")
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            self._install_crds()
            certs = make_tls_bundle(
                self.workdir / "certs",
                names=(f"{ADAPTER_SERVICE}.{NAMESPACE}.svc", "localhost", f"keda-operator.{NAMESPACE}.svc"),
                ips=(LOOPBACK,),
            )
            grpc_port = self._start_operator(certs)
            adapter_port = self._start_adapter(certs, grpc_port)
            self._register(certs, adapter_port)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Unregister the external metrics API (left behind, it would point at a stopped adapter and make
        discovery of the API group fail for every client of the cluster), then stop both processes."""
        self.cluster.kubectl("delete", "apiservice", API_SERVICE, "--ignore-not-found", "--wait=false",
                             check=False)  # fmt: skip
        for process in reversed(self._processes):
            stop_group(process, timeout=10)
        self._processes.clear()

    def _install_crds(self) -> None:
        for path in sorted(keda_crds_dir().glob("*.yaml")):
            # The CRD of ScaledObject may be there already (../shared/crds); KEDA's own version wins.
            self.cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(path))
        self.cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        self.cluster.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}])

    def _env(self) -> dict[str, str]:
        return {
            **tool_env(),
            "KUBECONFIG": str(self.cluster.kubeconfig),
            "WATCH_NAMESPACE": "",  # every namespace
            "POD_NAMESPACE": NAMESPACE,
            "KEDA_CLUSTER_OBJECT_NAMESPACE": NAMESPACE,
        }

    def _start_operator(self, certs: Path) -> int:
        health, metrics, grpc_port = port_for_later(), port_for_later(), port_for_later()
        process = spawn_logged(
            [
                str(KEDA.binary("keda")),
                f"--health-probe-bind-address={LOOPBACK}:{health}",
                f"--metrics-bind-address={LOOPBACK}:{metrics}",
                f"--metrics-service-bind-address={LOOPBACK}:{grpc_port}",
                f"--cert-dir={certs}",
                f"--ca-dir={certs}",
                "--enable-cert-rotation=false",  # the certificates above, not a Secret it would create
                "--enable-webhook-patching=false",
                "--enable-apiservice-patching=false",
                "--leader-elect=false",
                "--zap-log-level=info",
                "--zap-encoder=console",
            ],
            self.operator_log,
            self._env(),
            cwd=self.workdir,
        )
        self._processes.append(process)
        wait_until(lambda: probe(f"http://{LOOPBACK}:{health}/readyz")[0] == 200, START_TIMEOUT, process,
                   f"keda operator (log {self.operator_log})")  # fmt: skip
        return grpc_port

    def _start_adapter(self, certs: Path, grpc_port: int) -> int:
        port = port_for_later()
        process = spawn_logged(
            [
                str(KEDA.binary("keda-adapter")),
                f"--secure-port={port}",
                f"--bind-address={LOOPBACK}",
                f"--port={port_for_later()}",  # its own metrics
                f"--cert-dir={certs}",
                f"--tls-cert-file={certs / 'tls.crt'}",
                f"--tls-private-key-file={certs / 'tls.key'}",
                f"--metrics-service-address={LOOPBACK}:{grpc_port}",
                f"--lister-kubeconfig={self.cluster.kubeconfig}",  # the adapter reads ScaledObjects with it
                f"--authentication-kubeconfig={self.cluster.kubeconfig}",
                f"--authorization-kubeconfig={self.cluster.kubeconfig}",
                "--zap-log-level=info",
            ],
            self.adapter_log,
            self._env(),
            cwd=self.workdir,
        )
        self._processes.append(process)
        wait_until(lambda: probe(f"https://{LOOPBACK}:{port}/readyz", unverified_tls())[0] == 200, START_TIMEOUT, process,
                   f"keda metrics adapter (log {self.adapter_log})")  # fmt: skip
        return port

    def _register(self, certs: Path, port: int) -> None:
        """The Service and APIService that make the API server proxy external metrics to the adapter."""
        ca_bundle = base64.b64encode((certs / "ca.crt").read_bytes()).decode()
        self.cluster.apply(
            [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE},
                    "spec": {
                        "type": "ExternalName",
                        "externalName": "localhost",
                        "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
                    },
                },  # fmt: skip
                {
                    "apiVersion": "apiregistration.k8s.io/v1",
                    "kind": "APIService",
                    "metadata": {"name": API_SERVICE},
                    "spec": {
                        "group": "external.metrics.k8s.io",
                        "version": "v1beta1",
                        "service": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE, "port": port},
                        "caBundle": ca_bundle,
                        "groupPriorityMinimum": 100,
                        "versionPriority": 100,
                    },
                },
            ]
        )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            result = self.cluster.kubectl(
                "wait", "--for=condition=Available", "--timeout=10s", "apiservice", API_SERVICE, check=False
            )
            if result.returncode == 0:
                return
            if time.monotonic() > deadline:
                status = self.cluster.kubectl(
                    "get", "apiservice", API_SERVICE, "-o", "yaml", check=False
                ).stdout
                raise ClusterError(f"{API_SERVICE} never became Available:\n{status[-1500:]}")
