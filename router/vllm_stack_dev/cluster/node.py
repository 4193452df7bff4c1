"""A real node for the test cluster: a kubelet and containerd (with runc and CNI) in namespaces of their own.

The node tier (marker `node`; `make test` runs its reduced set, `make test-node` the whole): the kubelet,
kube-proxy and CoreDNS come from `make install` (vllm_stack_dev.gotools.NODE_TOOLS), containerd from Debian's
package.

Everything the node starts lives in one PID, mount and network namespace made by `unshare` (the "holder";
its PID 1 is Kubernetes' pause program, which reaps orphans such as containerd's shims). In it:
- tmpfs over /run, /var/log and /var/lib/cni (containerd's state and shim sockets, the Pods' network
  namespaces, the kubelet's container log links, CNI's cache): nothing written there reaches the host;
  every other path is the workdir's (containerd's root, the kubelet's root, CNI configuration and IPAM);
- a bridge carrying the node's IP (this kernel has no dummy driver) and CNI's `ptp` plugin (Debian's
  containernetworking-plugins) with the node's Pod CIDR: private addresses that exist only in the nodes'
  namespaces (no default route; the bridge's only ports are the links to other nodes' namespaces that
  vllm_stack_dev.cluster.node_network makes, with the routes to their Pod CIDRs);
- the local registry (`registry serve`, read-only over the images step's storage) on the namespace's
  loopback, containerd's mirror of `ghcr.io` (`certs.d/ghcr.io/hosts.toml`): the chart's image names pull
  the images `make install` pushed, and nothing else can be pulled;
- the API server, which listens on the host's loopback, reached through two relays and a Unix socket file
  (vllm_stack_dev.cluster.relay); the kubelet authenticates with a client certificate of the cluster CA
  (`system:node:<name>` in `system:nodes`, so the Node authorizer limits it to its own node and Pods);
  its own API takes client certificates and webhook-checked tokens;
- kube-proxy (iptables mode, the namespace's own tables), when start_kube_proxy() is called, with an
  endpoint of the `kubernetes` Service set to the node's relay, so that Pods' in-cluster clients reach the
  API server at 10.96.0.1:443 (which the API server's certificate names);
- CoreDNS, when start_dns() is called, behind the `kube-system/kube-dns` Service (10.96.0.10, the
  kubelet's `clusterDNS`): the cluster domain from the API server, nothing upstream.
containerd's CRI runs with `restrict_oom_score_adj`: root here lacks CAP_SYS_RESOURCE, so a sandbox's
OOM score of -998 failed runc's start ("can't get final child's PID from pipe").
The node's cgroups (kubelet `cgroupRoot`, cgroupfs driver, cgroup v1 as this machine has) are one subtree
of their own in each hierarchy, made at start and removed at stop.

Stopping: the kubelet and containerd by their PIDs (SIGTERM), then the holder's PID: the kernel ends every
process left in its PID namespace (containers, shims, the registry), and the mount and network namespaces
go with their last process (a link to another node with them); the node's EndpointSlices and Node object
are deleted. The holder also dies with the process that started it (PR_SET_PDEATHSIG SIGKILL, then
`unshare --kill-child`), and every node process but the host-side relay (which has its own
PR_SET_PDEATHSIG) is in its PID namespace, so a killed test leaves no process behind; only its empty
cgroup folders, which the next start removes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from vllm_stack_dev.cluster.control_plane import LOOPBACK, Cluster, ClusterError
from vllm_stack_dev.cluster.kubeconfig import write_certificate_kubeconfig
from vllm_stack_dev.cluster.pki import issue_signed_by
from vllm_stack_dev.gotools import KUBERNETES, REGISTRY, node_binaries
from vllm_stack_dev.paths import tools_dir
from vllm_stack_dev.testbed.engines import spawn_logged, stop_group

CLUSTER_DNS_IP = "10.96.0.10"  # the kube-dns Service's ClusterIP (kubelet `clusterDNS`)
CLUSTER_DOMAIN = "cluster.local"
NODE_CIDR = "10.88.0.0/24"  # the nodes' own addresses (a bridge in the node's namespace)
NODE_BRIDGE = "node0"  # that bridge's name in every node's namespace; its ports: the links to other nodes
POD_CIDR = "10.244.0.0/16"  # node i gets 10.244.i.0/24
API_PORT_IN_NODE = 6443  # the relay to the API server, on the node namespace's loopback
REGISTRY_PORT_IN_NODE = 5000
PAUSE_IMAGE = "localhost/vllm-stack/pause:" + KUBERNETES.version
START_TIMEOUT = 120.0
CGROUP_ROOT = Path("/sys/fs/cgroup")
SLICE_NODE_LABEL = "testbed.vllm-stack.dev/node"  # on the EndpointSlices a node writes (removed at its stop)
_PR_SET_PDEATHSIG = 1


class NodeError(ClusterError):
    """A node component did not start; the message names it and the tail of its log."""


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _run(command: Sequence[str], timeout: float = 120) -> str:
    result = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout)
    if result.returncode != 0:
        raise NodeError(
            f"`{' '.join(command)}` failed ({result.returncode}): {(result.stdout + result.stderr).strip()[-2000:]}"
        )
    return result.stdout


# ---- the pause image (containerd's sandbox image) -------------------------------------------------------


def pause_archive() -> Path:
    """An image archive of Kubernetes' pause program, compiled from the k8s.io/kubernetes module's own
    `build/pause/linux/pause.c` (static, gcc) and wrapped by `podman import`; made once, kept in `.tools`.
    The same binary is the node holder's PID 1."""
    folder = tools_dir() / "node-tier" / f"pause-{KUBERNETES.version}"
    archive = folder / "pause.tar"
    if archive.is_file() and (folder / "pause").is_file():
        return archive
    from vllm_stack_dev.images import podman

    folder.mkdir(parents=True, exist_ok=True)
    module = json.loads(
        _run(["go", "mod", "download", "-json", f"{KUBERNETES.module}@{KUBERNETES.version}"], timeout=600)
    )["Dir"]
    source = Path(module) / "build" / "pause" / "linux" / "pause.c"
    version = KUBERNETES.version
    _run(["gcc", "-Os", "-Wall", "-Werror", "-static", f'-DVERSION="{version}"', "-o",
          str(folder / "pause"), str(source)])  # fmt: skip
    _run(["strip", str(folder / "pause")])
    rootfs = folder / "rootfs.tar"
    _run(["tar", "-C", str(folder), "--owner=0", "--group=0", "-cf", str(rootfs), "pause"])
    _run([*podman(), "import", "--change", 'ENTRYPOINT ["/pause"]', str(rootfs), PAUSE_IMAGE])
    partial = folder / "pause.tar.partial"
    partial.unlink(missing_ok=True)
    _run([*podman(), "save", "--format", "docker-archive", "-o", str(partial), PAUSE_IMAGE])
    partial.rename(archive)
    return archive


