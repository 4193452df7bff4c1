"""`vllm-stack cluster up`: the test cluster in the foreground until Ctrl-C, with how to use it."""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
from pathlib import Path

from vllm_stack_dev.cluster.control_plane import ClusterError, ClusterOptions, running_cluster
from vllm_stack_dev.gotools import control_plane_binaries
from vllm_stack_dev.paths import helm_binary


def _usage(kubeconfig: Path, kubectl: Path) -> str:
    return "\n".join(
        [
            f"kubeconfig: {kubeconfig}",
            "use it with:",
            f"  export KUBECONFIG={kubeconfig}",
            f"  {kubectl} get nodes",
            f"  {helm_binary(4)} install vllm-stack ./helm -f helm/examples/local-default.yaml",
            "Pods run on kwok nodes: scheduled and reported Running and Ready, but no container runs"
            " (no kubelet or container runtime here); Services get no endpoints (loopback Pod IPs).",
            "Ctrl-C stops the cluster.",
        ]
    )


def cluster_up(folder: Path | None, nodes: int) -> int:
    """Start the cluster, print its kubeconfig and usage, wait for SIGINT/SIGTERM, stop it."""
    missing = sorted(name for name, path in control_plane_binaries().items() if not path.is_file())
    if missing:
        print(
            f"error: control-plane binaries missing ({', '.join(missing)}): run `make install`",
            file=sys.stderr,
        )
        return 1
    workdir = folder or Path(tempfile.mkdtemp(prefix="vllm-stack-cluster-"))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with running_cluster(ClusterOptions(workdir=workdir, nodes=nodes), say=print) as cluster:
            print(_usage(cluster.kubeconfig, cluster.binaries["kubectl"]), flush=True)
            while not stop.wait(1.0):
                broken = cluster.exited()
                if broken:
                    print(f"error: {broken}", file=sys.stderr)
                    return 1
    except ClusterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print("cluster stopped")
    return 0
