"""tutorials/03-lora-adapters.md, run as written: every marked step, in order, on this machine.

The only substitutions: the two engines the tutorial starts with `vllm-stack engines` are the test
session's chat engines (the same real vLLM engines, LoRA runtime loading on; `$ENGINES` points at
them), its port 8090 is a free port, and /tmp/vllm-stack-lora is the test's own directory. The
Kubernetes part is rendered with the chart (no cluster here). After the router's start the test waits
until the hot adapter is on both engines (about a second; a reader reads on meanwhile). Adapters it
loaded are unloaded again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from vllm_stack_dev.localstack import wait_http_ok
from vllm_stack_dev.testbed.engines import free_port

from tests.tutorials.markdown import Step, steps

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "tutorials" / "03-lora-adapters.md"


def substituted(step: Step, port: int, workdir: Path) -> str:
    return step.code.replace("8090", str(port)).replace("/tmp/vllm-stack-lora", str(workdir))


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


def test_lora_tutorial_runs_as_written(engines, tiny_model_dir, tmp_path) -> None:
    assert tiny_model_dir == ROOT / ".cache" / "models" / "tiny"  # the path the tutorial uses
    port = free_port()
    workdir = tmp_path / "lora"
    env = {
        **os.environ,
        "PATH": f"{ROOT / '.tools' / 'helm4'}:{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}",
        "ENGINES": ",".join(engines.urls),
    }
    found = steps(TUTORIAL)
    assert [s.name for s in found][:4] == ["render", "adapters", "config", "router"]
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
                _wait_hot_loaded(f"http://127.0.0.1:{port}", len(engines))
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
        for engine in engines:
            for name in ("support", "sql", "legal"):
                httpx.post(engine.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=10)
    rendered = outputs["render"][0]
    assert "name: support" in rendered and "tier: hot" in rendered
    assert sorted(os.listdir(workdir)) == ["legal", "router.yaml", "sql", "support"]
    listing, placement, not_found, admin = outputs["try"]
    assert "sql parent: tiny-llama" in listing and "assistant parent: None" in listing
    assert listing.count("adapters: ['support']") == 2  # the hot one, on both engines from the start
    assert placement.splitlines()[:3] == ["sql"] * 3
    assert 'outcome="ok",tier="warm"} 1.0' in placement or 'tier="warm",outcome="ok"} 1.0' in placement
    assert '"code":"model_not_found"' in not_found.replace(" ", "")
    assert "no admin key: 403" in admin and "added successfully" in admin


def _wait_hot_loaded(url: str, count: int, timeout: float = 30.0) -> None:
    """A moment after the start (the reader reads on): the hot adapter is on every engine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engines = httpx.get(url + "/engines", timeout=5).json()["engines"]
        if sum("support" in e["lora"]["adapters"] for e in engines) == count:
            return
        time.sleep(0.2)
    raise AssertionError("the hot adapter was not loaded on every engine")
