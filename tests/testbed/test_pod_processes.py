"""PodProcesses.check (vllm_stack_dev.cluster.pod_processes): a Pod's process that died says so at once.

A cluster test waits on what a Pod's process serves (a router listing an engine) and calls ``check()`` as it
polls; a process that exited while its Pod still exists must fail that wait with the process's log, not
let it run to its timeout (CI once spent 420 s on such a wait and said nothing of why)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from vllm_stack_dev.cluster.pod_processes import PodProcesses, RouterProcess
from vllm_stack_dev.testbed.engines import Engine


def pod_processes(tmp_path: Path) -> PodProcesses:
    """A test bed with no cluster behind it: only what check() reads is filled in."""
    return PodProcesses(
        None,  # type: ignore[arg-type]  # check() never reaches the API server
        "ns", [], model_dir=tmp_path, workdir=tmp_path / "work", log_dir=tmp_path,
    )  # fmt: skip


def process(code: int | None) -> subprocess.Popen[bytes]:
    """A process that has exited with ``code``, or one still running (None)."""
    if code is None:
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    done = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    done.wait(timeout=30)
    return done


def engine(name: str, proc: subprocess.Popen[bytes], log: Path) -> Engine:
    return Engine(name, 8000, None, "tiny", proc, log, None)


def test_a_live_engine_and_router_are_no_problem_and_a_dead_one_is_named_with_its_log(tmp_path: Path) -> None:
    pods = pod_processes(tmp_path)
    running = [process(None), process(None)]
    try:
        pods.engines["engine-pod"] = engine("engine-pod", running[0], tmp_path / "engine.log")
        pods.routers["router-pod"] = RouterProcess(
            "router-pod", "http://x", running[1], tmp_path / "router.log"
        )
        pods.check()  # both alive

        (tmp_path / "dead.log").write_text("starting\nRuntimeError: out of memory\n")
        pods.engines["dead-pod"] = engine("dead-pod", process(3), tmp_path / "dead.log")
        with pytest.raises(
            RuntimeError, match=r"(?s)dead-pod: its process exited with code 3.*out of memory"
        ):
            pods.check()

        pods.gone["dead-pod"] = 0.0  # its Pod is gone, the process kept on purpose: not a failure
        pods.check()

        pods.routers["router-2"] = RouterProcess("router-2", "http://y", process(1), tmp_path / "nolog")
        with pytest.raises(RuntimeError, match=r"router-2: its process exited with code 1"):
            pods.check()
    finally:
        for proc in running:
            proc.kill()
            proc.wait(timeout=30)
