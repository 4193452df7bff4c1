"""Start and stop the test cluster: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok.

Every process listens on loopback only, on ports from below the ephemeral range, and runs in its own
process group (stopped together, and ended if this process dies). What the cluster has once
:meth:`Cluster.start` returns:
- RBAC enforced, ServiceAccount tokens signed (the TokenRequest API works), an admin client certificate;
- Nodes that kwok keeps Ready, advertising CPU, memory, `nvidia.com/gpu` and `amd.com/gpu`;
- storage: a default StorageClass served by the controller manager's own host-path provisioner (a
  real, test-only provisioner of Kubernetes), and pre-created PersistentVolumes without a class for
  claims that ask for none (`storageClassName: ""`);
- the RuntimeClass a GPU node's operator installs (`nvidia`);
- the CRDs of ``crds_dir`` (KEDA, Prometheus operator, Gateway API, Inference Extension) established.

What cannot run here and is not pretended: kubelet and container runtime (kwok reports Pods Running and
Ready without running anything), kube-proxy and CNI (Service ClusterIPs route nowhere; Pod IPs are loopback
addresses, which EndpointSlices refuse, so Services have no endpoints).
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from vllm_stack_dev.cluster.kubeconfig import write_certificate_kubeconfig, write_token_kubeconfig
from vllm_stack_dev.cluster.pki import ClusterPki, make_pki
from vllm_stack_dev.gotools import control_plane_binaries, kwok_stages_dir
from vllm_stack_dev.paths import repo_root
from vllm_stack_dev.testbed.engines import port_for_later, spawn_logged, stop_group
from vllm_stack_dev.waiting import wait_until

LOOPBACK = "127.0.0.1"
SERVICE_CIDR = "10.96.0.0/16"
#: The `kubernetes` Service's ClusterIP, in the API server's certificate: a Pod's in-cluster client on a
#: real node (vllm_stack_dev.cluster.node) connects to it and checks the name.
KUBERNETES_SERVICE_IP = "10.96.0.1"
#: Pod IPs: loopback addresses, so that a test can start a real engine at a Pod's IP and port.
POD_CIDR = "127.16.0.0/12"
NODE_LABEL = "vllm-stack.dev/kwok-node"
#: What each fake node advertises: enough for the chart's examples and production-stack's files.
#: (production-stack's GKE example asks 8 GPUs and 1024Gi for one Pod; an upgrade surges a second one.)
NODE_CAPACITY = {
    "cpu": "256",
    "memory": "4Ti",
    "ephemeral-storage": "8Ti",
    "pods": "110",
    "nvidia.com/gpu": "16",
    "amd.com/gpu": "16",
}
DEFAULT_STORAGE_CLASS = "standard"
#: RuntimeClasses a GPU cluster has (the NVIDIA GPU operator installs `nvidia`); Pods naming a missing one
#: are refused by the RuntimeClass admission plugin.
RUNTIME_CLASSES = ("nvidia",)
CLASSLESS_VOLUMES = 24
START_TIMEOUT = 120.0
NODE_LEASE_SECONDS = 40  # a kubelet's default


def default_crds_dir() -> Path:
    return repo_root().parent / "shared" / "crds"


@dataclass(frozen=True)
class ClusterOptions:
    """How the cluster is made. ``hpa_sync_period`` and ``watch_cache`` exist for the tests that need an
    HPA reacting in seconds, or watches that expire."""

    workdir: Path
    nodes: int = 3
    crds_dir: Path | None = field(default_factory=default_crds_dir)
    hpa_sync_period: str = "15s"
    watch_cache: bool = True
    extra_api_server_args: tuple[str, ...] = ()


def tool_env() -> dict[str, str]:
    """The environment for a tool (kubectl, Helm) started from a worker thread, passed explicitly.

    Without ``env``, the child of a vfork execs with the C library's ``environ``, which another thread
    may be changing at that moment: pytest sets and removes PYTEST_CURRENT_TEST in the main thread for
    every test while the cluster tier's cases run on a thread pool, and ``setenv`` may move the array
    the exec is reading. The exec then fails with EFAULT (seen in CI as `OSError: [Errno 14] Bad
    address` for Helm; 354 in 20 s in a four-thread reproduction, none with an explicit environment).
    Copying ``os.environ`` iterates it in Python, so the main thread can remove a key between the listing
    and the read (seen in CI: ``KeyError: 'PYTEST_CURRENT_TEST'``) or add one (RuntimeError): the copy is
    then made again."""
    while True:
        try:
            return dict(os.environ)
        except (KeyError, RuntimeError):  # changed by another thread while copied
            continue


class ClusterError(RuntimeError):
    """A component did not start or a set-up step failed; the message names it and its log."""


@dataclass
class _Component:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


def probe(url: str, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=3, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except OSError:
        return 0, b""


class Cluster:
    """A running control plane (a context manager: stopped on exit, every process group with it)."""

    def __init__(self, options: ClusterOptions) -> None:
        self.options = options
        self.workdir = options.workdir
        self.logs = self.workdir / "logs"
        self.binaries = control_plane_binaries()
        self.components: list[_Component] = []
        self.etcd_port = port_for_later()
        self.etcd_peer_port = port_for_later()
        self.api_port = port_for_later()
        self.server = f"https://{LOOPBACK}:{self.api_port}"
        self.pki: ClusterPki | None = None
        self.kubeconfig = self.workdir / "kubeconfig"

    # ---- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, say: Callable[[str], None] = lambda _: None) -> None:
        """Start every component in order and set the cluster up; ClusterError (and all stopped) if not."""
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            self.pki = make_pki(self.workdir / "pki", (LOOPBACK, KUBERNETES_SERVICE_IP))
            self._write_kubeconfigs()
            self._start_etcd()
            say(f"etcd on {LOOPBACK}:{self.etcd_port}")
            self._start_api_server()
            say(f"kube-apiserver on {self.server}")
            self._start_controller_manager()
            self._start_scheduler()
            self._start_kwok()
            say("kube-controller-manager, kube-scheduler and kwok started")
            self._set_up()
            say(f"{self.options.nodes} nodes Ready, storage and CRDs in place")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the components, last started first (kwok and the controllers before the API server)."""
        for component in reversed(self.components):
            stop_group(component.process, timeout=10)
        self.components.clear()

    def restart_api_server(self) -> None:
        """Stop kube-apiserver (SIGTERM, as an upgrade or a node drain does) and start it again on the
        same port with the same flags; returns once it is ready. Every client's watch ends with it; the
        controllers, the scheduler and kwok reconnect by themselves. The previous log is kept as `.1`."""
        index = next(i for i, c in enumerate(self.components) if c.name == "kube-apiserver")
        old = self.components.pop(index)
        stop_group(old.process, timeout=20)
        old.log.replace(old.log.with_suffix(".log.1"))
        self._start_api_server()
        self.components.insert(index, self.components.pop())  # stop() goes in reverse start order

    def exited(self) -> str | None:
        """The name of a component that has exited, if any (the cluster is then broken)."""
        for component in self.components:
            if component.process.poll() is not None:
                return (
                    f"{component.name} exited with code {component.process.returncode} (log {component.log})"
                )
        return None

    # ---- the components ----------------------------------------------------------------------------
    def _spawn(self, name: str, command: Sequence[str]) -> _Component:
        log = self.logs / f"{name}.log"
        component = _Component(name, spawn_logged(command, log, env=None, cwd=self.workdir), log)
        self.components.append(component)
        return component

    def _wait(self, component: _Component, ready: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
        try:
            wait_until(ready, timeout, component.process, component.name)
        except RuntimeError as error:
            tail = "\n".join(component.log.read_text(errors="replace").splitlines()[-30:])
            raise ClusterError(f"{error}; last lines of {component.log}:\n{tail}") from None

    def _write_kubeconfigs(self) -> None:
        assert self.pki is not None
        for component, credential in self.pki.clients.items():
            path = self.kubeconfig if component == "admin" else self.workdir / f"{component}.kubeconfig"
            write_certificate_kubeconfig(path, self.server, self.pki.ca.cert, credential)

    def _start_etcd(self) -> None:
        client = f"http://{LOOPBACK}:{self.etcd_port}"
        peer = f"http://{LOOPBACK}:{self.etcd_peer_port}"
        etcd = self._spawn(
            "etcd",
            [
                str(self.binaries["etcd"]),
                "--name=test",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                "--unsafe-no-fsync",  # a test cluster's data need not survive a power cut
                "--log-level=warn",
            ],
        )
        self._wait(etcd, lambda: probe(client + "/health")[0] == 200)

    def _client_context(self) -> ssl.SSLContext:
        assert self.pki is not None
        context = ssl.create_default_context(cafile=str(self.pki.ca.cert))
        admin = self.pki.clients["admin"]
        context.load_cert_chain(str(admin.cert), str(admin.key))
        return context

    def _start_api_server(self) -> None:
        assert self.pki is not None
        pki = self.pki
        api = self._spawn(
            "kube-apiserver",
            [
                str(self.binaries["kube-apiserver"]),
                f"--etcd-servers=http://{LOOPBACK}:{self.etcd_port}",
                f"--bind-address={LOOPBACK}",
                f"--advertise-address={LOOPBACK}",
                f"--secure-port={self.api_port}",
                f"--tls-cert-file={pki.api_server.cert}",
                f"--tls-private-key-file={pki.api_server.key}",
                f"--client-ca-file={pki.ca.cert}",
                "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.service_account_public}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                # The `kubernetes` Service's endpoints would be the loopback advertise address, which
                # Endpoints validation refuses: the reconciler would fail for ever.
                "--endpoint-reconciler-type=none",
                # Aggregated APIs (KEDA's metrics adapter) are reached through the front proxy.
                f"--requestheader-client-ca-file={pki.front_proxy_ca.cert}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki.front_proxy_client.cert}",
                f"--proxy-client-key-file={pki.front_proxy_client.key}",
                f"--watch-cache={'true' if self.options.watch_cache else 'false'}",
                "--profiling=false",
                *self.options.extra_api_server_args,
            ],
        )
        context = self._client_context()
        self._wait(api, lambda: probe(self.server + "/readyz", context) == (200, b"ok"))

    def _component_auth_args(self, name: str) -> list[str]:
        kubeconfig = self.workdir / f"{name}.kubeconfig"
        return [
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            f"--bind-address={LOOPBACK}",
            f"--cert-dir={self.workdir / name}",
            "--leader-elect=false",
        ]

    def _start_controller_manager(self) -> None:
        assert self.pki is not None
        port = port_for_later()
        manager = self._spawn(
            "kube-controller-manager",
            [
                str(self.binaries["kube-controller-manager"]),
                *self._component_auth_args("controller-manager"),
                f"--secure-port={port}",
                f"--service-account-private-key-file={self.pki.service_account_key}",
                f"--root-ca-file={self.pki.ca.cert}",
                "--use-service-account-credentials=true",
                f"--cluster-signing-cert-file={self.pki.ca.cert}",
                f"--cluster-signing-key-file={self.pki.ca.key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # Kubernetes' own test-only dynamic provisioner: claims of the default class get a
                # hostPath volume under /tmp, as on a single-node development cluster.
                "--enable-hostpath-provisioner=true",
                f"--horizontal-pod-autoscaler-sync-period={self.options.hpa_sync_period}",
            ],
        )
        self._wait(manager, lambda: probe(f"https://{LOOPBACK}:{port}/healthz", unverified_tls())[0] == 200)

    def _start_scheduler(self) -> None:
        port = port_for_later()
        scheduler = self._spawn(
            "kube-scheduler",
            [
                str(self.binaries["kube-scheduler"]),
                *self._component_auth_args("scheduler"),
                f"--secure-port={port}",
            ],
        )
        self._wait(scheduler, lambda: probe(f"https://{LOOPBACK}:{port}/healthz", unverified_tls())[0] == 200)

    def _start_kwok(self) -> None:
        stages = kwok_stages_dir()
        # Nodes are made Ready, then kept so by a Lease renewed as a kubelet renews it (and their status
        # every ten minutes): without it the node lifecycle controller marks them NotReady after 40 s
        # and evicts their Pods. Pods go straight to Running and Ready.
        stage_sets = ("node-fast", "node-heartbeat-with-lease", "pod-fast")
        configs = [config for name in stage_sets for config in sorted((stages / name).glob("*.yaml"))]
        self._spawn(
            "kwok",
            [
                str(self.binaries["kwok"]),
                f"--kubeconfig={self.workdir / 'kwok.kubeconfig'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-label-selector={NODE_LABEL}",
                f"--cidr={POD_CIDR}",
                f"--node-ip={LOOPBACK}",
                f"--node-lease-duration-seconds={NODE_LEASE_SECONDS}",
                "--server-address=",
                *[f"--config={config}" for config in configs],
            ],
        )

    # ---- set-up ------------------------------------------------------------------------------------
    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run the cluster's kubectl as the admin; CalledProcessError (with its stderr) when ``check``."""
        result = subprocess.run(
            [str(self.binaries["kubectl"]), f"--kubeconfig={self.kubeconfig}", *args],
            input=stdin, capture_output=True, text=True, timeout=120, env=tool_env(),
        )  # fmt: skip
        if check and result.returncode != 0:
            raise ClusterError(
                f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}"
            )
        return result

    def apply(self, objects: Sequence[dict[str, object]]) -> None:
        """Server-side apply of ``objects`` as the admin."""
        self.kubectl("apply", "--server-side", "--field-manager=vllm-stack-testbed", "-f", "-",
                     stdin=yaml.safe_dump_all(objects))  # fmt: skip

    def get(self, *args: str) -> dict[str, object]:
        """`kubectl get ... -o json` as a document."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def _set_up(self) -> None:
        self._wait_for_default_namespace()
        self.apply([node_object(f"kwok-node-{i}") for i in range(self.options.nodes)])
        self.apply(storage_objects(self.workdir / "volumes"))
        self.apply([runtime_class(name) for name in RUNTIME_CLASSES])
        crds = self.options.crds_dir
        if crds is not None:
            if not crds.is_dir():
                raise ClusterError(
                    f"CRD folder {crds} missing (../shared/crds is test data beside the checkout)"
                )
            for path in sorted(crds.glob("*.yaml")):
                self.kubectl("apply", "--server-side", "-f", str(path))
            self.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")
        self.kubectl("wait", "--for=condition=Ready", "--timeout=60s", "node", "-l", NODE_LABEL)

    def add_node(self, name: str, labels: Mapping[str, str]) -> None:
        """One more kwok node carrying ``labels`` (a GPU product, a host name a values file pins), Ready."""
        self.apply([node_object(name, labels)])
        self.kubectl("wait", "--for=condition=Ready", "--timeout=60s", "node", name)

    def _wait_for_default_namespace(self) -> None:
        """The default ServiceAccount appears once the controller manager's token controller runs."""
        deadline = time.monotonic() + START_TIMEOUT
        while self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode != 0:
            if time.monotonic() > deadline:
                raise ClusterError("the default ServiceAccount never appeared (kube-controller-manager log)")
            time.sleep(0.3)

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path, duration: str = "2h") -> Path:
        """A kubeconfig for ServiceAccount ``namespace/name``: a token from the TokenRequest API."""
        assert self.pki is not None
        token = self.service_account_token(namespace, name, duration)
        return write_token_kubeconfig(path, self.server, self.pki.ca.cert, token, namespace)

    def service_account_token(self, namespace: str, name: str, duration: str = "2h") -> str:
        """A token for ServiceAccount ``namespace/name`` from the TokenRequest API (what a kubelet mounts)."""
        return self.kubectl("create", "token", name, "-n", namespace, f"--duration={duration}").stdout.strip()


