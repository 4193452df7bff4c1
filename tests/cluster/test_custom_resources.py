"""The chart's custom resources meet their CRDs on the API server, which judges their schemas and CEL rules.

The install tests show that every InferencePool, InferenceObjective, HTTPRoute, ScaledObject,
ServiceMonitor and PrometheusRule the chart renders is accepted. That acceptance means something only if
the API server really evaluates the CRDs' rules (`../shared/crds/`, as their projects publish them), so
here each kind the chart renders passes a server-side dry run, and the same object with one of its CRD's
CEL rules broken is refused with that rule's message; so is one with a field of the wrong type.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.releases import Helm

from tests.helm.chart import CHART, EXAMPLES

pytestmark = pytest.mark.cluster

NAMESPACE = "crd-checks"
#: The examples that, between them, render every custom resource the chart has.
SOURCES = ("monitoring.yaml", "production-stack-style.yaml", "keda-scale-from-zero.yaml")
KINDS = (
    "InferencePool",
    "InferenceObjective",
    "HTTPRoute",
    "ScaledObject",
    "ServiceMonitor",
    "PrometheusRule",
)


@pytest.fixture(scope="module")
def rendered(cluster: Cluster) -> Iterator[dict[str, dict[str, Any]]]:
    """The first object of each custom kind the chart renders from SOURCES, in NAMESPACE."""
    cluster.kubectl("create", "namespace", NAMESPACE)
    helm = Helm(cluster, 3)
    found: dict[str, dict[str, Any]] = {}
    for source in SOURCES:
        for doc in helm.template("vllm", CHART, NAMESPACE, EXAMPLES / source):
            if doc["kind"] in KINDS:
                found.setdefault(doc["kind"], doc)
    yield found
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def dry_run(cluster: Cluster, obj: dict[str, Any]) -> tuple[bool, str]:
    """Server-side apply as a dry run: the API server's whole admission, nothing stored."""
    result = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", "--field-manager=crd-checks", "-f", "-",
        stdin=yaml.safe_dump(obj), check=False,
    )  # fmt: skip
    return result.returncode == 0, result.stderr


def _duplicate_target_port(pool: dict[str, Any]) -> None:
    pool["spec"]["targetPorts"].append(dict(pool["spec"]["targetPorts"][0]))


def _service_picker_without_port(pool: dict[str, Any]) -> None:
    pool["spec"]["endpointPickerRef"]["kind"] = "Service"
    del pool["spec"]["endpointPickerRef"]["port"]


def _backend_without_port(route: dict[str, Any]) -> None:
    del route["spec"]["rules"][0]["backendRefs"][0]["port"]


def _min_above_max(scaled: dict[str, Any]) -> None:
    scaled["spec"]["maxReplicaCount"] = 1
    scaled["spec"]["minReplicaCount"] = 2


def _endpoints_not_a_list(monitor: dict[str, Any]) -> None:
    monitor["spec"]["endpoints"] = "metrics"


def _priority_not_an_integer(objective: dict[str, Any]) -> None:
    objective["spec"]["priority"] = "high"


def _groups_not_a_list(rule: dict[str, Any]) -> None:
    rule["spec"]["groups"] = {"name": "x"}


BROKEN: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("InferencePool", _duplicate_target_port, "port number must be unique"),
    ("InferencePool", _service_picker_without_port, "port is required when kind is 'Service' or unspecified"),
    ("HTTPRoute", _backend_without_port, "Must have port for Service reference"),
    ("ScaledObject", _min_above_max, "minReplicaCount must be less than or equal to maxReplicaCount"),
    ("ServiceMonitor", _endpoints_not_a_list, "spec.endpoints"),
    ("InferenceObjective", _priority_not_an_integer, "spec.priority"),
    ("PrometheusRule", _groups_not_a_list, "spec.groups"),
]


def test_the_chart_renders_every_custom_kind(rendered: dict[str, dict[str, Any]]) -> None:
    assert sorted(rendered) == sorted(KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_each_custom_resource_the_chart_renders_is_accepted(
    cluster: Cluster, rendered: dict[str, dict[str, Any]], kind: str
) -> None:
    accepted, error = dry_run(cluster, rendered[kind])
    assert accepted, error


@pytest.mark.parametrize(
    ("kind", "breaks", "message"), BROKEN, ids=[b.__name__.lstrip("_") for _, b, _ in BROKEN]
)
def test_the_api_server_refuses_what_the_crd_forbids(
    cluster: Cluster,
    rendered: dict[str, dict[str, Any]],
    kind: str,
    breaks: Callable[[dict[str, Any]], None],
    message: str,
) -> None:
    broken = copy.deepcopy(rendered[kind])
    breaks(broken)
    accepted, error = dry_run(cluster, broken)
    assert not accepted, f"the API server took a {kind} its CRD forbids"
    assert message in error, error
