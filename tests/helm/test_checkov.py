"""checkov on the rendered chart: no failed check. Chart-wide skips live in helm/.checkov.yaml and
per-object skips in `checkov.io/skipN` annotations, each with one line of justification.

checkov runs from its own virtual environment (.tools/checkov-venv, see helm/README.md): its pins conflict
with the project's."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helm.chart import CHART, EXAMPLES, ROOT, run_helm

pytestmark = pytest.mark.helm

CHECKOV = ROOT / ".tools" / "checkov-venv" / "bin" / "checkov"

# The user's production-stack file asks for `tag: latest` on the engine and router images; the chart renders
# what it is given, so that one check fails there and only there.
EXPECTED = {("CKV_K8S_14", "seed-mistral.yaml")}
# Features no example turns on, checked as well: file name -> the `helm template` values arguments.
MORE = {
    "inference-extension-epp.yaml": [
        "-f",
        str(EXAMPLES / "monitoring.yaml"),
        "--set",
        "inferenceExtension.epp.enabled=true",
    ],
    # the router's Batch API: its claim, the volume mounted, the database URL from a Secret
    "router-batch.yaml": [
        "--set",
        "routerSpec.batch.enabled=true",
        "--set",
        "routerSpec.batch.database.secretName=batch-db",
    ],
}


def test_checkov_passes_on_every_example(tmp_path):
    if not CHECKOV.exists():
        pytest.fail(
            ".tools/checkov-venv missing: run `make install` (installs checkov into .tools/checkov-venv)"
        )
    for values in [None, *sorted(EXAMPLES.glob("*.yaml"))]:
        name = "defaults.yaml" if values is None else values.name
        args = ["template", "vllm-stack", ".", "--namespace", "llm"] + (
            [] if values is None else ["-f", str(values)]
        )
        proc = run_helm("helm4", *args)
        assert proc.returncode == 0, proc.stderr
        (tmp_path / name).write_text(proc.stdout)
    for name, values_args in MORE.items():
        proc = run_helm("helm4", "template", "vllm-stack", ".", "--namespace", "llm", *values_args)
        assert proc.returncode == 0, proc.stderr
        (tmp_path / name).write_text(proc.stdout)
    proc = subprocess.run(
        [
            str(CHECKOV),
            "-d",
            str(tmp_path),
            "--config-file",
            str(CHART / ".checkov.yaml"),
            "--quiet",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = {
        (f["check_id"], f["file_path"].lstrip("/"), f["resource"])
        for r in reports
        for f in r["results"]["failed_checks"]
    }
    assert {(c, f) for c, f, _ in failed} == EXPECTED, sorted(failed)
    assert sum(r["summary"]["passed"] for r in reports) > 1000
