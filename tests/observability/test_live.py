"""Every query we ship, executed against a real Prometheus scraping real vLLM engines and the real router.

Set-up (module scope): the session's two real vLLM CPU engines (`engines` fixture), the real router in
front of them, and Prometheus (Debian package) scraping all three every second with the rule file
loaded. Targets get the labels the chart's ServiceMonitors give them in Kubernetes: `namespace`, `pod`
(for engines the pod is the engine's `host:port`, which is what the router's `engine` label holds under
static discovery, as the pod name is under Kubernetes discovery) and `job` (`vllm-stack-engine`,
`vllm-stack-router`).

Traffic through the router: non-streamed and streamed chat completions, a long prompt repeated (prefix
cache hits on whole 128-token blocks), one request the engine rejects (HTTP 400), requests that hit
a failing backend, and requests for `cold-model`, a model the router is configured to serve (router
setting `models`) that has no engine: they wait in the router's priority queue for `queue_timeout`
(2 s here) and get 503 `queue_timeout`, and a sheddable one sent while they wait is shed (429). That is
what the priority-queue panels, the queue-timeout alert and the KEDA activation trigger (scale from
zero) have to show; it runs beside the other traffic, so it adds no time.

The failing backend is the one stand-in here: a real engine cannot be made to answer 503 on demand, so a
small HTTP server registered as a third static backend lists the models `tiny-llama` and
`broken-model`, answers every POST with 503 and its /metrics with 500. That drives the router's real
failure paths (retries, circuit breaker, scrape errors, 5xx for a model no healthy engine can serve),
whose panels and alerts would otherwise have no data to show. It is not scraped by Prometheus.

Then every dashboard panel target (template variables substituted), every dashboard variable query,
every recording rule, every alert and the KEDA and prometheus-adapter queries go through the HTTP API:
each must parse and return data. Alerts are checked on the query they compare with their threshold
(`alert_base`): the full expression is empty whenever the system is healthy, which is the normal state.
LMCache panels are exempt: LMCache's vLLM connector needs its CUDA extension and cannot run on CPU, so
no engine here exports `lmcache:*` series; their queries are still parsed.

Artifacts (git-ignored `artifacts/`): `observability-queries.json` (every query and what it returned)
and `overview.png` (the overview dashboard's key panels rendered from this data with matplotlib).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from vllm_stack_dev.testbed.collector import Collector
from vllm_stack_dev.testbed.engines import stop_process

from .promql import (
    REPO,
    RULES,
    Prometheus,
    Query,
    Target,
    adapter_query,
    alert_base,
    chart_keda_queries,
    committed_dashboards,
    free_port,
    keda_query,
    label_values_as_promql,
    panel_queries,
    rule_queries,
    substitute,
    variable_queries,
)

pytestmark = [pytest.mark.engine, pytest.mark.prometheus]

NAMESPACE = "vllm-test"
MODEL = "tiny-llama"
BROKEN_MODEL = "broken-model"
# Configured in the router (setting `models`) with no engine: its requests wait in the router's queue.
COLD_MODEL = "cold-model"
QUEUE_TIMEOUT = 2  # seconds (router setting queue_timeout)
ARTIFACTS = REPO / "artifacts"
# Grafana picks $__rate_interval from the time range; any window covering the traffic will do here.
RATE_INTERVAL = "3m"
# No engine exports lmcache:* on CPU (see the module docstring).
EXEMPT_DASHBOARDS = {"lmcache.json"}


# ---------------------------------------------------------------------------------------------- fixtures
class FailingBackend:
    """The stand-in for a failing engine (see the module docstring)."""

    def __init__(self) -> None:
        models = {
            "object": "list",
            "data": [{"id": m, "object": "model", "owned_by": "vllm"} for m in (MODEL, BROKEN_MODEL)],
        }
        body_models = json.dumps(models).encode()

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, status: int, body: bytes = b"{}") -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                if self.path.startswith("/v1/models"):
                    self._reply(200, body_models)
                elif self.path.startswith("/health"):
                    self._reply(200)
                else:
                    self._reply(500, b'{"error": "metrics unavailable"}')

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                self._reply(503, b'{"error": {"message": "overloaded", "type": "ServiceUnavailable"}}')

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _router_command() -> list[str]:
    script = Path(sys.executable).parent / "vllm-stack"
    if script.exists():
        return [str(script), "router"]
    return [sys.executable, "-c", "import sys; from vllm_stack.cli import main; sys.exit(main())", "router"]


class Router:
    def __init__(self, backends: list[str], log_dir: Path, traces_endpoint: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / "router.log"
        # The served models (only YAML can give them): COLD_MODEL has no engine, so its requests wait in
        # the router's queue (scale from zero) and, with nothing to wake it here, time out.
        config = log_dir / "router.yaml"
        config.write_text(
            json.dumps({"models": [{"name": MODEL}, {"name": COLD_MODEL}], "queue_timeout": QUEUE_TIMEOUT})
        )  # JSON is YAML
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = _router_command() + [
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--config", str(config),
            "--service-discovery", "static",
            "--static-backends", ",".join(backends),
            "--engine-scrape-interval", "1",
            "--health-check-interval", "1",
            "--otlp-traces-endpoint", traces_endpoint,
            "--batch-api", "--batch-dir", str(log_dir / "batch"),  # the dashboard's Batch API row
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"router did not become ready:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.3)

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


LONG_PROMPT = " ".join(
    f"Rule {i}: every engine reports its queue, its cache and its latency to the router and to Prometheus."
    for i in range(40)
)


def queue_length(router_url: str, model: str) -> float:
    """The router's gauge of the requests waiting in its queue for ``model`` (0 when it has none)."""
    found = re.search(
        rf'^vllm_stack_router_queue_length{{model="{re.escape(model)}"}} (\S+)$',
        httpx.get(router_url + "/metrics", timeout=10).text,
        re.MULTILINE,
    )
    return float(found.group(1)) if found else 0.0


