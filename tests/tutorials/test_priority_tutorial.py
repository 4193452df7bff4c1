"""tutorials/04-request-priority.md, run as written: every marked step, in order, on this machine.

`vllm-stack up` brings up the tutorial's values file (with the tutorial's own `--set`s) from the
rendered chart: one real vLLM engine for `chat` (CPU build, the tiny model with dummy weights, two
sequences at once, `--scheduling-policy priority`), none for `summaries` (zero replicas), and the real
router with the rendered priority configuration and a generated priority key. The only substitutions:
the tutorial's port 8000 is a free port and its scratch folder /tmp/vllm-stack-tutorial is the test's
own. The Kubernetes part is rendered with the chart (no cluster here).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from vllm_stack_dev.up.run import READY_LINE, still_listening

from tests.tutorials.render_checks import check_render
from tests.tutorials.runner import ROOT, TutorialRun, tutorial_env, tutorial_port

pytestmark = [pytest.mark.engine, pytest.mark.helm]

TUTORIAL = ROOT / "tutorials" / "04-request-priority.md"
STACK_READY_TIMEOUT_S = 480  # helm template, the engine (a minute on a busy CPU), the router


def test_priority_tutorial_runs_as_written(tmp_path: Path) -> None:
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
    assert tutorial.names == ["render", "stack", "try", "burst", "try"]
    outputs = tutorial.run_all()  # ends with SIGTERM to `vllm-stack up`
    check_render(TUTORIAL.name, outputs["render"][0])
    who, cold = outputs["try"]
    assert who.splitlines() == ["sheddable: 200", "critical without a key: 403", "critical with the key: 200"]
    burst = outputs["burst"][0].splitlines()
    assert burst[:3] == ["critical 200 200 200", "standard 200 200 200", "sheddable 429 429 429"]
    order = burst[3].removeprefix("first tokens, in order: ").split()
    assert order == ["critical"] * 3 + ["standard"] * 3
    assert cold.splitlines()[:2] == ["summaries: 503", "no-such-model: 404"]
    exits = [line for line in cold.splitlines() if line.startswith("vllm_stack_router_queue_exits_total")]
    assert any(re.search(r'model="summaries"', e) and 'outcome="timeout"' in e for e in exits), cold
    stack = json.loads((scratch / "04" / "stack.json").read_text())
    assert not still_listening(stack), "every port closed after vllm-stack up stopped"
