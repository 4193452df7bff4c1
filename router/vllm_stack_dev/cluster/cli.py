"""`vllm-stack cluster up`: the test cluster in the foreground until Ctrl-C, with how to use it."""

from __future__ import annotations

import contextlib
import signal
import sys
import tempfile
import threading
from pathlib import Path

from vllm_stack_dev.cluster.control_plane import ClusterError, ClusterOptions, running_cluster
from vllm_stack_dev.cluster.node import RealNode
from vllm_stack_dev.cluster.node_network import running_real_nodes
from vllm_stack_dev.gotools import control_plane_binaries, node_binaries
from vllm_stack_dev.paths import helm_binary


def _usage(kubeconfig: Path, kubectl: Path, nodes: list[RealNode]) -> str:
    if not nodes:
        where = [
            "Pods run on kwok nodes: scheduled and reported Running and Ready, but no container runs"
            " (no kubelet or container runtime here); Services get no endpoints (loopback Pod IPs)."
        ]
    else:
        names = " and ".join(node.name for node in nodes)
        where = [
            f"Pods run on the real node{'s' if len(nodes) > 1 else ''} {names} (kubelet, containerd, runc;"
            " kwok nodes are tainted NoSchedule); Pod and Service addresses exist only in the nodes' network"
            " namespaces (linked to each other, to nothing else):",
            *(f"  nsenter --target {node.init_pid} --net curl http://POD_IP:PORT/   # {node.name} ({node.ip},"
              f" Pods {node.pod_cidr})" for node in nodes),
        ]  # fmt: skip
    return "\n".join(
        [
            f"kubeconfig: {kubeconfig}",
            "use it with:",
            f"  export KUBECONFIG={kubeconfig}",
            f"  {kubectl} get nodes",
            f"  {helm_binary(4)} install vllm-stack ./helm -f helm/examples/local-default.yaml",
            *where,
            "Ctrl-C stops the cluster.",
        ]
    )


def cluster_up(folder: Path | None, nodes: int, real_nodes: int = 0) -> int:
    """Start the cluster (and ``real_nodes`` real nodes, 0 to 2: vllm_stack_dev.cluster.node_network), print its
    kubeconfig and usage, wait for SIGINT/SIGTERM, stop it."""
    missing = sorted(name for name, path in control_plane_binaries().items() if not path.is_file())
    if missing:
        print(
            f"error: control-plane binaries missing ({', '.join(missing)}): run `make install`",
            file=sys.stderr,
        )
        return 1
    if real_nodes not in (0, 1, 2):
        print("error: --real-nodes is 0, 1 or 2 (Pod CIDRs 10.244.<i>.0/24, node IPs 10.88.0.<i+2>)",
              file=sys.stderr)  # fmt: skip
        return 1
    missing = sorted(name for name, path in node_binaries().items() if real_nodes and not path.is_file())
    if missing:
        print(f"error: node binaries missing ({', '.join(missing)}): run `make install`", file=sys.stderr)
        return 1
    workdir = folder or Path(tempfile.mkdtemp(prefix="vllm-stack-cluster-"))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with contextlib.ExitStack() as running:
            cluster = running.enter_context(
                running_cluster(ClusterOptions(workdir=workdir, nodes=nodes), say=print)
            )
            real: list[RealNode] = []
            if real_nodes:
                for index in range(nodes):
                    cluster.kubectl(
                        "taint", "node", f"kwok-node-{index}", "vllm-stack.dev/kwok=true:NoSchedule"
                    )
                real = running.enter_context(running_real_nodes(cluster, workdir, real_nodes, say=print))
                print("kube-proxy and CoreDNS started", flush=True)
            print(_usage(cluster.kubeconfig, cluster.binaries["kubectl"], real), flush=True)
            while not stop.wait(1.0):
                broken = cluster.exited() or next((b for node in real if (b := node.exited())), None)
                if broken:
                    print(f"error: {broken}", file=sys.stderr)
                    return 1
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("cluster stopped")
    return 0
