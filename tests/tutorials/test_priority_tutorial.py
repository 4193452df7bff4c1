"""tutorials/04-request-priority.md, run as written: every marked step, in order, on this machine.

The only substitutions: the engine the tutorial starts with `vllm-stack engines` is the test session's
priority engine (the same real vLLM engine: two sequences at once, `--scheduling-policy priority`;
`$ENGINES` points at it), its port 8091 is a free port, and /tmp/vllm-stack-priority is the test's own
directory. The Kubernetes part is rendered with the chart (no cluster here).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from vllm_stack_dev.localstack import wait_http_ok
from vllm_stack_dev.testbed.engines import Engine, free_port

from tests.tutorials.markdown import Step, steps

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "tutorials" / "04-request-priority.md"


def substituted(step: Step, port: int, workdir: Path) -> str:
    return step.code.replace("8091", str(port)).replace("/tmp/vllm-stack-priority", str(workdir))


def run(step: Step, code: str, env: dict[str, str]) -> str:
    command = (
        ["bash", "-euo", "pipefail", "-c", code]
        if step.language == "bash"
        else [str(ROOT / ".venv/bin/python"), "-c", code]
    )
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (
        f"step {step.name} failed ({proc.returncode}):\n{code}\n{proc.stdout}\n{proc.stderr}"
    )
    return proc.stdout


def test_priority_tutorial_runs_as_written(priority_engine: Engine, tmp_path: Path) -> None:
    port = free_port()
    workdir = tmp_path / "priority"
    env = {
        **os.environ,
        "PATH": f"{ROOT / '.tools' / 'helm4'}:{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}",
        "ENGINES": priority_engine.url,
    }
    found = steps(TUTORIAL)
    assert [s.name for s in found] == ["render", "config", "router", "try", "burst", "try"]
    outputs: dict[str, list[str]] = {}
    router: subprocess.Popen[bytes] | None = None
    try:
        for step in found:
            code = substituted(step, port, workdir)
            if step.name == "router":  # it keeps running: start it, wait until it is ready
                log = (tmp_path / "router.log").open("wb")
                router = subprocess.Popen(  # its own process group: stopped as a whole below
                    ["bash", "-c", code],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                try:
                    wait_http_ok(f"http://127.0.0.1:{port}/ready", 60, router)
                except RuntimeError as exc:
                    raise AssertionError(f"{exc}:\n{(tmp_path / 'router.log').read_text()[-2000:]}") from None
                continue
            outputs.setdefault(step.name, []).append(run(step, code, env))
    finally:
        if router is not None:
            os.killpg(router.pid, signal.SIGTERM)
            try:
                router.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(router.pid, signal.SIGKILL)
                router.wait(5)
    rendered = outputs["render"][0]
    assert "engine_priority: true" in rendered and "criticality: sheddable" in rendered
    assert 'vllm_stack_router_queue_length{model="chat"' in rendered
    who, cold = outputs["try"]
    assert who.splitlines() == ["sheddable: 200", "critical without a key: 403", "critical with the key: 200"]
    burst = outputs["burst"][0].splitlines()
    assert burst[:3] == ["critical 200 200 200", "standard 200 200 200", "sheddable 429 429 429"]
    order = burst[3].removeprefix("first tokens, in order: ").split()
    assert order == ["critical"] * 3 + ["standard"] * 3
    assert cold.splitlines()[:2] == ["later-model: 503", "no-such-model: 404"]
    assert 'model="later-model",outcome="timeout"' in cold.replace('class="standard",', "")
