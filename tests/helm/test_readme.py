"""helm/README.md's parameter tables are generated from the `## @param` comments of helm/values.yaml by
@bitnami/readme-generator-for-helm (npm, installed under .tools/node): regenerate and compare."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helm.chart import CHART, ROOT

pytestmark = pytest.mark.helm

GENERATOR = ROOT / ".tools" / "node" / "node_modules" / ".bin" / "readme-generator"


def test_readme_parameters_are_in_sync(tmp_path):
    if not GENERATOR.exists() or not shutil.which("node"):
        pytest.fail(
            "readme-generator or node missing: run `make install` (npm installs"
            " @bitnami/readme-generator-for-helm into .tools/node)"
        )
    readme = tmp_path / "README.md"
    shutil.copy(CHART / "README.md", readme)
    proc = subprocess.run(
        [str(GENERATOR), "--values", str(CHART / "values.yaml"), "--readme", str(readme)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr  # also fails on a value without @param
    assert readme.read_text() == (CHART / "README.md").read_text(), (
        "helm/README.md is out of date: run .tools/node/node_modules/.bin/readme-generator "
        "--values helm/values.yaml --readme helm/README.md"
    )
