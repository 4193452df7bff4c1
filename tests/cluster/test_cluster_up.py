"""`vllm-stack cluster up`: a cluster a user can point kubectl and Helm at, in the foreground until Ctrl-C.

It runs beside the session's cluster (every port is its own), as a user would run it: the command, its
printed kubeconfig, kubectl with that kubeconfig, then SIGINT; afterwards no process that used its folder
is left.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from vllm_stack_dev.gotools import control_plane_binaries

from tests.helm.chart import ROOT

pytestmark = pytest.mark.cluster

START_TIMEOUT = 180.0


def _processes_using(folder: Path) -> list[str]:
    """Command lines of the live processes that name ``folder`` (the components take it in flags)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(folder) in text:
            found.append(text)
    return found


class _Lines:
    """The lines a process prints, read by a thread (a select() on the pipe would miss lines already
    taken into the file object's buffer)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.queue: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            self.queue.put(line)
        self.queue.put("")  # end of output

    def until(self, marker: str, timeout: float) -> list[str]:
        """The lines up to and including the first that starts with ``marker``."""
        deadline = time.monotonic() + timeout
        taken: list[str] = []
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.queue.get(timeout=left)
            except queue.Empty:
                break
            assert line, f"exited {self.process.wait()}: {''.join(self.seen)}"
            self.seen.append(line)
            taken.append(line)
            if line.startswith(marker):
                return taken
        raise AssertionError(f"no {marker!r} line within {timeout:.0f} s: {''.join(self.seen)}")

    def rest(self, timeout: float) -> str:
        """Everything printed until the process exits."""
        self.process.wait(timeout=timeout)
        while (line := self.queue.get(timeout=timeout)) != "":
            self.seen.append(line)
        return "".join(self.seen)


def _run(command: list[str]) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=30).stdout


def interrupt_and_check_stopped(process: subprocess.Popen[str], output: _Lines, folder: Path) -> None:
    """Ctrl-C (SIGINT to the command's group): it says the cluster stopped, exits 0, and no process that
    named ``folder`` is left."""
    os.killpg(process.pid, signal.SIGINT)
    printed = output.rest(timeout=90)
    assert process.returncode == 0, printed
    assert "cluster stopped" in printed
    assert _processes_using(folder) == []


def test_cluster_up_serves_kubectl_until_ctrl_c(tmp_path: Path) -> None:
    folder = tmp_path / "cluster"
    process = subprocess.Popen(
        [str(ROOT / ".venv" / "bin" / "vllm-stack"), "cluster", "up", "--nodes", "2", "--dir", str(folder)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        output = _Lines(process)
        lines = output.until("kubeconfig:", START_TIMEOUT)
        kubeconfig = Path(lines[-1].split(":", 1)[1].strip())
        assert kubeconfig.is_file()
        lines += output.until("Ctrl-C stops the cluster.", 5.0)
        assert any(f"export KUBECONFIG={kubeconfig}" in line for line in lines), lines

        kubectl = [str(control_plane_binaries()["kubectl"]), f"--kubeconfig={kubeconfig}"]
        nodes = json.loads(_run([*kubectl, "get", "nodes", "-o", "json"]))["items"]
        assert len(nodes) == 2
        for node in nodes:
            ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
            assert ready == "True", node["metadata"]["name"]
            capacity = node["status"]["capacity"]
            assert {"cpu", "memory", "nvidia.com/gpu", "amd.com/gpu"} <= set(capacity), capacity
        crds = _run([*kubectl, "get", "crd", "-o", "name"])
        assert "inferencepools.inference.networking.k8s.io" in crds
        assert _run([*kubectl, "get", "pv", "-o", "name"]).strip(), "claims need volumes to bind to"
        assert len(_processes_using(folder)) > 1, "etcd and the others take their folder in flags"

        interrupt_and_check_stopped(process, output, folder)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