# ---- cgroups -------------------------------------------------------------------------------------------


def _hierarchies() -> list[Path]:
    """The mounted cgroup hierarchies (v1 controllers and the unified one), as folders."""
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, mount_point, fs_type, *_ = line.split()
        if fs_type in ("cgroup", "cgroup2") and mount_point.startswith(str(CGROUP_ROOT)):
            found.append(Path(mount_point))
    return found


def make_cgroup_root(name: str) -> list[Path]:
    """`/<name>` in every hierarchy (cpuset's CPUs and memory nodes copied from the root's)."""
    made = []
    for hierarchy in _hierarchies():
        folder = hierarchy / name
        folder.mkdir(exist_ok=True)
        made.append(folder)
        for setting in ("cpuset.cpus", "cpuset.mems"):
            if (folder / setting).exists() and not (folder / setting).read_text().strip():
                (folder / setting).write_text((hierarchy / setting).read_text())
    return made


CGROUP_PREFIX = "vllm-stack-node-"


def cgroup_root_name() -> str:
    """`vllm-stack-node-<this process's PID>-<random>`: a subtree whose creator has died is stale."""
    return f"{CGROUP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_stale_cgroup_roots() -> None:
    """The empty subtrees a killed test process left (its namespaces, and so its processes, died with it;
    the folders stay): removed bottom-up, only where the PID in the name no longer runs."""
    for hierarchy in _hierarchies():
        for folder in hierarchy.glob(CGROUP_PREFIX + "*"):
            pid = folder.name.removeprefix(CGROUP_PREFIX).partition("-")[0]
            if not pid.isdigit() or Path(f"/proc/{pid}").exists():
                continue
            for cgroup in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                with contextlib.suppress(OSError):
                    cgroup.rmdir()
            with contextlib.suppress(OSError):
                folder.rmdir()