def drive_traffic(router_url: str) -> dict[str, int]:
    """Send the test's traffic through the router; returns status counts per kind of request."""
    statuses: dict[str, int] = {}
    lock = threading.Lock()

    def chat(kind: str, body: dict, headers: dict[str, str] | None = None) -> None:
        with httpx.Client(base_url=router_url, timeout=120, headers=headers) as client:
            if body.get("stream"):
                with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                    for _ in resp.iter_bytes():
                        pass
                    status = resp.status_code
            else:
                resp = client.post("/v1/chat/completions", json=body)
                status = resp.status_code
                if kind == "cold" and status == 503:  # the router's queue timeout, not another 503
                    status = f"503 {resp.json()['error'].get('code')}"
        key = f"{kind} {status}"
        with lock:
            statuses[key] = statuses.get(key, 0) + 1

    def body(content: str, *, stream: bool = False, model: str = MODEL, max_tokens: int = 24) -> dict:
        return {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": stream,
        }

    def cold_wave() -> None:
        """Two requests for COLD_MODEL wait in the router's queue until they time out (503
        queue_timeout); a sheddable one sent while they wait is shed at once (429)."""
        with ThreadPoolExecutor(2) as waiting:
            queued = [
                waiting.submit(chat, "cold", body(f"Wake up {i}.", model=COLD_MODEL, max_tokens=8))
                for i in range(2)
            ]
            deadline = time.monotonic() + 30
            while queue_length(router_url, COLD_MODEL) < 2:  # both wait in the router's queue
                assert time.monotonic() < deadline, "the cold model's requests were not queued"
                time.sleep(0.05)
            chat(
                "shed", body("Shed me.", model=COLD_MODEL, max_tokens=8), {"x-request-priority": "sheddable"}
            )
            for f in queued:
                f.result()

    jobs = []
    for i in range(12):
        jobs.append(("plain", body(f"Say something about request {i}.")))
        jobs.append(("stream", body(f"Stream something about request {i}.", stream=True, max_tokens=48)))
    for i in range(6):
        jobs.append(("prefix", body(LONG_PROMPT + " Summarise.", stream=i % 2 == 0)))
    with ThreadPoolExecutor(8) as pool, ThreadPoolExecutor(1) as side:
        # Three waves a few seconds apart, so that rates and quantiles span several scrapes. The failures
        # repeat in every wave: a counter series is born at its first increment, which rate() cannot see.
        for _wave in range(3):
            # Beside the wave (a wave takes far longer than QUEUE_TIMEOUT): no time added.
            cold = side.submit(cold_wave)
            list(pool.map(lambda job: chat(*job), jobs))
            # Rejected by the engine: more tokens than the model's context (HTTP 400).
            chat("bad", body("too long", max_tokens=100_000))
            # Only the failing backend serves it: the router answers 503.
            list(pool.map(lambda _: chat("broken", body("hello", model=BROKEN_MODEL)), range(2)))
            time.sleep(4)
            cold.result()
    return statuses


