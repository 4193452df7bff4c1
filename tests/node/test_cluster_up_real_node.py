"""`vllm-stack cluster up --real-nodes 1`: the control plane and one real node for a person, until Ctrl-C.

The command as a user runs it: its printed kubeconfig, kubectl with it (the real node Ready beside the
tainted kwok node), then SIGINT; afterwards no process that used its folder is left, the node's namespace
with everything in it included.
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


def test_cluster_up_with_a_real_node_until_ctrl_c(tmp_path: Path) -> None:
    folder = tmp_path / "cluster"
    command = [str(ROOT / ".venv" / "bin" / "vllm-stack"), "cluster", "up", "--nodes", "1", "--real-nodes", "1",
               "--dir", str(folder)]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    try:
        output = _Lines(process)
        lines = output.until("kubeconfig:", START_TIMEOUT)
        assert any(line.startswith("node node-0 Ready") for line in lines), lines
        kubeconfig = Path(lines[-1].split(":", 1)[1].strip())
        lines += output.until("Ctrl-C stops the cluster.", 5.0)
        assert any("real node node-0" in line for line in lines), lines

        kubectl = [str(control_plane_binaries()["kubectl"]), f"--kubeconfig={kubeconfig}"]
        nodes = {
            n["metadata"]["name"]: n
            for n in json.loads(_run([*kubectl, "get", "nodes", "-o", "json"]))["items"]
        }
        assert set(nodes) == {"kwok-node-0", "node-0"}
        assert nodes["node-0"]["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
        assert nodes["node-0"]["status"]["nodeInfo"]["kubeletVersion"] == "v1.37.2"
        assert nodes["kwok-node-0"]["spec"]["taints"][0]["effect"] == "NoSchedule"
        assert any("kubelet" in line for line in _processes_using(folder))

        interrupt_and_check_stopped(process, output, folder)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
