"""production-stack's names, side by side: each of its values files is rendered by its own chart (at the
same commit, ../shared/production-stack-chart/) and by ours, and every object its chart renders is rendered by
ours under the same kind and name, with the same selector for Deployments and Services (a Deployment's
selector is immutable: `helm upgrade` from production-stack's chart would fail on a changed one), the same
pod labels at least, the same Secret and ConfigMap keys, the same claims. Ours may add labels, never
selector labels. The few objects of components this chart does not ship are listed with the reason."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    container,
    find,
    flag,
    helm_path,
    render,
    values_files,
)
from tests.shared_data import PS_CHART, PS_VALUES, require

pytestmark = pytest.mark.helm

OUTCOMES = yaml.safe_load((Path(__file__).parent / "data" / "production_stack_outcomes.yaml").read_text())

# Objects production-stack renders that this chart does not, each with the reason (helm/README.md
# "Coming from production-stack").
NOT_SHIPPED = {
    # production-stack's LoRA operator (its controller, RBAC and LoraAdapter resources): the router's
    # adapter registry does its work here (loraAdapters).
    ("Deployment", f"{RELEASE}-lora-controller"): "LoRA operator",
    ("ServiceAccount", f"{RELEASE}-lora-controller"): "LoRA operator",
    ("ClusterRole", f"{RELEASE}-lora-controller"): "LoRA operator",
    ("ClusterRoleBinding", f"{RELEASE}-lora-controller"): "LoRA operator",
    ("ClusterRole", f"{RELEASE}-leader-election-role"): "LoRA operator",
    ("ClusterRoleBinding", f"{RELEASE}-leader-election-rolebinding"): "LoRA operator",
    # production-stack's own Grafana dashboards; this chart ships its own (files/dashboards/), named by the
    # same pattern, <release>-grafana-<file>.
    ("ConfigMap", f"{RELEASE}-grafana-vllm-dashboard"): "dashboards",
    ("ConfigMap", f"{RELEASE}-grafana-vllm-model-metrics-dashboard"): "dashboards",
    ("ConfigMap", f"{RELEASE}-grafana-lmcache-dashboard"): "dashboards",
}
NOT_SHIPPED_KINDS = {"LoraAdapter": "LoRA operator", "RayCluster": "multi-node Ray"}


def _template(chart: Path, values: Path) -> list[dict] | None:
    proc = subprocess.run(
        [str(helm_path("helm4")), "template", RELEASE, str(chart), "-n", NAMESPACE, "-f", str(values)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return [d for d in yaml.safe_load_all(proc.stdout) if d] if proc.returncode == 0 else None


@functools.cache
def both(name: str) -> tuple[list[dict], list[dict]]:
    theirs = _template(require(PS_CHART), require(PS_VALUES / name))
    assert theirs is not None, f"production-stack's chart does not render {name}"
    return theirs, render([PS_VALUES / name])


def rendering() -> list[str]:
    return [name for name, outcome in OUTCOMES.items() if outcome == "renders"]


def _index(objs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


@pytest.mark.parametrize("name", rendering())
def test_every_object_production_stack_renders_is_rendered_under_its_name(name):
    theirs, ours = both(name)
    mine = _index(ours)
    missing = []
    for obj in theirs:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in NOT_SHIPPED or obj["kind"] in NOT_SHIPPED_KINDS:
            continue
        if key not in mine:
            missing.append(key)
    assert not missing, f"{name}: production-stack renders these, this chart does not: {missing}"


def _pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"].get("labels") or {}


@pytest.mark.parametrize("name", rendering())
def test_selectors_labels_keys_and_claims_are_production_stacks(name):
    theirs, ours = both(name)
    mine = _index(ours)
    compared = 0
    for obj in theirs:
        key = (obj["kind"], obj["metadata"]["name"])
        if key not in mine:
            continue  # the test above
        other = mine[key]
        compared += 1
        where = f"{name}: {key[0]}/{key[1]}"
        if obj["kind"] in ("Deployment", "Service"):
            assert other["spec"].get("selector") == obj["spec"].get("selector"), where
        if obj["kind"] == "Deployment":
            # production-stack's pod labels are all there (ours added beside them, none in the selector)
            assert _pod_labels(obj).items() <= _pod_labels(other).items(), where
            pod, other_pod = obj["spec"]["template"]["spec"], other["spec"]["template"]["spec"]
            if "serviceAccountName" in pod:
                assert other_pod.get("serviceAccountName") == pod["serviceAccountName"], where
        if obj["kind"] == "Service":
            first = obj["spec"]["ports"][0]
            ports = {p["name"]: p["port"] for p in other["spec"]["ports"]}
            assert ports.get(first["name"]) == first["port"], (where, other["spec"]["ports"])
        if obj["kind"] in ("Secret", "ConfigMap"):
            assert set(obj.get("data") or {}) <= set(other.get("data") or {}), where
        if obj["kind"] == "PersistentVolumeClaim":
            for field in ("accessModes", "resources", "selector", "storageClassName"):
                assert other["spec"].get(field) == obj["spec"].get(field), (where, field)
        if obj["kind"] == "RoleBinding":
            assert other["subjects"] == obj["subjects"] and other["roleRef"] == obj["roleRef"], where
        if obj["kind"] == "ScaledObject":
            assert other["spec"]["scaleTargetRef"]["name"] == obj["spec"]["scaleTargetRef"]["name"], where
        if obj["kind"] == "PodDisruptionBudget":
            assert other["spec"]["selector"] == obj["spec"]["selector"], where
    assert compared


def test_what_production_stack_renders_and_this_chart_does_not_is_only_what_it_does_not_ship():
    """Guard for the exemptions: each one is rendered by production-stack for some file (else it is stale)."""
    seen = set()
    for name in rendering():
        theirs, _ = both(name)
        seen |= {(o["kind"], o["metadata"]["name"]) for o in theirs}
    stale = {key for key in NOT_SHIPPED if key not in seen and "lmcache-dashboard" not in key[1]}
    assert not stale, stale


def _matches(selector: str, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (kv.split("=", 1) for kv in selector.split(",")))


def _engine_pods(objs: list[dict]) -> list[dict]:
    return [
        d
        for d in find(objs, "Deployment")
        if _pod_labels(d).get("app.kubernetes.io/component") == "serving-engine"
    ]


ALL_FILES = [str(p) for p in values_files()] + [str(PS_VALUES / n) for n in rendering()]


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: Path(p).name)
def test_the_router_discovers_every_engine_of_its_release(path):
    """Our router watches pods with its --k8s-label-selector: every engine pod matches it, nothing else does."""
    if path.startswith(str(PS_VALUES)):
        require(Path(path))
    objs = render([path])
    routers = [
        d for d in find(objs, "Deployment") if _pod_labels(d).get("app.kubernetes.io/component") == "router"
    ]
    for router in routers:
        args = container(router)["args"]
        if flag(args, "--service-discovery") != "k8s":
            continue
        selector = flag(args, "--k8s-label-selector")
        for d in find(objs, "Deployment"):
            is_engine = d in _engine_pods(objs)
            assert _matches(selector, _pod_labels(d)) == is_engine, (d["metadata"]["name"], selector)


def test_the_names_are_those_helm_readme_lists():
    readme = " ".join((CHART / "README.md").read_text().split())
    for name in (
        "<release>-router-service",
        "<release>-deployment-router",
        "<release>-<model>-engine-service",
        "<release>-<model>-deployment-vllm",
        "<release>-<model>-storage-claim",
        "<release>-secrets",
        "hf_token_<model>",
    ):
        assert f"`{name}`" in readme, name
