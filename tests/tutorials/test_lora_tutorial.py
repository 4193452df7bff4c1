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
import time

import httpx
import pytest
from vllm_stack_dev.testbed.engines import free_port

from tests.tutorials.runner import ROOT, TutorialRun, tutorial_env

pytestmark = pytest.mark.engine

TUTORIAL = ROOT / "tutorials" / "03-lora-adapters.md"


def test_lora_tutorial_runs_as_written(engines, tiny_model_dir, tmp_path) -> None:
    assert tiny_model_dir == ROOT / ".cache" / "models" / "tiny"  # the path the tutorial uses
    port = free_port()
    workdir = tmp_path / "lora"
    tutorial = TutorialRun(
        TUTORIAL,
        replacements={"8090": str(port), "/tmp/vllm-stack-lora": str(workdir)},
        env=tutorial_env(ENGINES=",".join(engines.urls)),
        port=port,
        log_dir=tmp_path,
    )
    assert tutorial.names[:4] == ["render", "adapters", "config", "router"]
    try:
        outputs = tutorial.run_all(after_server_start=lambda url: _wait_hot_loaded(url, len(engines)))
    finally:
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
