"""The committed dashboards are what the code generates, and they follow the conventions every panel
relies on (datasource variable, namespace/model/engine variables, label names)."""

from __future__ import annotations

import re

import pytest

from .promql import CHART_DASHBOARDS, committed_dashboards, load_build_module, panel_queries

build = load_build_module()

EXPECTED = {"overview.json", "router.json", "lmcache.json"}


def test_committed_files_are_not_stale() -> None:
    """Regenerate in memory; fail when the chart's copy differs (run observability/dashboards/build.py)."""
    rendered = build.render()
    stale = [str(path) for path, text in rendered.items() if not path.exists() or path.read_text() != text]
    assert not stale, (
        f"stale generated files, run `.venv/bin/python observability/dashboards/build.py`: {stale}"
    )
    assert {p.name for p in CHART_DASHBOARDS.glob("*.json")} == EXPECTED, (
        "unexpected files in the chart's dashboards"
    )


def test_check_mode_reports_stale(tmp_path) -> None:
    assert build.main(["--check", "--out", str(tmp_path)]) == 1


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_template_variables(name: str) -> None:
    dashboard = committed_dashboards()[name]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "namespace", "model", "engine"}
    # Grafana keys its variable state by id: ids must be unique (the SDK's default is one zero UUID).
    assert [v["id"] for v in variables.values()] == list(variables)
    assert (
        variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    )
    for var in ("model", "engine"):
        assert variables[var]["multi"] and variables[var]["includeAll"] and variables[var]["allValue"] == ".*"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_no_hard_coded_datasource(name: str) -> None:
    dashboard = committed_dashboards()[name]
    uids = set(re.findall(r'"uid":\s*"([^"]*)"', CHART_DASHBOARDS.joinpath(name).read_text()))
    assert uids <= {"${datasource}", dashboard["uid"]}, uids
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel.get("targets") or []:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_queries_follow_label_conventions(name: str) -> None:
    queries = panel_queries(name, committed_dashboards()[name])
    assert queries
    for q in queries:
        assert 'namespace="$namespace"' in q.expr, q
        # vLLM series carry model_name (never model); the router's carry model (never model_name).
        for selector in re.findall(r"(vllm:\w+)\{([^}]*)\}", q.expr):
            assert "model_name" in selector[1] and "model=" not in selector[1].replace("model=~", "X"), q
        for selector in re.findall(r"(vllm_stack_router_\w+)\{([^}]*)\}", q.expr):
            assert "model_name" not in selector[1], q
        # vLLM's own `engine` label is the data-parallel rank: engine series are filtered by pod.
        for selector in re.findall(r"(?:vllm|lmcache):\w+\{([^}]*)\}", q.expr):
            assert "engine=" not in selector.replace("engine=~", "engine=") or "pod=" in selector, q
            assert 'engine=~"$engine"' not in selector, q


def test_overview_has_the_required_panels() -> None:
    titles = {p["title"] for p in committed_dashboards()["overview.json"]["panels"]}
    for required in (
        "Request rate by model",
        "Errors by model",
        "Time to first token",
        "Inter-token latency",
        "End-to-end request latency",
        "Running requests per engine",
        "Waiting requests per engine",
        "KV cache utilisation",
        "Prefix-cache hit rate",
        "Token throughput",
        "Engines up",
    ):
        assert required in titles
    ttft = next(
        p for p in committed_dashboards()["overview.json"]["panels"] if p["title"] == "Time to first token"
    )
    exprs = [t["expr"] for t in ttft["targets"]]
    for q in ("0.5", "0.9", "0.99"):
        assert any(
            e.startswith(f"histogram_quantile({q}, ") and "rate(vllm:time_to_first_token_seconds_bucket" in e
            for e in exprs
        )
