"""`vllm-stack cluster up --real-nodes 1|2`: the control plane and real nodes for a person, until Ctrl-C.

The command as a user runs it: its printed kubeconfig, kubectl with it (the real nodes Ready beside the
tainted kwok node), then SIGINT; afterwards no process that used its folder is left, the nodes' namespaces
with everything in them included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from vllm_stack_dev.gotools import control_plane_binaries

from tests.cluster.test_cluster_up import (
    START_TIMEOUT,
    _Lines,
    _processes_using,
    _run,
    interrupt_and_check_stopped,
)
from tests.helm.chart import ROOT

pytestmark = pytest.mark.node


@pytest.mark.parametrize(
    "real_nodes", [1, pytest.param(2, marks=pytest.mark.node_full)]
)  # two: make test-node
def test_cluster_up_with_real_nodes_until_ctrl_c(tmp_path: Path, real_nodes: int) -> None:
    folder = tmp_path / "cluster"
    names = [f"node-{index}" for index in range(real_nodes)]
    command = [str(ROOT / ".venv" / "bin" / "vllm-stack"), "cluster", "up", "--nodes", "1",
               "--real-nodes", str(real_nodes), "--dir", str(folder)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        output = _Lines(process)
        lines = output.until("kubeconfig:", START_TIMEOUT)
        for name in names:
            assert any(line.startswith(f"node {name} Ready") for line in lines), lines
        kubeconfig = Path(lines[-1].split(":", 1)[1].strip())
        lines += output.until("Ctrl-C stops the cluster.", 5.0)
        assert any(" and ".join(names) in line for line in lines if "real node" in line), lines

        kubectl = [str(control_plane_binaries()["kubectl"]), f"--kubeconfig={kubeconfig}"]
        nodes = {
            n["metadata"]["name"]: n
            for n in json.loads(_run([*kubectl, "get", "nodes", "-o", "json"]))["items"]
        }
        assert set(nodes) == {"kwok-node-0", *names}
        for name in names:
            info = nodes[name]["status"]["nodeInfo"]
            assert info["containerRuntimeVersion"].startswith("containerd://"), info
            assert info["kubeletVersion"] == "v1.37.2", info
        assert nodes["kwok-node-0"]["spec"]["taints"][0]["effect"] == "NoSchedule"
        assert any("kubelet" in line for line in _processes_using(folder))
        # The printed way into the last node's network reaches CoreDNS (TCP 53) at node-0's IP: over the link
        # between the nodes' namespaces when there are two (a node's own namespace has no route to ClusterIPs)
        into = {
            line.split("# ")[1].split()[0]: line.split()[2] for line in lines if "nsenter --target" in line
        }
        assert list(into) == names, lines
        tcp = "exec 3<>/dev/tcp/10.88.0.2/53"
        probe = ["nsenter", f"--target={into[names[-1]]}", "--net", "bash", "-c", tcp]  # fmt: skip
        assert subprocess.run(probe, capture_output=True, timeout=30).returncode == 0, probe

        interrupt_and_check_stopped(process, output, folder)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