@pytest.fixture(scope="module")
def stack(engines, tmp_path_factory) -> Iterator[dict]:
    log_dir = tmp_path_factory.mktemp("observability-live")
    failing = FailingBackend()
    collector = Collector(log_dir / "collector").start()  # the router's traces: the exemplars' targets
    router = Router(
        [e.url for e in engines] + [f"http://{failing.address}"], log_dir, collector.grpc_endpoint
    )
    targets = [
        Target("vllm-stack-engine", e.address, {"namespace": NAMESPACE, "pod": e.address}) for e in engines
    ] + [Target("vllm-stack-router", f"127.0.0.1:{router.port}", {"namespace": NAMESPACE, "pod": "router-0"})]
    prom = Prometheus(targets, [RULES], log_dir, exemplars=True)
    try:
        # Two scrapes of every target before the traffic, so that counters start from their idle values.
        prom.wait_for({"count(count_over_time(up[1m]) >= 2)": len(targets)})
        started = time.time()
        statuses = drive_traffic(router.url)
        ended = time.time()
        # Every query is evaluated at one instant `at`, when every target has been scraped since the
        # traffic ended and its last scrape succeeded (a failed scrape would mark its series stale),
        # once every rule group has been evaluated since.
        at = prom.wait_for(
            {
                f"count(timestamp(up) > {ended:.3f})": len(targets),
                'count(up{job="vllm-stack-engine"} == 1)': len(engines),
                'count(up{job="vllm-stack-router"} == 1)': 1,
                f'count(vllm:num_requests_running{{namespace="{NAMESPACE}"}})': len(engines),
            }
        )
        prom.wait_rules_evaluated_after(at)
        yield {
            "at": at,
            "prom": prom,
            "router": router,
            "engines": list(engines),
            "failing": failing,
            "started": started,
            "ended": ended,
            "statuses": statuses,
            "log_dir": log_dir,
            "collector": collector,
        }
    finally:
        prom.stop()
        router.stop()
        failing.stop()
        collector.stop()


# ---------------------------------------------------------------------------------------------- checks
def _values(answer: dict) -> list[float]:
    result = answer["data"]["result"]
    if answer["data"]["resultType"] == "scalar":
        return [float(result[1])]
    return [float(s["value"][1]) for s in result]


def _run(prom: Prometheus, queries: list[Query], at: float) -> tuple[list[dict], list[str]]:
    """Execute queries at `at`; returns the record of each and the failures (parse error, no data, only NaN)."""
    records, failures = [], []
    for q in queries:
        answer = prom.query(q.expr, at=at)
        record = {"kind": q.kind, "name": q.name, "expr": q.expr, "status": answer["status"]}
        if answer["status"] != "success":
            record["error"] = answer.get("error")
            failures.append(f"{q.name}: {answer.get('errorType')}: {answer.get('error')}\n    {q.expr}")
        else:
            values = _values(answer)
            record["series"] = len(values)
            record["values"] = [
                {**s.get("metric", {}), "value": s["value"][1]} for s in answer["data"]["result"][:6]
            ]
            if not values:
                failures.append(f"{q.name}: no data\n    {q.expr}")
            elif all(math.isnan(v) for v in values):
                failures.append(f"{q.name}: only NaN\n    {q.expr}")
        records.append(record)
    return records, failures


def _save(name: str, records: list[dict]) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "observability-queries.json"
    existing = json.loads(path.read_text()) if path.exists() else {}
    existing[name] = records
    path.write_text(json.dumps(existing, indent=1, sort_keys=True))


def _variable_values() -> dict[str, str]:
    return {
        "namespace": NAMESPACE,
        # Both models selected in the multi-value $model (Grafana renders that as a regex group):
        # COLD_MODEL has only router series, among them the priority-queue ones.
        "model": f"({MODEL}|{COLD_MODEL})",
        "engine": ".*",  # "All"
        "__rate_interval": RATE_INTERVAL,
        "datasource": "unused",
    }


