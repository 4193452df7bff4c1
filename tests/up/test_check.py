"""`vllm-stack check` and `vllm-stack up` say every deviation the chart makes, the lines its NOTES.txt
lists (the chart computes them once, `vllm-stack.deviations`), and `--strict` turns them into the chart's
own refusal: what a GitOps pipeline rendering with `helm template` would otherwise never see."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from vllm_stack_dev.up.check import SHORT, findings, readme_table, severity_of, shorten
from vllm_stack_dev.up.render import DEVIATIONS_HEADER, deviations_in, render_release

from tests.helm.chart import ROOT
from tests.shared_data import PS_VALUES, require

pytestmark = pytest.mark.helm

CLEAN = ROOT / "helm/examples/cache-server.yaml"  # a values file the chart renders as asked


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vllm_stack_dev.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def _ps(name: str) -> Path:
    return require(PS_VALUES / name)


def test_check_prints_what_notes_lists():
    values = _ps("tests__values-01-2pods-minimal-example.yaml")
    release = render_release([values])
    assert release.deviations, "this file has deviations (the router image, a fractional GPU)"
    assert f"\n{DEVIATIONS_HEADER}\n" in f"\n{release.notes}"  # NOTES has them, under its heading
    result = _cli("check", "-f", str(values))
    assert result.returncode == 0, result.stderr
    for line in release.deviations:  # each, ranked, in its short form
        assert f"  {severity_of(line):<7} {shorten(line)}\n" in result.stdout
    result = _cli("check", "--verbose", "-f", str(values))
    for line in release.deviations:
        assert f" {line}\n" in result.stdout
    assert "  differs routerSpec.repository, routerSpec.tag: git-act-router:ci" in result.stdout


def test_check_strict_fails_with_the_charts_message_naming_each_deviation():
    values = _ps("tests__values-01-2pods-minimal-example.yaml")
    deviations = render_release([values]).deviations
    result = _cli("check", "--strict", "-f", str(values))
    assert result.returncode == 1
    assert f"strict: {len(deviations)} deviation(s)" in result.stdout
    for line in deviations:
        assert line in result.stdout
    # the chart's own check, not the command's: helm template refuses the same with strict: true
    proc = subprocess.run(
        [
            str(ROOT / ".tools/helm4/helm"),
            "template",
            "x",
            str(ROOT / "helm"),
            "-f",
            str(values),
            "--set",
            "strict=true",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and f"strict: {len(deviations)} deviation(s)" in proc.stderr


def test_values_without_deviations_pass_strict():
    result = _cli("check", "--strict", "-f", str(CLEAN))
    assert result.returncode == 0, result.stdout
    assert not render_release([CLEAN]).deviations
    assert " breaks " not in result.stdout and "error" not in result.stdout


def test_up_prints_the_same_deviations(tmp_path):
    values = _ps("tests__values-01-2pods-minimal-example.yaml")
    deviations = render_release([values]).deviations
    result = _cli("up", "-f", str(values), "--dry-run", "--log-dir", str(tmp_path), "--max-engines", "2")
    assert result.returncode == 0, result.stderr
    assert "Deviations of the chart (as its NOTES lists them; strict: true refuses each):" in result.stdout
    for line in deviations:
        assert f"  {line}\n" in result.stdout


def test_deviation_lines_are_read_from_below_the_heading_only():
    notes = f"intro\n  not one\n{DEVIATIONS_HEADER}\n  a: b\n  c: d\n\nafter\n  not one either\n"
    assert deviations_in(notes) == ["a: b", "c: d"]
    assert deviations_in("no heading\n  x: y\n") == []


# --- severities (issue 46) -------------------------------------------------------------------------------------


def _all_ps() -> list[Path]:
    return sorted(require(PS_VALUES).glob("*.yaml"))


def test_files_with_only_differs_or_info_lines_pass_the_default_gate():
    """30 of production-stack's files carry the benign unknown-image-tag line: lines that are all `differs` or
    `info` pass `--fail-on breaks` (the default); `--fail-on differs` fails them."""
    values = _ps("tutorials__values-18-prefix-aware.yaml")
    lines = findings([values])
    assert {f.severity for f in lines} <= {"differs", "info"}
    assert any(f.severity == "info" and "is unknown" in f.text for f in lines)
    assert _cli("check", "-f", str(values)).returncode == 0
    assert _cli("check", "--fail-on", "differs", "-f", str(values)).returncode == 1
    passing = [p.name for p in _all_ps() if all(f.severity in ("differs", "info") for f in findings([p]))]
    assert len(passing) >= 28, passing


@pytest.mark.parametrize(
    "name, words",
    [
        ("tutorials__values-16-disagg-prefill.yaml", "older than LMCache 0.5"),
    ],
)
def test_what_will_not_work_breaks_the_default_gate(name, words):
    result = _cli("check", "-f", str(_ps(name)))
    assert result.returncode == 1
    assert any(line.startswith("  breaks ") and words in line for line in result.stdout.splitlines())
    assert _cli("check", "--fail-on", "info", "-f", str(_ps(name))).returncode == 1


def test_lines_are_short_and_refusals_lose_helms_prefix():
    for name in ("tutorials__values-16-disagg-prefill.yaml", "tests__values-11-monitoring.yaml"):
        out = _cli("check", "-f", str(_ps(name))).stdout.splitlines()
        assert all(len(line) <= SHORT + 10 for line in out), max(out, key=len)
    result = _cli(
        "check", "-f", str(_ps("tutorials__values-15-a-minimal-pipeline-parallel-example-raycluster.yaml"))
    )
    assert result.returncode == 1
    assert (
        "  error   values: servingEngineSpec.modelSpec[0] (distilgpt2-raycluster): raySpec" in result.stdout
    )
    assert "INSTALLATION FAILED" not in result.stdout and "execution error at" not in result.stdout


def test_what_the_render_changes_unasked_is_said_as_differs():
    found = {(f.path, f.text.split(" (")[0]) for f in findings([_ps("tests__values-11-monitoring.yaml")])}
    said = " | ".join(f"{p}: {t}" for p, t in found)
    for words in (
        "limitMemory: memory limit",
        "limitCPU: cpu limit",
        "routerSpec: the router Role allows list, watch on pods",
        "routerSpec: the router Service has no port 9000",
        "servingEngineSpec: the engine Services have no ports 55555 and 9999",
        "sets the job label to vllm-stack-engine",
    ):
        assert words in said, words
    lmcache = findings([_ps("tutorials__values-14-vllm-v1.yaml")])
    assert any(f.severity == "differs" and f.text.startswith("VLLM_RPC_TIMEOUT=1000000") for f in lmcache)


def test_the_readme_table_is_the_commands_output():
    readme = (ROOT / "helm/README.md").read_text()
    table = readme_table(_all_ps())
    assert len(table.splitlines()) == 2 + 36
    assert table in readme
