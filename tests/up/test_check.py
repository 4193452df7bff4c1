"""`vllm-stack check` and `vllm-stack up` say every deviation the chart makes, the lines its NOTES.txt
lists (the chart computes them once, `vllm-stack.deviations`), and `--strict` turns them into the chart's
own refusal: what a GitOps pipeline rendering with `helm template` would otherwise never see."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
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
    printed = [line.strip() for line in result.stdout.splitlines()[1:]]
    assert printed == release.deviations
    assert any(
        line.startswith("routerSpec.repository, routerSpec.tag: git-act-router:ci") for line in printed
    )


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
    assert "No deviations" in result.stdout


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