def test_traffic_went_through(stack) -> None:
    statuses = stack["statuses"]
    assert statuses.get("plain 200", 0) == 36 and statuses.get("stream 200", 0) == 36, statuses
    assert statuses.get("bad 400") == 3, statuses
    assert statuses.get("broken 503") == 6, statuses
    assert statuses.get("cold 503 queue_timeout") == 6, statuses
    assert statuses.get("shed 429") == 3, statuses
    prom = stack["prom"]
    up = prom.query("up", stack["at"])["data"]["result"]
    assert len(up) == len(stack["engines"]) + 1 and all(s["value"][1] == "1" for s in up), prom.diagnostics()


def test_ttft_exemplars_in_prometheus_lead_to_the_requests_traces(stack) -> None:
    """The router's TTFT histogram carries the trace id of traced requests as exemplars (OpenMetrics);
    a real Prometheus with exemplar storage keeps them, and each names a trace the collector holds:
    the router's server span of a streamed request, with its engine leg. What a dashboard's exemplar
    link opens is that trace."""
    prom, collector = stack["prom"], stack["collector"]
    answer = prom.query_exemplars(
        f'vllm_stack_router_ttft_seconds_bucket{{namespace="{NAMESPACE}"}}',
        stack["started"] - 60,
        stack["at"],
    )
    assert answer["status"] == "success", answer
    trace_ids = {e["labels"]["trace_id"] for series in answer["data"] for e in series["exemplars"]}
    assert trace_ids, answer

    def servers(spans: list) -> dict[str, object]:
        return {s.trace_id: s for s in spans if s.service == "vllm-stack-router" and s.kind == "server"}

    spans = collector.wait_for(lambda spans: trace_ids <= set(servers(spans)))
    for trace_id in trace_ids:
        server = servers(spans)[trace_id]
        assert server.attributes["gen_ai.request.stream"] is True, server  # TTFT is a streamed request's
        assert any(
            s.trace_id == trace_id and s.kind == "client" and s.parent_id == server.span_id for s in spans
        )


def test_dashboard_panels_return_data(stack) -> None:
    prom = stack["prom"]
    values = _variable_values()
    failures, exempt, records = [], [], []
    for name, dashboard in committed_dashboards().items():
        queries = [Query(q.kind, q.name, substitute(q.expr, values)) for q in panel_queries(name, dashboard)]
        recs, fails = _run(prom, queries, stack["at"])
        records += recs
        if name in EXEMPT_DASHBOARDS:
            # LMCache cannot run on CPU: its queries must parse, and have no data to return here.
            exempt += [f for f in fails if "no data" not in f]
        else:
            failures += fails
    _save("panels", records)
    assert not exempt, "LMCache queries failed to parse:\n" + "\n".join(exempt)
    assert not failures, (
        f"{len(failures)} panel queries without data:\n" + "\n".join(failures) + "\n" + prom.diagnostics()
    )


def test_dashboard_variables_return_values(stack) -> None:
    prom = stack["prom"]
    values = _variable_values()
    failures, records = [], []
    for name, dashboard in committed_dashboards().items():
        queries = []
        for q in variable_queries(name, dashboard):
            expr, _label = label_values_as_promql(substitute(q.expr, values))
            queries.append(Query(q.kind, q.name, expr))
        recs, fails = _run(prom, queries, stack["at"])
        records += recs
        if name not in EXEMPT_DASHBOARDS:
            failures += fails
    _save("variables", records)
    assert not failures, "\n".join(failures)


def test_engine_variable_joins_engine_and_router_series(stack) -> None:
    """`$engine` lists engine pods; the router labels the same engines with the same values."""
    prom = stack["prom"]
    at = stack["at"]
    pods = {
        s["metric"]["pod"]
        for s in prom.query(f'count by (pod) (vllm:num_requests_running{{namespace="{NAMESPACE}"}})', at)[
            "data"
        ]["result"]
    }
    routed = {
        s["metric"]["engine"]
        for s in prom.query(
            f'count by (engine) (vllm_stack_router_requests_total{{namespace="{NAMESPACE}", model="{MODEL}"}})',
            at,
        )["data"]["result"]
    }
    assert pods == {e.address for e in stack["engines"]}
    assert pods <= routed, (pods, routed)


def test_rules_evaluate_and_return_data(stack) -> None:
    prom = stack["prom"]
    health = prom.rule_health()
    assert health and set(health.values()) == {"ok"}, health
    queries = []
    for q in rule_queries():
        if q.kind == "record":
            queries.append(q)  # the recording rule's expression...
            queries.append(Query("recorded", q.name, q.name))  # ...and the series it records
        else:
            queries.append(Query("alert", q.name, alert_base(q.expr)))
    records, failures = _run(prom, queries, stack["at"])
    _save("rules", records)
    assert not failures, "\n".join(failures)