def unverified_tls() -> ssl.SSLContext:
    """For the components' own /healthz on loopback, served with a certificate they made themselves."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def node_object(name: str, labels: Mapping[str, str] | None = None) -> dict[str, object]:
    """A Node kwok manages (by label), Ready once kwok's node stage has run; ``labels`` added to its own."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                NODE_LABEL: "true",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                **(labels or {}),
            },  # fmt: skip
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "kwok.x-k8s.io/node": "fake"},
        },
        "status": {"capacity": NODE_CAPACITY, "allocatable": NODE_CAPACITY},
    }


def runtime_class(name: str) -> dict[str, object]:
    return {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": name},
        "handler": name,
    }


def storage_objects(volumes: Path) -> list[dict[str, object]]:
    """The default StorageClass (host-path provisioner) and classless volumes for class-less claims."""
    objects: list[dict[str, object]] = [
        {
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": {
                "name": DEFAULT_STORAGE_CLASS,
                "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
            },
            "provisioner": "kubernetes.io/host-path",
            "reclaimPolicy": "Delete",
            "volumeBindingMode": "Immediate",
        }
    ]
    for i in range(CLASSLESS_VOLUMES):
        path = volumes / f"pv-{i}"
        path.mkdir(parents=True, exist_ok=True)
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": f"classless-{i}", "labels": {"vllm-stack.dev/volume": "classless"}},
                "spec": {
                    "capacity": {"storage": "2Ti"},
                    "accessModes": ["ReadWriteOnce", "ReadWriteMany", "ReadOnlyMany"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "hostPath": {"path": str(path)},
                },
            }
        )
    return objects


@contextlib.contextmanager
def running_cluster(
    options: ClusterOptions, say: Callable[[str], None] = lambda _: None
) -> Iterator[Cluster]:
    """A started cluster for the ``with`` block; stopped afterwards whatever happened."""
    cluster = Cluster(options)
    cluster.start(say)
    try:
        yield cluster
    finally:
        cluster.stop()
