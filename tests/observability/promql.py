"""Helpers for the observability tests: every query we ship, and a real Prometheus to run them on.

The queries are taken from what is committed, not re-typed: dashboard panel targets from the
generated JSON, recording and alert rules from the rule file, the KEDA trigger from its example
ScaledObject and from the chart's rendered ScaledObject (queue trigger and scale-from-zero activation
trigger), and the prometheus-adapter rule from its config.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import yaml
from vllm_stack_dev.testbed.engines import stop_process

REPO = Path(__file__).resolve().parents[2]
OBS = REPO / "observability"
RULES = OBS / "prometheus" / "rules.yaml"
RULES_TEST = OBS / "prometheus" / "rules_test.yaml"
CHART_RULES = REPO / "helm" / "files" / "prometheus-rules.yaml"
CHART_DASHBOARDS = REPO / "helm" / "files" / "dashboards"
KEDA_EXAMPLE = OBS / "keda" / "scaledobject.yaml"
ADAPTER_RULES = OBS / "prometheus-adapter" / "rules.yaml"

CHART = REPO / "helm"

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
HELM = str(REPO / ".tools" / "helm4" / "helm")  # `make install` unpacks it (as for tests/helm)


def require(binary: str, how: str = "apt-get install -y prometheus") -> str:
    """The binary's path; fails the test with the fix when it is missing (``make install`` installs it)."""
    import pytest

    if not Path(binary).exists():
        pytest.fail(f"{binary} missing: run `make install` ({how})")
    return binary