def test_keda_and_adapter_queries_return_one_element_per_model(stack) -> None:
    prom, at = stack["prom"], stack["at"]
    models = {
        s["metric"]["model_name"]
        for s in prom.query(
            f'count by (model_name) (vllm:num_requests_waiting{{namespace="{NAMESPACE}"}})', at
        )["data"]["result"]
    }
    assert models == {MODEL}
    records = []
    for model in sorted(models):
        for kind, expr in (
            ("keda", keda_query(model, NAMESPACE)),
            ("adapter", adapter_query(model, NAMESPACE)),
        ):
            answer = prom.query(expr, at)
            assert answer["status"] == "success", answer
            result = answer["data"]["result"]
            records.append({"kind": kind, "model": model, "expr": expr, "result": result})
            assert len(result) == 1, (kind, expr, result)
            assert not math.isnan(float(result[0]["value"][1]))
    # The chart's ScaledObject triggers, as it renders them: the queue trigger (one element where the
    # model has engines; nothing at zero replicas, which KEDA's ignoreNullValues, true by default,
    # counts as 0) and the activation trigger that wakes a model from zero replicas (always one element,
    # above 0 for COLD_MODEL: requests for it arrived and waited in the router's queue).
    for model in (MODEL, COLD_MODEL):
        for name, expr in chart_keda_queries(model, NAMESPACE).items():
            answer = prom.query(expr, at)
            assert answer["status"] == "success", answer
            result = answer["data"]["result"]
            records.append({"kind": f"chart {name}", "model": model, "expr": expr, "result": result})
            if name == "router-requests":
                assert len(result) == 1, (name, model, expr, result)
                value = float(result[0]["value"][1])
                assert value > 0 if model == COLD_MODEL else not math.isnan(value), (name, model, result)
            else:
                assert len(result) == (1 if model == MODEL else 0), (name, model, expr, result)
    _save("autoscaling", records)


# ---------------------------------------------------------------------------------------------- picture
KEY_PANELS = (
    "Time to first token",
    "Request rate by model",
    "Running requests per engine",
    "Waiting requests per engine",
    "KV cache utilisation",
    "Token throughput",
)


def test_render_overview_png(stack) -> None:
    """The overview's key panels from this run's data (query_range), as a picture: artifacts/overview.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prom = stack["prom"]
    values = _variable_values() | {"__rate_interval": "30s"}
    panels = {p["title"]: p for p in committed_dashboards()["overview.json"]["panels"]}
    start, end = stack["started"] - 5, stack["at"]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, title in zip(axes.flat, KEY_PANELS, strict=True):
        panel = panels[title]
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        scale, unit = {"percentunit": (100, "%"), "reqps": (1, "req/s"), "short": (1, "")}.get(
            unit, (1, unit)
        )
        plotted = 0
        for target in panel["targets"]:
            expr = substitute(target["expr"], values)
            answer = prom.query_range(expr, start, end, 2)
            assert answer["status"] == "success", (title, answer)
            for series in answer["data"]["result"]:
                xs = [float(t) - start for t, _ in series["values"]]
                ys = [float(v) * scale for _, v in series["values"]]
                label = target["legendFormat"]
                for key, val in series["metric"].items():
                    label = label.replace("{{" + key + "}}", val)
                ax.plot(xs, ys, label=label, linewidth=1.2)
                plotted += 1
        assert plotted, f"nothing to plot for {title}"
        ax.set_title(f"{title} ({unit})" if unit else title, fontsize=10)
        ax.tick_params(labelsize=8)
        ax.set_xlabel("seconds", fontsize=8)
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"vllm-stack overview: real vLLM CPU engines + router, Prometheus query_range (namespace {NAMESPACE})",
        fontsize=11,
    )
    fig.tight_layout()
    ARTIFACTS.mkdir(exist_ok=True)
    out = ARTIFACTS / "overview.png"
    fig.savefig(out, dpi=72)
    plt.close(fig)
    assert out.stat().st_size > 10_000
    if os.environ.get("VLLM_STACK_UPDATE_DOCS_IMAGE"):
        (REPO / "docs" / "images").mkdir(parents=True, exist_ok=True)
        (REPO / "docs" / "images" / "overview.png").write_bytes(out.read_bytes())
