"""tutorials/05-disaggregated-prefill.md, run as written: every marked step, in order, on this machine.

`vllm-stack up` brings up the tutorial's values file from the rendered chart: a prefill engine and a
decode engine (real vLLM engines, CPU build, the tiny model with dummy weights) whose LMCache PD
connector becomes vLLM's NixlConnector over loopback TCP, and the real router in disaggregated mode.
The only substitutions: the tutorial's port 8000 is a free port and its scratch folder
/tmp/vllm-stack-tutorial is the test's own. The Kubernetes part is rendered with the chart (no cluster
here).
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

TUTORIAL = ROOT / "tutorials" / "05-disaggregated-prefill.md"
STACK_READY_TIMEOUT_S = 480  # helm template, two NIXL engines (a minute each on a busy CPU), the router


def test_disagg_tutorial_runs_as_written(tmp_path: Path) -> None:
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
    assert tutorial.names == ["render", "stack", "try", "check"]
    outputs = tutorial.run_all()  # ends with SIGTERM to `vllm-stack up`
    check_render(TUTORIAL.name, outputs["render"][0])
    assert outputs["try"][0].splitlines() == ["long prompt 200", "short prompt 200"]
    check = outputs["check"][0]
    assert 'outcome="disaggregated"} 1.0' in check and 'outcome="short"} 1.0' in check, check
    hits = re.search(r"^vllm:external_prefix_cache_hits_total\{[^}]*\} (\S+)$", check, re.M)
    assert hits and float(hits.group(1)) >= 256, check  # the long prompt's KV came over NIXL
    stack = json.loads((scratch / "05" / "stack.json").read_text())
    assert not still_listening(stack), "every port closed after vllm-stack up stopped"