def load_build_module():
    """observability/dashboards/build.py, imported by path (observability/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "vllm_stack_dashboards_build", OBS / "dashboards" / "build.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Query:
    kind: str  # "panel", "variable", "record", "alert", "keda", "adapter"
    name: str  # where it comes from, for messages
    expr: str  # as shipped (may hold template variables)


def committed_dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(CHART_DASHBOARDS.glob("*.json"))}


def _panels(dashboard: dict):
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # panels inside collapsed rows


def panel_queries(dashboard_file: str, dashboard: dict) -> list[Query]:
    out = []
    for panel in _panels(dashboard):
        for target in panel.get("targets") or []:
            out.append(
                Query("panel", f"{dashboard_file} / {panel['title']} / {target['refId']}", target["expr"])
            )
    return out


def variable_queries(dashboard_file: str, dashboard: dict) -> list[Query]:
    out = []
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            out.append(Query("variable", f"{dashboard_file} / ${var['name']}", query))
    return out


_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$", re.S)


def label_values_as_promql(query: str) -> tuple[str, str]:
    """Grafana's ``label_values(selector, label)`` as a PromQL query listing the values, and the label."""
    m = _LABEL_VALUES.match(query.strip())
    assert m, f"not a label_values() query: {query}"
    return f"count by ({m['label']}) ({m['selector']})", m["label"]


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace Grafana template variables (``$name`` and ``${name}``) with concrete values."""
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def rule_queries(path: Path = RULES) -> list[Query]:
    out = []
    for group in yaml.safe_load(path.read_text())["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                out.append(Query("record", rule["record"], rule["expr"]))
            else:
                out.append(Query("alert", rule["alert"], rule["expr"]))
    return out


_THRESHOLD = re.compile(
    r"^(?P<base>.+?)\s*(==|!=|>=|<=|>|<)\s*(bool\s+)?[-+]?[0-9.]+(e[-+]?[0-9]+)?\s*$", re.S
)
_ABSENT = re.compile(r"^absent\((?P<inner>.+)\)$", re.S)


def alert_base(expr: str) -> str:
    """The query an alert compares with its threshold.

    Alerts are written as ``<query> <op> <threshold>`` or ``absent(<query>)`` (rules.yaml says so).
    Whether an alert *can* fire depends on ``<query>`` returning series: ``<query>`` is what the live
    test requires to return data, since the full expression is empty whenever the system is healthy.
    """
    expr = " ".join(expr.split())
    if m := _ABSENT.match(expr):
        return m["inner"]
    m = _THRESHOLD.match(expr)
    assert m, f"alert expression not of the form '<query> <op> <threshold>': {expr}"
    return m["base"]


def keda_query(model: str, namespace: str) -> str:
    """The KEDA trigger query of the example ScaledObject, for another model/namespace."""
    doc = yaml.safe_load(KEDA_EXAMPLE.read_text())
    (trigger,) = [t for t in doc["spec"]["triggers"] if t["type"] == "prometheus"]
    query = trigger["metadata"]["query"]
    example_model = re.search(r'model_name="([^"]+)"', query)[1]
    example_ns = doc["metadata"]["namespace"]
    return query.replace(f'model_name="{example_model}"', f'model_name="{model}"').replace(
        f'namespace="{example_ns}"', f'namespace="{namespace}"'
    )


def chart_keda_queries(model: str, namespace: str) -> dict[str, str]:
    """The Prometheus trigger queries of the ScaledObject the chart renders for ``model`` (its served
    name) in ``namespace``, with scale from zero and the activation trigger on: trigger name -> query
    (``queue`` for the unnamed default queue trigger, ``router-requests`` for the activation one)."""
    values = {
        "servingEngineSpec": {
            "modelSpec": [
                {
                    "name": "m",
                    "modelURL": model,
                    "keda": {
                        "enabled": True,
                        "minReplicaCount": 0,
                        "maxReplicaCount": 1,
                        "activation": {"enabled": True},
                    },
                }
            ]
        }
    }
    with tempfile.TemporaryDirectory(prefix="vllm-stack-keda-") as tmp:
        path = Path(tmp) / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        cmd = [
            require(HELM, "unpacks Helm into .tools"),
            "template", "vllm-stack", str(CHART),
            "--namespace", namespace,
            "-f", str(path),
            "--show-only", "templates/engine-scaledobject.yaml",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"helm template failed:\n{proc.stderr}"
    (doc,) = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return {
        t.get("name", "queue"): t["metadata"]["query"]
        for t in doc["spec"]["triggers"]
        if t["type"] == "prometheus"
    }


def adapter_query(model: str, namespace: str) -> str:
    """The prometheus-adapter external rule's metricsQuery as the adapter renders it for an HPA in
    ``namespace`` selecting ``model_name=model``."""
    (rule,) = yaml.safe_load(ADAPTER_RULES.read_text())["external"]
    series = rule["seriesQuery"].split("{", 1)[0]
    return (
        rule["metricsQuery"]
        .replace("<<.Series>>", series)
        .replace("<<.LabelMatchers>>", f'namespace="{namespace}",model_name="{model}"')
        .replace("<<.GroupBy>>", "namespace")
    )


# ---------------------------------------------------------------------------------------------- promtool
def promtool_check_expressions(queries: list[Query], tmp: Path) -> subprocess.CompletedProcess:
    """Parse expressions with ``promtool check rules`` (each becomes a recording rule)."""
    rules = [{"record": f"check:expr_{i}", "expr": q.expr} for i, q in enumerate(queries)]
    path = tmp / "exprs.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "exprs", "rules": rules}]}))
    return subprocess.run([require(PROMTOOL), "check", "rules", str(path)], capture_output=True, text=True)


# ---------------------------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Target:
    job: str
    address: str  # host:port
    labels: dict[str, str]


def rfc3339_seconds(stamp: str) -> float:
    """Unix time of Prometheus' RFC 3339 time stamp (nanosecond digits cut to the microseconds
    ``datetime`` holds)."""
    whole, _, rest = stamp.removesuffix("Z").partition(".")
    return datetime.fromisoformat(whole + "+00:00").timestamp() + float("0." + (rest[:6] or "0"))


class Prometheus:
    """A real Prometheus (Debian package) in a temporary directory, scraping the given targets and
    evaluating ``rule_files`` every ``interval`` (scrape timeout = interval: a vLLM engine's /metrics
    can take over a second on two busy cores, and a failed scrape marks every series of the target
    stale at once)."""

    def __init__(
        self,
        targets: list[Target],
        rule_files: list[Path],
        log_dir: Path | None = None,
        interval: str = "2s",
        exemplars: bool = False,
    ) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="vllm-stack-prom-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        jobs: dict[str, list[dict]] = {}
        for t in targets:
            jobs.setdefault(t.job, []).append({"targets": [t.address], "labels": t.labels})
        config = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": sc} for job, sc in jobs.items()],
        }
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = (log_dir or self.dir) / "prometheus.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                require(PROMETHEUS),
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                *(["--enable-feature=exemplar-storage"] if exemplars else []),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=self.url, timeout=30)
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.client.get("/-/ready").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    def query(self, expr: str, at: float | None = None) -> dict:
        """``/api/v1/query``; returns the whole JSON answer (status, errorType, data)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        return self.client.get("/api/v1/query", params=params).json()

    def query_exemplars(self, expr: str, start: float, end: float) -> dict:
        """``/api/v1/query_exemplars`` (exemplar storage on): the series' exemplars in [start, end]."""
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}"}
        return self.client.get("/api/v1/query_exemplars", params=params).json()

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}"}
        return self.client.get("/api/v1/query_range", params=params).json()

    def targets(self) -> list[dict]:
        return self.client.get("/api/v1/targets").json()["data"]["activeTargets"]

    def targets_up(self) -> dict[str, str]:
        return {t["scrapeUrl"]: t["health"] for t in self.targets()}

    def diagnostics(self) -> str:
        """Target health, last errors and scrape durations, for failure messages."""
        return "\n".join(
            f"  {t['labels'].get('job')} {t['scrapeUrl']}: {t['health']} "
            f"(last scrape {t.get('lastScrapeDuration', 0):.2f}s) {t.get('lastError') or ''}"
            for t in self.targets()
        )

    def wait_for(self, exprs: dict[str, float], timeout: float = 60) -> float:
        """Wait until each expression returns exactly the given single value; returns the time it did."""
        deadline = time.monotonic() + timeout
        while True:
            now = time.time()
            got = {}
            for expr in exprs:
                result = self.query(expr, at=now)["data"]["result"]
                got[expr] = float(result[0]["value"][1]) if len(result) == 1 else None
            if got == exprs:
                return now
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus did not reach {exprs}: {got}\n{self.diagnostics()}")
            time.sleep(0.5)

    def wait_rules_evaluated_after(self, after: float, timeout: float = 60) -> None:
        """Until every rule group's last evaluation is later than ``after`` (Unix time): the groups
        are evaluated one run after another, so every recorded sample up to ``after`` is written."""
        deadline = time.monotonic() + timeout
        while True:
            groups = self.client.get("/api/v1/rules").json()["data"]["groups"]
            if groups and all(rfc3339_seconds(g["lastEvaluation"]) > after for g in groups):
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"rules not evaluated after {after}: {[g['lastEvaluation'] for g in groups]}"
                )
            time.sleep(0.5)

    def rule_health(self) -> dict[str, str]:
        groups = self.client.get("/api/v1/rules").json()["data"]["groups"]
        return {r["name"]: r["health"] for g in groups for r in g["rules"]}

    def stop(self) -> None:
        self.client.close()
        stop_process(self.proc)
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