def remove_cgroup_root(folders: list[Path], timeout: float = 20.0) -> list[str]:
    """Remove each subtree, deepest first; a process still in one is killed by its PID. The folders that
    could not be removed are returned (named in the test's failure)."""
    left = []
    deadline = time.monotonic() + timeout
    for folder in folders:
        while folder.exists():
            subtree = sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
            for cgroup in [*subtree, folder]:
                try:
                    cgroup.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    for pid in (cgroup / "cgroup.procs").read_text().split() if cgroup.exists() else []:
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except ProcessLookupError:
                            pass
            if folder.exists():
                if time.monotonic() > deadline:
                    left.append(str(folder))
                    break
                time.sleep(0.2)
    return left


def _killed_with_parent() -> None:
    """In the holder before exec: SIGKILL when the process that started it dies. Not SIGTERM (what
    spawn_logged asks): `unshare --fork` ignores SIGTERM while it waits for its child; killed, its
    `--kill-child` kills the namespace's init, and the kernel every process of the PID namespace."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        os._exit(121)


# ---- the node ------------------------------------------------------------------------------------------


@dataclass
class _Process:
    name: str
    process: subprocess.Popen[bytes]
    log: Path


class RealNode:
    """One node: start() joins it to ``cluster`` and waits for it Ready; stop() ends all it started."""

    def __init__(self, cluster: Cluster, workdir: Path, name: str = "node-0", index: int = 0) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.name = name
        network = ipaddress.ip_network(NODE_CIDR)
        self.ip = str(network.network_address + 2 + index)
        self.prefix = network.prefixlen
        self.pod_cidr = str(list(ipaddress.ip_network(POD_CIDR).subnets(new_prefix=24))[index])
        self.logs = workdir / "logs"
        self.binaries = node_binaries()
        self.cgroup_name = cgroup_root_name()
        self.cgroups: list[Path] = []
        self.holder: _Process | None = None
        self.init_pid = 0
        self.processes: list[_Process] = []
        # Unix socket paths are limited to 107 bytes: the relay's socket lives in a short folder of its own,
        # the kubelet's root (whose pods-api socket is deep in it) at /run/kubelet in the node's namespace.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="vllm-stack-node-"))
        self.api_socket = self.socket_dir / "api.sock"

    def __enter__(self) -> RealNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self, say: Callable[[str], None] = lambda _: None) -> None:
        missing = [name for name in ("kubelet", "kube-proxy") if not self.binaries[name].is_file()]
        if missing or not shutil.which("containerd"):
            raise NodeError(
                f"node tools missing ({', '.join(missing) or 'containerd'}): run "
                "`make install` (its control-plane and node steps)"
            )
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            archive = pause_archive()
            remove_stale_cgroup_roots()
            self.cgroups = make_cgroup_root(self.cgroup_name)
            self._start_holder(archive.parent / "pause")
            say(f"namespaces held by PID {self.init_pid}")
            self._start_relays()
            self._start_registry()
            self._start_containerd(archive)
            say("containerd started, pause image imported")
            self._start_kubelet()
            self._wait_ready()
            say(f"node {self.name} Ready")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> list[str]:
        """Stop the kubelet, containerd and relays by PID, then the holder (and with it its PID namespace);
        remove the node's cgroups and its Node object. Returns what could not be cleaned (for the report)."""
        for component in reversed(self.processes):
            stop_group(component.process, timeout=15)
        self.processes.clear()
        if self.holder is not None:
            stop_group(self.holder.process, timeout=10)
            self.holder = None
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        left = remove_cgroup_root(self.cgroups) if self.cgroups else []
        self.cgroups = []
        # Its endpoints of the `kubernetes` and `kube-dns` Services go with it: another node's kube-proxy
        # would otherwise keep sending Pods' connections to an address nothing answers.
        self.cluster.kubectl("delete", "endpointslices", "--all-namespaces", "-l",
                             f"{SLICE_NODE_LABEL}={self.name}", "--wait=false", check=False)  # fmt: skip
        self.cluster.kubectl("delete", "node", self.name, "--ignore-not-found", "--wait=false", check=False)
        return left

    def exited(self) -> str | None:
        for component in [*([self.holder] if self.holder else []), *self.processes]:
            if component.process.poll() is not None:
                return f"{component.name} exited ({component.process.returncode}); log {component.log}"
        return None

    # ---- helpers -----------------------------------------------------------------------------------
    def in_node(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside the node's PID, mount and network namespaces."""
        return ["nsenter", f"--target={self.init_pid}", "--pid", "--mount", "--net", "--", *command]

    def run_in_node(self, command: Sequence[str], timeout: float = 120) -> str:
        return _run(self.in_node(command), timeout)

    def _spawn(self, name: str, command: Sequence[str], inside: bool = True) -> _Process:
        log = self.logs / f"{name}.log"
        process = spawn_logged(self.in_node(command) if inside else list(command), log, env=None,
                               cwd=self.workdir)  # fmt: skip
        component = _Process(name, process, log)
        self.processes.append(component)
        return component

    def _wait(self, component: _Process, ready: Callable[[], bool], what: str, timeout: float = START_TIMEOUT
              ) -> None:  # fmt: skip
        deadline = time.monotonic() + timeout
        while not ready():
            if component.process.poll() is not None:
                raise NodeError(f"{component.name} exited ({component.process.returncode}) before {what}; "
                                f"last lines of {component.log}:\n{_tail(component.log)}")  # fmt: skip
            if time.monotonic() > deadline:
                raise NodeError(f"{what}: not within {timeout:.0f} s; last lines of {component.log}:\n"
                                f"{_tail(component.log)}")  # fmt: skip
            time.sleep(0.3)

    # ---- the components ----------------------------------------------------------------------------
    def _start_holder(self, pause: Path) -> None:
        ready = self.workdir / "holder.ready"
        setup = " && ".join(
            [
                "mount --make-rshared /",
                "mount -t tmpfs -o mode=755 tmpfs /run",
                "mount -t tmpfs -o mode=755 tmpfs /var/log",
                # CNI's state directory, where CNI plugins would make it: a fresh machine without them has
                # none, and a mount needs its mount point (the directory stays empty; the tmpfs is ours)
                "mkdir -p /var/lib/cni",
                "mount -t tmpfs -o mode=755 tmpfs /var/lib/cni",
                "mkdir -p /run/netns /run/kubelet",
                f"mkdir -p {self.workdir / 'kubelet'}",
                f"mount --bind {self.workdir / 'kubelet'} /run/kubelet",
                "ip link set lo up",
                # No dummy driver here: a bridge, without ports until NodeNetwork links another node
                f"ip link add {NODE_BRIDGE} type bridge",
                f"ip addr add {self.ip}/{self.prefix} dev {NODE_BRIDGE}",
                f"ip link set {NODE_BRIDGE} up",
                "sysctl -qw net.ipv4.ip_forward=1",
                f"touch {ready}",
                f"exec {pause}",
            ]
        )
        command = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount", "--net",
                   "--propagation", "private", "--", "sh", "-c", setup]  # fmt: skip
        log = self.logs / "holder.log"
        with log.open("wb") as out:
            out.write(("$ " + " ".join(command) + "\n").encode())
            out.flush()
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       cwd=self.workdir, start_new_session=True, preexec_fn=_killed_with_parent)  # fmt: skip
        self.holder = _Process("holder", process, log)
        self._wait(self.holder, ready.exists, "the node's namespaces", timeout=30)
        children = Path(f"/proc/{self.holder.process.pid}/task/{self.holder.process.pid}/children")
        self.init_pid = int(children.read_text().split()[0])

    def _start_relays(self) -> None:
        import sys

        self.api_socket.unlink(missing_ok=True)
        api_port = self.cluster.server.rpartition(":")[2]
        outside = self._spawn(
            "relay-host",
            [sys.executable, "-m", "vllm_stack_dev.cluster.relay", f"unix:{self.api_socket}",
             f"tcp:{LOOPBACK}:{api_port}"],
            inside=False,
        )  # fmt: skip
        self._wait(outside, self.api_socket.exists, "the API server relay's socket", timeout=30)
        inside = self._spawn(
            "relay-node",
            [sys.executable, "-m", "vllm_stack_dev.cluster.relay", f"tcp:0.0.0.0:{API_PORT_IN_NODE}",
             f"unix:{self.api_socket}"],
        )  # fmt: skip
        self._wait(inside, lambda: "relay" in _tail(inside.log, 1), "the node's relay to the API server", 30)

    def _start_registry(self) -> None:
        from vllm_stack_dev.images import registry_dir

        config = {
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {
                "filesystem": {"rootdirectory": str(registry_dir() / "data")},
                "maintenance": {"readonly": {"enabled": True}, "uploadpurging": {"enabled": False}},
            },
            "http": {"addr": f"{LOOPBACK}:{REGISTRY_PORT_IN_NODE}"},
        }
        path = self.workdir / "registry.yml"
        path.write_text(yaml.safe_dump(config))
        registry = self._spawn("registry", [str(REGISTRY.binary("registry")), "serve", str(path)])
        probe = self.in_node(["bash", "-c", f"exec 3<>/dev/tcp/{LOOPBACK}/{REGISTRY_PORT_IN_NODE}"])
        self._wait(registry, lambda: subprocess.run(probe, capture_output=True).returncode == 0,
                   "the node's registry mirror", 30)  # fmt: skip

    def _containerd_config(self) -> Path:
        root = self.workdir / "containerd"
        certs = root / "certs.d" / "ghcr.io"
        certs.mkdir(parents=True, exist_ok=True)
        (certs / "hosts.toml").write_text(
            'server = "https://ghcr.io"\n\n'
            f'[host."http://{LOOPBACK}:{REGISTRY_PORT_IN_NODE}"]\n'
            '  capabilities = ["pull", "resolve"]\n'
        )
        cni = self.workdir / "cni"
        (cni / "net.d").mkdir(parents=True, exist_ok=True)
        conflist = {
            "cniVersion": "0.4.0",
            "name": "vllm-stack-node",
            "plugins": [
                {
                    # Point to point: every Pod's traffic, to another Pod too, is routed through the
                    # node's namespace, so kube-proxy's NAT sees both directions of a ClusterIP
                    # connection (no br_netfilter needed, as a bridge would).
                    "type": "ptp",
                    "ipMasq": False,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": self.pod_cidr}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(cni / "ipam"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (cni / "net.d" / "10-vllm-stack.conflist").write_text(json.dumps(conflist, indent=1))
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config = f"""version = 2
root = "{root / "root"}"
state = "/run/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins."io.containerd.internal.v1.opt"]
  path = "{root / "opt"}"

[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  enable_selinux = false
  # Without CAP_SYS_RESOURCE (this machine's root lacks it) no process may lower its OOM score: the
  # sandbox's -998 and a Guaranteed Pod's -997 would make runc fail ("can't get final child's PID").
  restrict_oom_score_adj = true
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{shutil.which("runc") or "runc"}"
  [{cri}.cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni / "net.d"}"
  [{cri}.registry]
    config_path = "{root / "certs.d"}"
"""
        path = root / "config.toml"
        path.write_text(config)
        return path

    def _start_containerd(self, pause_archive_path: Path) -> None:
        config = self._containerd_config()
        containerd = self._spawn("containerd", ["containerd", "--config", str(config)])
        socket = "/run/containerd/containerd.sock"
        version = self.in_node(["ctr", "--address", socket, "version"])
        self._wait(containerd, lambda: subprocess.run(version, capture_output=True).returncode == 0,
                   "containerd's socket", 60)  # fmt: skip
        self.run_in_node(["ctr", "--address", socket, "-n", "k8s.io", "images", "import",
                          str(pause_archive_path)])  # fmt: skip

    def _kubelet_files(self) -> tuple[Path, Path]:
        assert self.cluster.pki is not None
        ca = self.cluster.pki.ca
        pki = self.workdir / "pki"
        client = issue_signed_by(ca, pki, "kubelet-client", f"system:node:{self.name}", "system:nodes")
        serving = issue_signed_by(ca, pki, "kubelet-serving", self.name, server_ips=(self.ip,))
        kubeconfig = write_certificate_kubeconfig(
            self.workdir / "kubelet.kubeconfig", f"https://{LOOPBACK}:{API_PORT_IN_NODE}", ca.cert, client
        )
        resolv = self.workdir / "resolv.conf"
        resolv.write_text("nameserver 127.0.0.1\n")  # upstream of CoreDNS: none (nothing routes out)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": self.ip,
            "port": 10250,
            "readOnlyPort": 0,
            "tlsCertFile": str(serving.cert),
            "tlsPrivateKeyFile": str(serving.key),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(ca.cert)},
            },
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": f"/{self.cgroup_name}",
            "cgroupsPerQOS": True,
            "failCgroupV1": False,
            "failSwapOn": False,
            "enforceNodeAllocatable": ["pods"],
            "podLogsDir": str(self.workdir / "pod-logs"),
            "resolvConf": str(resolv),
            "clusterDNS": [CLUSTER_DNS_IP],
            "clusterDomain": CLUSTER_DOMAIN,
            "maxPods": 30,
            "registerNode": True,
            "serializeImagePulls": False,
            "evictionHard": {"memory.available": "50Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "syncFrequency": "10s",
            "fileCheckFrequency": "10s",
            "nodeStatusUpdateFrequency": "5s",
            "shutdownGracePeriod": "0s",
            "hairpinMode": "hairpin-veth",
        }
        path = self.workdir / "kubelet.yaml"
        path.write_text(yaml.safe_dump(config))
        return path, kubeconfig

    def _start_kubelet(self) -> None:
        # The kubelet's own identity may check tokens and permissions (its webhook authentication and
        # authorization): system:auth-delegator, bound to the nodes' group.
        self.cluster.apply([{
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "vllm-stack-nodes-auth-delegator"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:auth-delegator"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "system:nodes"}],
        }])  # fmt: skip
        config, kubeconfig = self._kubelet_files()
        self._spawn(
            "kubelet",
            [
                str(self.binaries["kubelet"]),
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                "--root-dir=/run/kubelet",  # the workdir's `kubelet` folder, bind-mounted (socket paths)
                f"--hostname-override={self.name}",
                f"--node-ip={self.ip}",
                "--node-labels=vllm-stack.dev/real-node=true",
                "--v=2",
            ],
        )

    def start_kube_proxy(self) -> None:
        """kube-proxy (iptables mode, in the node's network namespace only) and an EndpointSlice that
        makes the `kubernetes` Service (10.96.0.1:443) lead to the API server: the control plane runs
        without an endpoint reconciler (its advertise address is loopback, which Endpoints refuse), so the
        slice names the node's relay (`<node IP>:6443`), as a Pod's in-cluster client would reach it."""
        assert self.cluster.pki is not None
        pki = self.workdir / "pki"
        client = issue_signed_by(self.cluster.pki.ca, pki, "kube-proxy", "system:kube-proxy")
        kubeconfig = write_certificate_kubeconfig(
            self.workdir / "kube-proxy.kubeconfig",
            f"https://{LOOPBACK}:{API_PORT_IN_NODE}",
            self.cluster.pki.ca.cert,
            client,
        )
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)},
            "mode": "iptables",
            "clusterCIDR": POD_CIDR,
            "nodePortAddresses": ["primary"],  # the node's IP only (not loopback: no route_localnet)
            "hostnameOverride": self.name,
            "bindAddress": self.ip,
            "healthzBindAddress": f"{LOOPBACK}:10256",
            "metricsBindAddress": f"{LOOPBACK}:10249",
            # Leave the conntrack table size alone (a host-wide setting), and its timeouts
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
        }  # fmt: skip
        path = self.workdir / "kube-proxy.yaml"
        path.write_text(yaml.safe_dump(config))
        self._spawn("kube-proxy", [str(self.binaries["kube-proxy"]), f"--config={path}", "--v=2"])
        self.cluster.apply([{
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": f"kubernetes-{self.name}", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "kubernetes",
                                    "endpointslice.kubernetes.io/managed-by": "testbed.vllm-stack.dev",
                                    SLICE_NODE_LABEL: self.name}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [self.ip], "conditions": {"ready": True}}],
            "ports": [{"name": "https", "port": API_PORT_IN_NODE, "protocol": "TCP"}],
        }])  # fmt: skip
        self.wait_proxied("default/kubernetes:https", self.ip)

    def wait_proxied(self, service_port: str, *addresses: str, timeout: float = 60) -> None:
        """Wait until this node's kube-proxy has rules for ``service_port`` (`namespace/name:port`, the
        comment kube-proxy puts on them) that lead to each of ``addresses`` (endpoint IPs): a Pod that
        connects to the Service's ClusterIP before then is refused."""
        proxy = next(component for component in self.processes if component.name == "kube-proxy")
        rules = self.in_node(["iptables-save", "-t", "nat"])
        comment = f'--comment "{service_port}"'

        def programmed() -> bool:
            lines = [line for line in subprocess.run(rules, capture_output=True, text=True).stdout.splitlines()
                     if comment in line]  # fmt: skip
            return bool(lines) and all(any(f"--to-destination {address}:" in line for line in lines)
                                       for address in addresses)  # fmt: skip

        leading = f" to {', '.join(addresses)}" if addresses else ""
        self._wait(
            proxy, programmed, f"kube-proxy's rules on {self.name} for {service_port}{leading}", timeout
        )

    def start_dns(self) -> None:
        """CoreDNS in the node's namespace, serving the cluster domain from the API server (its
        `kubernetes` plugin, as a ServiceAccount-less client with a certificate and a ClusterRole of its
        own), and the `kube-system/kube-dns` Service (10.96.0.10, the kubelet's `clusterDNS`) leading to it
        through kube-proxy. Names outside the cluster domain get SERVFAIL: there is no upstream."""
        assert self.cluster.pki is not None
        user = "vllm-stack:coredns"
        client = issue_signed_by(self.cluster.pki.ca, self.workdir / "pki", "coredns", user)
        kubeconfig = write_certificate_kubeconfig(
            self.workdir / "coredns.kubeconfig",
            f"https://{LOOPBACK}:{API_PORT_IN_NODE}",
            self.cluster.pki.ca.cert,
            client,
        )
        ready_port = 8181
        corefile = self.workdir / "Corefile"
        corefile.write_text(
            f""".:53 {{
    errors
    ready {LOOPBACK}:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} vllm-stack-test
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 5
}}
"""
        )
        rbac = "rbac.authorization.k8s.io"
        dns_ports = [{"name": "dns", "port": 53, "protocol": "UDP"},
                     {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]  # fmt: skip
        self.cluster.apply([
            {"apiVersion": f"{rbac}/v1", "kind": "ClusterRole", "metadata": {"name": "vllm-stack:coredns"},
             "rules": [{"apiGroups": [""], "resources": ["services", "pods", "namespaces"],
                        "verbs": ["list", "watch"]},
                       {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                        "verbs": ["list", "watch"]}]},
            {"apiVersion": f"{rbac}/v1", "kind": "ClusterRoleBinding", "metadata": {"name": "vllm-stack:coredns"},
             "roleRef": {"apiGroup": rbac, "kind": "ClusterRole", "name": "vllm-stack:coredns"},
             "subjects": [{"apiGroup": rbac, "kind": "User", "name": user}]},
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "kube-dns", "namespace": "kube-system"},
             "spec": {"clusterIP": CLUSTER_DNS_IP, "ports": [{**port, "targetPort": 53} for port in dns_ports]}},
            {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
             "metadata": {"name": f"kube-dns-{self.name}", "namespace": "kube-system",
                          "labels": {"kubernetes.io/service-name": "kube-dns",
                                     "endpointslice.kubernetes.io/managed-by": "testbed.vllm-stack.dev",
                                     SLICE_NODE_LABEL: self.name}},
             "addressType": "IPv4",
             "endpoints": [{"addresses": [self.ip], "conditions": {"ready": True}}],
             "ports": dns_ports},
        ])  # fmt: skip
        coredns = self._spawn("coredns", [str(self.binaries["coredns"]), "-conf", str(corefile)])
        probe = self.in_node(["bash", "-c", f"exec 3<>/dev/tcp/{LOOPBACK}/{ready_port} && "
                              "printf 'GET /ready HTTP/1.0\\r\\n\\r\\n' >&3 && grep -q ' 200 ' <&3"])  # fmt: skip
        self._wait(coredns, lambda: subprocess.run(probe, capture_output=True).returncode == 0,
                   "CoreDNS ready (its kubernetes plugin synced)", 60)  # fmt: skip
        self.wait_proxied("kube-system/kube-dns:dns", self.ip)

    def _wait_ready(self) -> None:
        kubelet = self.processes[-1]

        def ready() -> bool:
            result = self.cluster.kubectl("get", "node", self.name, "-o", "json", check=False)
            if result.returncode != 0:
                return False
            conditions = json.loads(result.stdout).get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        self._wait(kubelet, ready, f"node {self.name} Ready", START_TIMEOUT)
