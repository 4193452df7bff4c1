"""tutorials/04-request-priority.md, run as written: every marked step, in order, on this machine.

The only substitutions: the engine the tutorial starts with `vllm-stack engines` is the test session's
priority engine (the same real vLLM engine: two sequences at once, `--scheduling-policy priority`;
`$ENGINES` points at it), its port 8091 is a free port, and /tmp/vllm-stack-priority is the test's own
directory. The Kubernetes part is rendered with the chart (no cluster here).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_stack_dev.testbed.engines import Engine, free_port

from tests.tutorials.runner import ROOT, TutorialRun, tutorial_env

pytestmark = pytest.mark.engine

TUTORIAL = ROOT / "tutorials" / "04-request-priority.md"


def test_priority_tutorial_runs_as_written(priority_engine: Engine, tmp_path: Path) -> None:
    port = free_port()
    tutorial = TutorialRun(
        TUTORIAL,
        replacements={"8091": str(port), "/tmp/vllm-stack-priority": str(tmp_path / "priority")},
        env=tutorial_env(ENGINES=priority_engine.url),
        port=port,
        log_dir=tmp_path,
    )
    assert tutorial.names == ["render", "config", "router", "try", "burst", "try"]
    outputs = tutorial.run_all()
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
