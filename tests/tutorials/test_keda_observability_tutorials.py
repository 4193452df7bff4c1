"""tutorials/02-autoscaling-keda.md and tutorials/09-observability.md, run as written, on the one stack
both start with the same command (`vllm-stack up --prometheus`: real vLLM engine, router and
Prometheus with the chart's rules). 09's steps run while 02's stack is up, then 02's KEDA step.

KEDA itself cannot run here (no Kubernetes API): its ScaledObject is rendered by the chart, and each
trigger's query is evaluated on the real Prometheus scraping the local stack, as KEDA would. Grafana
cannot run here either: the dashboards' panel queries are run on the same Prometheus. The only
substitutions: the ports 8000 and 9090 are free ports, /tmp/vllm-stack-tutorial the test's folder.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from vllm_stack_dev.up.run import READY_LINE

from tests.tutorials.render_checks import check_render
from tests.tutorials.runner import ROOT, TutorialRun, tutorial_env, tutorial_port
from tests.tutorials.test_stack_tutorials import STACK_READY_TIMEOUT_S

pytestmark = [pytest.mark.engine, pytest.mark.helm, pytest.mark.prometheus]

CHART_RULES = ROOT / "helm" / "files" / "prometheus-rules.yaml"


def test_keda_and_observability_tutorials(tmp_path: Path) -> None:
    port = tutorial_port()
    common = dict(
        replacements={
            "8000": str(port),
            "9090": str(tutorial_port()),
            "/tmp/vllm-stack-tutorial": str(tmp_path / "t"),
        },
        env=tutorial_env(),
        port=port,
        log_dir=tmp_path,
        server_step="stack",
        ready_timeout=STACK_READY_TIMEOUT_S,
        ready_line=READY_LINE,
    )
    keda = TutorialRun(ROOT / "tutorials" / "02-autoscaling-keda.md", **common)
    observability = TutorialRun(ROOT / "tutorials" / "09-observability.md", server_running=True, **common)
    (keda_stack,) = [s for s in keda.steps if s.name == "stack"]
    (obs_stack,) = [s for s in observability.steps if s.name == "stack"]
    assert keda_stack.code == obs_stack.code, "09 says it uses 02's stack: the same command"

    out = keda.run_all(after_server_start=lambda _url: observability.run_all())
    obs = observability.outputs

    assert keda.names == ["render", "stack", "keda"]
    check_render("02-autoscaling-keda.md", out["render"][0])
    queue, activation = out["keda"][0].splitlines()
    assert queue == "queue: 1 element, value 0, threshold 5, inactive"
    assert activation.startswith("router-requests: 1 element, value ") and activation.endswith(", active")

    check_render("09-observability.md", obs["render"][0])
    rules = [r for g in yaml.safe_load(CHART_RULES.read_text())["groups"] for r in g["rules"]]
    alerts = [r["alert"] for r in rules if "alert" in r]
    summary, *states = obs["rules"][0].splitlines()
    assert summary.endswith(f"{len(rules) - len(alerts)} recording rules, {len(alerts)} alerts")
    assert sorted(states) == sorted(f"  {name} inactive ok" for name in alerts)
    dashboards = obs["dashboards"][0].splitlines()
    for title in (
        "Request rate by model",
        "Engines up",
        "Time to first token",
        "Running requests per engine",
    ):
        assert f"{title} has data: True" in dashboards, dashboards
