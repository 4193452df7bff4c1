"""Alert and recording rules: promtool checks them and runs their unit tests (one per alert); the
chart's copy is the same file; the examples for KEDA and the PrometheusRule validate against the
upstream CRDs; every shipped expression parses."""

from __future__ import annotations

import subprocess

import jsonschema
import pytest
import yaml

from tests import shared_data

from .promql import (
    CHART_RULES,
    KEDA_EXAMPLE,
    PROMTOOL,
    RULES,
    RULES_TEST,
    Query,
    adapter_query,
    alert_base,
    chart_keda_queries,
    committed_dashboards,
    keda_query,
    label_values_as_promql,
    panel_queries,
    promtool_check_expressions,
    require,
    rule_queries,
    substitute,
    variable_queries,
)

ALERTS = {
    "VllmStackRouterDown",
    "VllmStackRouterAbsent",
    "VllmStackNoHealthyEngine",
    "VllmStackEngineDown",
    "VllmStackEngineRestarted",
    "VllmStackTTFTHigh",
    "VllmStackKVCacheSaturated",
    "VllmStackHighErrorRate",
    "VllmStackRouterQueueTimeouts",
}


def test_chart_copy_is_the_rule_file() -> None:
    assert CHART_RULES.read_text() == RULES.read_text()


def test_every_alert_has_a_unit_test_and_a_base_query() -> None:
    alerts = {q.name: q.expr for q in rule_queries() if q.kind == "alert"}
    assert set(alerts) == ALERTS
    tested = {
        t["alertname"]
        for test in yaml.safe_load(RULES_TEST.read_text())["tests"]
        for t in test.get("alert_rule_test", [])
    }
    assert tested == ALERTS
    for name, expr in alerts.items():
        assert alert_base(expr) != expr, name


def _crd_schema(file: str) -> dict:
    crd = yaml.safe_load(shared_data.require(shared_data.CRDS / file).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v.get("storage")]
    return version["schema"]["openAPIV3Schema"]


def test_prometheusrule_and_scaledobject_validate_against_crds() -> None:
    rule = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "vllm-stack"},
        "spec": yaml.safe_load(CHART_RULES.read_text()),
    }
    # The CRDs carry Go regular expressions (e.g. "(?i)") that are not valid JSON-Schema regexes, so the
    # schemas are used as they are instead of being checked against the meta-schema first.
    for doc, crd in (
        (rule, "monitoring.coreos.com_prometheusrules.yaml"),
        (yaml.safe_load(KEDA_EXAMPLE.read_text()), "keda.sh_scaledobjects.yaml"),
    ):
        errors = [e.message for e in jsonschema.Draft7Validator(_crd_schema(crd)).iter_errors(doc)]
        assert not errors, (crd, errors)


@pytest.mark.prometheus
def test_promtool_check_rules() -> None:
    for path in (RULES, CHART_RULES):
        result = subprocess.run(
            [require(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.prometheus
def test_promtool_unit_tests() -> None:
    result = subprocess.run(
        [require(PROMTOOL), "test", "rules", str(RULES_TEST)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.prometheus
def test_every_shipped_expression_parses(tmp_path) -> None:
    """Dashboard panels and variables (variables substituted), rules, alert base queries, KEDA (the
    example's and the chart's triggers) and adapter queries, parsed by promtool without a server (the
    live test executes them all)."""
    values = {"namespace": "ns", "model": ".*", "engine": ".*", "__rate_interval": "1m", "datasource": "x"}
    queries: list[Query] = []
    for name, dashboard in committed_dashboards().items():
        queries += [Query(q.kind, q.name, substitute(q.expr, values)) for q in panel_queries(name, dashboard)]
        for q in variable_queries(name, dashboard):
            queries.append(Query(q.kind, q.name, label_values_as_promql(substitute(q.expr, values))[0]))
    rules = rule_queries()
    queries += rules + [Query("alert-base", q.name, alert_base(q.expr)) for q in rules if q.kind == "alert"]
    queries += [
        Query("keda", "keda", keda_query("m", "ns")),
        Query("adapter", "adapter", adapter_query("m", "ns")),
    ]
    queries += [Query("keda", f"chart {name}", q) for name, q in chart_keda_queries("m", "ns").items()]
    result = promtool_check_expressions(queries, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
