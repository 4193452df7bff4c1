"""`helm upgrade` with changed values and `helm rollback` on a real API server, with Helm 3 and Helm 4.

One upgrade changes, at once, what users change most: a model's replica count and image tag, a model
added, the routing logic. Each change is then read back from the API server (never from Helm's record),
and the rollback to revision 1 must undo each; `helm uninstall` then leaves only what is annotated
`helm.sh/resource-policy: keep`. The cases run four at a time, as the installs do.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.releases import Helm, place, wait_workloads_ready

from tests import shared_data
from tests.cluster.cases import ConcurrentCases, helm_matrix, selected
from tests.cluster.test_install import NODE_PORTS, RELEASE, discard, fresh_namespace, uninstall_and_check
from tests.helm.chart import CHART, EXAMPLES, ROOT, engine_name, flag, router_name

pytestmark = pytest.mark.cluster

#: The production-stack files the issue names (the GKE example, kv-aware, disaggregated) and two more
#: kinds of release: LoRA adapters, session routing.
PRODUCTION_STACK_FILES = (
    "tutorials__gke-example__values-01-offload-kv-cache-local-disk.yaml",
    "tests__values-09-kvaware-routing.yaml",
    "tests__values-10-disagg-prefill.yaml",
    "tutorials__values-09-lora-helm.yaml",
    "tests__values-06-session-routing.yaml",
)
ADDED_MODEL = "added"
NEW_TAG = "v0.32.1"


def upgrade_files() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml")) + [shared_data.PS_VALUES / name for name in PRODUCTION_STACK_FILES]


def file_id(path: Path) -> str:
    return path.name if path.parent == shared_data.PS_VALUES else str(path.relative_to(ROOT))


def enabled_models(values: dict) -> list[dict]:
    engines = values.get("servingEngineSpec") or {}
    return [m for m in engines.get("modelSpec") or [] if m.get("enabled", True)]


def autoscaled(model: dict) -> bool:
    """KEDA owns the model's replica count (the chart's vllm-stack.model.kedaEnabled): no `replicas`."""
    keda = model.get("keda")
    return bool(keda) and str(keda.get("enabled", "")).lower() != "false"


def changed(values: dict) -> tuple[dict, dict[str, object]]:
    """``values`` with the four changes applied, and what each should read back as."""
    new = copy.deepcopy(values)
    models = enabled_models(new)
    expect: dict[str, object] = {}
    routing = (new.get("routerSpec") or {}).get("routingLogic")
    if routing != "disaggregated_prefill":  # its prefill/decode pools need it; changing it is another test
        new.setdefault("routerSpec", {})["routingLogic"] = (
            "roundrobin" if routing != "roundrobin" else "session"
        )
        if new["routerSpec"]["routingLogic"] == "session" and not new["routerSpec"].get("sessionKey"):
            new["routerSpec"]["sessionKey"] = "x-user-id"
        expect["routing"] = new["routerSpec"]["routingLogic"]
    if not models:
        return new, expect
    first = models[0]
    if first.get("replicaCount", 1) and not autoscaled(first):
        first["replicaCount"] = int(first.get("replicaCount", 1)) + 1
        expect["replicas"] = (first["name"], first["replicaCount"])
    first["tag"] = NEW_TAG if first.get("tag") != NEW_TAG else "v0.32.0"
    expect["tag"] = (first["name"], first["tag"])
    added = copy.deepcopy(first)
    added.update(name=ADDED_MODEL, replicaCount=1)
    added.pop("keda", None)
    new["servingEngineSpec"]["modelSpec"].append(added)
    expect["added"] = ADDED_MODEL
    return new, expect


def deployment(cluster: Cluster, namespace: str, name: str) -> dict:
    return cluster.get("deployment", name, "-n", namespace)


def engine_image(cluster: Cluster, namespace: str, model: str) -> str:
    spec = deployment(cluster, namespace, engine_name(model, release=RELEASE))["spec"]
    return spec["template"]["spec"]["containers"][0]["image"]  # type: ignore[index]


def routing_logic(cluster: Cluster, namespace: str) -> str | None:
    spec = deployment(cluster, namespace, router_name(release=RELEASE))["spec"]
    container = spec["template"]["spec"]["containers"][0]  # type: ignore[index]
    return flag(container.get("args", []), "--routing-logic")


def read_back(cluster: Cluster, namespace: str, expect: dict[str, object]) -> dict[str, object]:
    """What the API server holds for each expected change (same keys)."""
    seen: dict[str, object] = {}
    if "routing" in expect:
        seen["routing"] = routing_logic(cluster, namespace)
    if "replicas" in expect:
        model, _ = expect["replicas"]  # type: ignore[misc]
        seen["replicas"] = (
            model,
            deployment(cluster, namespace, engine_name(model, release=RELEASE))["spec"]["replicas"],
        )  # type: ignore[index]
    if "tag" in expect:
        model, _ = expect["tag"]  # type: ignore[misc]
        seen["tag"] = (model, engine_image(cluster, namespace, model).rpartition(":")[2])
    if "added" in expect:
        found = cluster.kubectl(
            "get",
            "deployment",
            engine_name(ADDED_MODEL, release=RELEASE),
            "-n",
            namespace,
            "--ignore-not-found",
            "-o",
            "name",
        ).stdout.strip()
        seen["added"] = ADDED_MODEL if found else None
    return seen


def upgrade_case(cluster: Cluster, values_path: Path, major: int) -> None:
    shared_data.require(values_path)
    helm = Helm(cluster, major)
    namespace = fresh_namespace(f"u{major}")
    values = yaml.safe_load(values_path.read_text()) or {}
    new_values, expect = changed(values)
    with tempfile.TemporaryDirectory(prefix="vllm-stack-upgrade-") as folder:
        new_path = Path(folder) / "changed.yaml"
        new_path.write_text(yaml.safe_dump(new_values))
        # the nodes and nodePorts both revisions need, held for the whole case
        wanted = helm.template(RELEASE, CHART, namespace, values_path) + helm.template(
            RELEASE, CHART, namespace, new_path
        )
        with place(cluster, wanted, namespace, NODE_PORTS):
            try:
                helm.install(RELEASE, CHART, namespace, values_path)
                before = read_back(cluster, namespace, expect)
                wait_workloads_ready(cluster, namespace)

                helm.upgrade(RELEASE, CHART, namespace, new_path)
                assert helm.status(RELEASE, namespace) == ("deployed", 2)
                assert read_back(cluster, namespace, expect) == expect
                wait_workloads_ready(cluster, namespace)

                helm.rollback(RELEASE, namespace, 1)
                assert helm.status(RELEASE, namespace) == ("deployed", 3)
                assert read_back(cluster, namespace, expect) == before
                wait_workloads_ready(cluster, namespace)

                uninstall_and_check(cluster, helm, namespace)
            finally:
                discard(cluster, helm, namespace)


CASES = helm_matrix(upgrade_files(), file_id)


@pytest.fixture(scope="module")
def upgrades(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[ConcurrentCases]:
    chosen = selected(request, "test_upgrade_with_changed_values_then_rollback", ("values_path", "major"))
    cases = ConcurrentCases(lambda case: upgrade_case(cluster, *case), chosen)  # type: ignore[misc]
    yield cases
    cases.close()


@pytest.mark.parametrize(("values_path", "major"), CASES)
def test_upgrade_with_changed_values_then_rollback(
    upgrades: ConcurrentCases, values_path: Path, major: int
) -> None:
    upgrades.result((values_path, major))
