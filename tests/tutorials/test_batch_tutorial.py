"""tutorials/11-batch-api.md, run as written: every marked step, in order, on this machine.

`vllm-stack up` brings up the tutorial's values file from the rendered chart: two real vLLM engines for
`chat` (CPU build, the tiny model with dummy weights) and the real router with `--batch-api`, its batch
claim a folder of the log directory. The OpenAI SDK uploads files and runs three batches through it: one
that completes, one that fails validation (an unknown model, a repeated custom_id), one cancelled while it
runs. The only substitutions: the tutorial's port 8000 is a free port and its scratch folder
/tmp/vllm-stack-tutorial is the test's own. The Kubernetes part is rendered with the chart (no cluster here).
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

TUTORIAL = ROOT / "tutorials" / "11-batch-api.md"
STACK_READY_TIMEOUT_S = 480  # helm template, two engines (a minute each on a busy CPU), the router


def _metric(text: str, name: str, label: str = "") -> float:
    """The value of the sample ``name`` (with ``label`` among its labels, if given) in an exposition."""
    for line in text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.split("{")[0] == name and label in sample:
            return float(value)
    raise AssertionError(f"no {name} {label} in:\n{text}")


def test_batch_tutorial_runs_as_written(tmp_path: Path) -> None:
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
    assert tutorial.names == ["render", "stack", "try", "validate", "cancel", "metrics"]
    outputs = tutorial.run_all()  # ends with SIGTERM to `vllm-stack up`
    check_render(TUTORIAL.name, outputs["render"][0])

    # The claim is a folder of the log directory, and `vllm-stack up` says so.
    said = (tmp_path / "stack.log").read_text()
    batch_dir = scratch / "11" / "pods" / "vllm-stack-deployment-router-0" / "batch"
    claim = "--batch-dir /var/lib/vllm-stack/batch (PersistentVolumeClaim vllm-stack-router-batch)"
    assert f"{claim} -> {batch_dir} " in said, said[-3000:]

    # 20 lines, all answered, in input order.
    completed = outputs["try"][0].splitlines()
    assert completed[:5] == [
        "created: validating",
        "status: completed",
        "request_counts: total=20 completed=20 failed=0",
        "model: chat error_file_id: None",
        "output lines: 20",
    ], completed
    assert re.fullmatch(r"first: question-0 200 [1-8] tokens", completed[5]), (
        completed
    )  # dummy weights: EOS may come early

    # Validation: the whole batch fails, nothing is sent, each error with its code and line.
    failed = outputs["validate"][0].splitlines()
    assert failed[0] == "status: failed | sent: 0", failed
    assert failed[1].startswith("line 3: model_not_found (body.model): The model 'gpt-4o-mini' "), failed
    assert failed[2].startswith("line 4: duplicate_custom_id (custom_id): The custom_id 'a' "), failed
    assert len(failed) == 3, failed

    # Cancelled while it ran: every line accounted for, the unanswered ones as batch_cancelled.
    running, cancelling, counts, errors, listed = outputs["cancel"][0].splitlines()
    assert running == "before cancel: in_progress", running
    assert cancelling == "cancel: cancelling -> cancelled", cancelling
    answered, unanswered = map(int, re.fullmatch(r"(\d+) answered \+ (\d+) not = 200", counts).groups())
    assert answered >= 5 and unanswered > 0 and answered + unanswered == 200, counts
    assert errors == f"error file: {{'batch_cancelled': {unanswered}}}", errors
    assert listed == "batches: ['cancelled', 'failed', 'completed']", listed

    # The store's batches by status, this router's lines; the claim's folder holds the database and files.
    metrics = outputs["metrics"][0]
    for status in ("completed", "failed", "cancelled"):
        assert _metric(metrics, "vllm_stack_router_batches", f'status="{status}"') == 1, (status, metrics)
    assert _metric(metrics, "vllm_stack_router_batch_lines_total", 'outcome="completed"') >= 20 + answered
    assert _metric(metrics, "vllm_stack_router_batch_lines_in_flight") == 0, metrics
    listing = metrics.splitlines()
    assert "batch.sqlite3" in listing and "files" in listing, listing
    assert (batch_dir / "batch.sqlite3").is_file()

    stack = json.loads((scratch / "11" / "stack.json").read_text())
    assert not still_listening(stack), "every port closed after vllm-stack up stopped"
