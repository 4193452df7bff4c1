"""tutorials/03-lora-adapters.md, run as written: every marked step, in order, on this machine.

`vllm-stack up` brings up the tutorial's values file from the rendered chart: two real vLLM engines (CPU
build, the tiny model with dummy weights, runtime LoRA loading on), and the real router with the
rendered adapter registry, whose adapters are tiny random LoRAs `up` writes. The only substitutions: the
tutorial's port 8000 is a free port and its scratch folder /tmp/vllm-stack-tutorial is the test's own.
The Kubernetes part is rendered with the chart (no cluster here). After the start the test waits until
the hot adapter is on both engines (about a second; a reader reads on meanwhile).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from vllm_stack_dev.up.run import READY_LINE, still_listening

from tests.tutorials.render_checks import check_render
from tests.tutorials.runner import ROOT, TutorialRun, tutorial_env, tutorial_port

pytestmark = [pytest.mark.engine, pytest.mark.helm]

TUTORIAL = ROOT / "tutorials" / "03-lora-adapters.md"
STACK_READY_TIMEOUT_S = 480  # helm template, two engines (a minute each on a busy CPU), the router
BASE = "meta-llama/Llama-3.1-8B-Instruct"


def test_lora_tutorial_runs_as_written(tmp_path: Path) -> None:
    port = tutorial_port()
    scratch = tmp_path / "scratch"
    tutorial = TutorialRun(
        TUTORIAL,
        replacements={"8000": str(port), "/tmp/vllm-stack-tutorial": str(scratch)},
        env=tutorial_env(),
        port=port,
        log_dir=tmp_path,
        server_step="stack",
        ready_timeout=STACK_READY_TIMEOUT_S,
        ready_line=READY_LINE,
    )
    assert tutorial.names == ["render", "stack", "try", "try", "try", "canary", "try"]
    outputs = tutorial.run_all(after_server_start=lambda url: _wait_hot_loaded(url, 2))
    check_render(TUTORIAL.name, outputs["render"][0])
    listing, placement, not_found, admin = outputs["try"]
    assert f"sql parent: {BASE}" in listing and "assistant parent: None" in listing
    assert listing.count("adapters: ['support']") == 2  # the hot one, on both engines from the start
    assert placement.splitlines()[:3] == ["sql"] * 3
    assert 'outcome="ok",tier="warm"} 1.0' in placement or 'tier="warm",outcome="ok"} 1.0' in placement
    assert '"code":"model_not_found"' in not_found.replace(" ", "")
    assert "no admin key: 403" in admin and "added successfully" in admin
    stack = json.loads((scratch / "03" / "stack.json").read_text())
    assert not still_listening(stack), "every port closed after vllm-stack up stopped"


def _wait_hot_loaded(url: str, count: int, timeout: float = 60.0) -> None:
    """A moment after the start (the reader reads on): the hot adapter is on every engine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engines = httpx.get(url + "/engines", timeout=5).json()["engines"]
        if sum("support" in e["lora"]["adapters"] for e in engines) == count:
            return
        time.sleep(0.2)
    raise AssertionError("the hot adapter was not loaded on every engine")
