"""`helm lint --strict` and `helm template` with Helm 3 and Helm 4 for every values file and edge case."""

from __future__ import annotations

import pytest

from tests.helm.chart import file_id, render, run_helm, values_files

pytestmark = pytest.mark.helm

HELMS = ["helm3", "helm4"]
FILES = [None, *values_files()]  # None: the chart's defaults alone


def _ids(f):
    return "defaults" if f is None else file_id(f)


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("values", FILES, ids=_ids)
def test_lint_strict(helm, values):
    args = ["lint", "--strict", ".", "--namespace", "llm"] + ([] if values is None else ["-f", str(values)])
    proc = run_helm(helm, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("helm", HELMS)
@pytest.mark.parametrize("values", FILES, ids=_ids)
def test_template_renders_objects(helm, values):
    objs = render([] if values is None else [values], helm=helm)
    assert objs, "nothing rendered"
    for o in objs:
        assert {"apiVersion", "kind", "metadata"} <= o.keys(), o
        assert o["metadata"].get("name"), o


@pytest.mark.parametrize("values", FILES, ids=_ids)
def test_helm3_and_helm4_render_the_same(values):
    vals = [] if values is None else [values]
    assert render(vals, helm="helm3") == render(vals, helm="helm4")


def test_example_files_cover_the_edge_cases():
    names = {f.stem for f in values_files()}
    for case in [
        "seed-mistral",
        "seed-keda",
        "no-models",
        "disabled-model",
        "multi-model",
        "lora",
        "cache-server",
        "pd-roles",
        "keda-scale-from-zero",
        "monitoring",
    ]:
        assert case in names, case


@pytest.mark.parametrize("helm", HELMS)
def test_kubernetes_130_or_newer(helm):
    assert run_helm(helm, "template", "x", ".", "--kube-version", "1.30.0").returncode == 0
    old = run_helm(helm, "template", "x", ".", "--kube-version", "1.29.0")
    assert old.returncode != 0 and "kubeVersion" in old.stderr
