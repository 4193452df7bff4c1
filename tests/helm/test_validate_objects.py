"""Every rendered object validates: built-in kinds against the Kubernetes JSON schemas (kubernetes-validate,
strict: unknown fields are errors) for the oldest supported (1.30) and the newest available version, custom
resources against the upstream CRD schemas in ../shared/crds/ (unknown fields also rejected) and their CEL
rules (`x-kubernetes-validations`, evaluated with cel-python: tests/helm/cel.py)."""

from __future__ import annotations

import copy
import functools

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.helm import cel
from tests.helm.chart import CRDS, file_id, render, values_files
from tests.shared_data import require

pytestmark = pytest.mark.helm

K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


def _strict(schema: dict) -> dict:
    """A CRD openAPIV3Schema as a JSON schema that rejects unknown fields (the API server would prune them)."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            pattern = node.get("pattern")
            if isinstance(pattern, str) and "(?i)" in pattern:  # Go regexp allows inline flags anywhere
                node["pattern"] = "(?i)" + pattern.replace("(?i)", "")
            if node.get("nullable") and "type" in node:
                node["type"] = [node["type"], "null"]
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(schema)
    # metadata is validated by the API server, not by the CRD schema.
    schema.get("properties", {}).get("metadata", {}).pop("additionalProperties", None)
    return schema


@functools.cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    out = {}
    for path in require(CRDS).glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            out[(f"{group}/{version['name']}", kind)] = _strict(version["schema"]["openAPIV3Schema"])
    return out


def validate(obj: dict) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if "/" in obj["apiVersion"] and obj["apiVersion"].split("/")[0].count(".") and key in crd_schemas():
        jsonschema.Draft7Validator(crd_schemas()[key]).validate(obj)
        broken = cel.violations(obj)
        assert not broken, f"{obj['kind']}/{obj['metadata']['name']} breaks its CRD's CEL rules: {broken}"
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


FILES = [None, *values_files()]


@pytest.mark.parametrize("values", FILES, ids=lambda f: "defaults" if f is None else file_id(f))
def test_every_object_validates(values):
    objs = render([] if values is None else [values])
    for obj in objs:
        try:
            validate(obj)
        except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
            raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']}: {exc}") from None
        except kubernetes_validate.SchemaNotFoundError:
            raise AssertionError(
                f"{obj['apiVersion']} {obj['kind']}: no schema (not built in, no CRD in ../shared/crds)"
            ) from None


def test_custom_resources_are_checked_against_their_crds():
    """Guard: the CRD path is really taken for each custom kind the chart renders."""
    kinds = {
        o["kind"]
        for f in values_files()
        for o in render([f])
        if (o["apiVersion"], o["kind"]) in crd_schemas()
    }
    assert kinds == {
        "ScaledObject",
        "ServiceMonitor",
        "PrometheusRule",
        "HTTPRoute",
        "InferencePool",
        "InferenceObjective",
    }


def test_crd_validation_rejects_unknown_fields():
    so = next(o for o in render([values_files()[0].parent / "seed-keda.yaml"]) if o["kind"] == "ScaledObject")
    bad = copy.deepcopy(so)
    bad["spec"]["triggerz"] = []
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)
    bad = copy.deepcopy(so)
    bad["spec"]["triggers"] = {"type": "prometheus"}  # production-stack's fault: triggers as an object
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


def test_every_cel_rule_of_the_crds_compiles():
    """cel-python compiles every x-kubernetes-validations rule (cel.crd_rules raises on the first it cannot);
    only transition rules (oldSelf, checked on update only) are left out."""
    total = 0

    def count(node):
        nonlocal total
        if isinstance(node, dict):
            total += sum("oldSelf" not in r["rule"] for r in node.get("x-kubernetes-validations", []))
            for v in node.values():
                count(v)
        elif isinstance(node, list):
            for v in node:
                count(v)

    for path in require(CRDS).glob("*.yaml"):
        count(yaml.safe_load(path.read_text())["spec"]["versions"])
    assert total > 100 and cel.rule_count() == total


def test_cel_rules_reject_a_redirect_next_to_backend_refs():
    """What the chart rendered for production-stack's httpsRedirect before: the CRD's CEL rule rejects it."""
    route = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": "r"},
        "spec": {
            "parentRefs": [{"name": "gw"}],
            "rules": [
                {
                    "filters": [{"type": "RequestRedirect", "requestRedirect": {"scheme": "https"}}],
                    "backendRefs": [{"name": "router", "port": 80}],
                }
            ],
        },
    }
    assert any("must not be used together with backendRefs" in v for v in cel.violations(route))
    del route["spec"]["rules"][0]["backendRefs"]
    assert cel.violations(route) == []
