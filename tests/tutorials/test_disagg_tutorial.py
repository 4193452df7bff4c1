"""tutorials/05-disaggregated-prefill.md, run as written: every marked step, in order, on this machine.

The only substitutions: the two engines the tutorial starts with `vllm-stack engines` are the test
session's `pd_engines` (the same command's engines: ExampleConnector as kv_producer and kv_consumer on
one folder; `$PREFILL` and `$DECODE` point at them), its port 8092 is a free port. The Kubernetes part
is rendered with the chart (no cluster here).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from vllm_stack_dev.testbed.engines import EngineGroup, free_port

from tests.tutorials.runner import ROOT, TutorialRun, tutorial_env

pytestmark = pytest.mark.engine

TUTORIAL = ROOT / "tutorials" / "05-disaggregated-prefill.md"


def test_disagg_tutorial_runs_as_written(pd_engines: EngineGroup, tmp_path: Path) -> None:
    prefill, decode = pd_engines
    port = free_port()
    hits_before = decode.metric_value("vllm:external_prefix_cache_hits_total")
    tutorial = TutorialRun(
        TUTORIAL,
        replacements={"8092": str(port)},
        env=tutorial_env(PREFILL=prefill.url, DECODE=decode.url),
        port=port,
        log_dir=tmp_path,
    )
    assert tutorial.names == ["render", "router", "try", "check"]
    outputs = tutorial.run_all()
    rendered = outputs["render"][0]
    assert re.search(r"\d+ +vllm-stack.io/role: prefill", rendered), rendered
    assert re.search(r"\d+ +vllm-stack.io/role: decode", rendered), rendered
    assert "disaggregated_prefill" in rendered and "lmcache" in rendered, rendered
    assert '"sender"' in rendered and '"receiver"' in rendered, rendered
    assert outputs["try"][0].splitlines() == ["long prompt 200", "short prompt 200"]
    check = outputs["check"][0]
    assert 'outcome="disaggregated"} 1.0' in check and 'outcome="short"} 1.0' in check, check
    assert decode.metric_value("vllm:external_prefix_cache_hits_total") - hits_before >= 128, check
