"""Every values file installs on a real API server, with Helm 3 and with Helm 4 (server-side apply).

What only an API server judges is checked here: admission, server-side apply's field ownership (which
refuses, for one, two env entries of the same name), immutable fields, CRD schemas and their CEL rules.
Each file gets its own namespace; after the install every object of the manifest exists, the Deployments'
Pods are scheduled onto kwok nodes and Running and Ready, and `helm uninstall` leaves only what is
annotated `helm.sh/resource-policy: keep`.

Where a file pins its Pods to nodes (a GPU product, a host name, a label of its own), a kwok node with
those labels is added first, as the user's cluster has it (vllm_stack_dev.cluster.placement). The cases
run four at a time (tests/cluster/cases.py); each test reports its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.releases import Helm, existing, place, wait_workloads_ready

from tests import shared_data
from tests.cluster.cases import ConcurrentCases, KeyedLocks, helm_matrix, selected
from tests.helm.chart import CHART, EXAMPLES, ROOT, TUTORIALS

pytestmark = pytest.mark.cluster

RELEASE = "vllm"  # production-stack's documented release name; its files' URLs assume it
OUTCOMES = ROOT / "tests" / "helm" / "data" / "production_stack_outcomes.yaml"
_namespaces = itertools.count()


def rendering_production_stack_files() -> list[Path]:
    outcomes = yaml.safe_load(OUTCOMES.read_text())
    return [shared_data.PS_VALUES / name for name, outcome in outcomes.items() if outcome == "renders"]


def every_values_file() -> list[Path]:
    return (
        sorted(EXAMPLES.glob("*.yaml"))
        + sorted(TUTORIALS.glob("*.yaml"))
        + rendering_production_stack_files()
    )


def file_id(path: Path) -> str:
    return path.name if path.parent == shared_data.PS_VALUES else str(path.relative_to(ROOT))


def fresh_namespace(prefix: str) -> str:
    return f"{prefix}-{next(_namespaces)}"


def uninstall_and_check(cluster: Cluster, helm: Helm, namespace: str) -> None:
    """`helm uninstall` leaves only objects annotated keep; the namespace then goes."""
    manifest = helm.manifest(RELEASE, namespace)
    helm.uninstall(RELEASE, namespace)
    left = existing(cluster, manifest)
    assert all(ref.keep for ref in left), f"left after uninstall without the keep annotation: {left}"


def discard(cluster: Cluster, helm: Helm, namespace: str) -> None:
    """Whatever a case left (it may have failed half-way): its release and namespace, so that the
    nodePorts and nodes it held are free for the next case."""
    helm.run("uninstall", RELEASE, "-n", namespace, "--ignore-not-found", check=False)
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found", check=False)


#: An SGLang model beside a vLLM one (engineKind: sglang): not a chart example, since `vllm-stack up`, which
#: runs every example, cannot run SGLang here (tests/up/test_plan.py shows its refusal).
SGLANG_VALUES = ROOT / "tests" / "helm" / "data" / "sglang-beside-vllm.yaml"
CASES = helm_matrix([*every_values_file(), SGLANG_VALUES], file_id)
NODE_PORTS = KeyedLocks()


def install_case(cluster: Cluster, values: Path, major: int) -> None:
    shared_data.require(values)
    helm = Helm(cluster, major)
    namespace = fresh_namespace(f"h{major}")
    with place(cluster, helm.template(RELEASE, CHART, namespace, values), namespace, NODE_PORTS):
        try:
            helm.install(RELEASE, CHART, namespace, values)
            assert helm.status(RELEASE, namespace) == ("deployed", 1)
            manifest = helm.manifest(RELEASE, namespace)
            missing = set(manifest) - set(existing(cluster, manifest))
            assert not missing, (
                f"objects of the manifest the API server does not hold: {sorted(missing, key=str)}"
            )
            wait_workloads_ready(cluster, namespace)
            uninstall_and_check(cluster, helm, namespace)
        finally:
            discard(cluster, helm, namespace)


@pytest.fixture(scope="module")
def installs(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[ConcurrentCases]:
    chosen = selected(request, "test_every_values_file_installs_runs_and_uninstalls", ("values", "major"))
    cases = ConcurrentCases(lambda case: install_case(cluster, *case), chosen)  # type: ignore[misc]
    yield cases
    cases.close()


@pytest.mark.parametrize(("values", "major"), CASES)
def test_every_values_file_installs_runs_and_uninstalls(
    installs: ConcurrentCases, values: Path, major: int
) -> None:
    installs.result((values, major))
