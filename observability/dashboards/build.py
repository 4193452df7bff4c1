"""Generate the vllm-stack Grafana dashboards from code (grafana-foundation-sdk).

The JSON is written where the Helm chart packages it (``helm/files/dashboards/*.json``); nothing else
holds a copy. It also copies the rule file observability/prometheus/rules.yaml to the chart's
``helm/files/prometheus-rules.yaml``. ``tests/observability/test_generated.py`` regenerates in memory
and fails when a committed file differs, so edit this file (or rules.yaml) and run::

    .venv/bin/python observability/dashboards/build.py           # write the JSON (and the rules copy)
    .venv/bin/python observability/dashboards/build.py --check   # exit 1 when stale

Label conventions (see observability/README.md for where they come from):

- engine series (``vllm:*``, ``lmcache:*``) carry ``namespace`` and ``pod`` from the ServiceMonitor and
  ``model_name`` from vLLM. vLLM's own ``engine`` label is the data-parallel index ("0"), so the
  engine replica is identified by ``pod``, never by ``engine``.
- router series (``vllm_stack_router_*``) carry ``namespace`` and ``pod`` (the router replica) from the
  ServiceMonitor, and ``model``/``engine`` from the router, where ``engine`` is the engine's pod name
  (``host:port`` under static discovery). The ``$engine`` variable therefore matches ``pod`` on engine
  series and ``engine`` on router series.

Every panel's datasource is the ``${datasource}`` template variable: no datasource UID is hard-coded.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders import common as gc
from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import prometheus as gp
from grafana_foundation_sdk.builders import stat as gstat
from grafana_foundation_sdk.builders import timeseries as gts
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm

REPO = Path(__file__).resolve().parents[2]
OUT_DIR = REPO / "helm" / "files" / "dashboards"
RULES_SRC = REPO / "observability" / "prometheus" / "rules.yaml"
RULES_CHART = REPO / "helm" / "files" / "prometheus-rules.yaml"

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "$__rate_interval"

# Selectors shared by the panels. ``$model`` and ``$engine`` are multi-value variables with an "All"
# value of ``.*``, hence the regex matchers.
ENG = 'namespace="$namespace", model_name=~"$model", pod=~"$engine"'
RTR = 'namespace="$namespace", model=~"$model"'
RTR_ENG = 'namespace="$namespace", model=~"$model", engine=~"$engine"'
RTR_NS = 'namespace="$namespace"'
LMC = 'namespace="$namespace", served_model_name=~"$model", pod=~"$engine"'

# Router statuses counted as server-side failures (HTTP 5xx, or the engine could not be reached / broke
# the stream). 4xx are the client's fault and are shown on the dashboards, not alerted on.
SERVER_ERROR = 'status=~"5..|upstream_error"'


def _query(expr: str, legend: str, ref: str, exemplars: bool = False) -> gp.Dataquery:
    query = gp.Dataquery().expr(expr).legend_format(legend).ref_id(ref).datasource(DS).range()
    return query.exemplar(True) if exemplars else query


def _targets(panel, queries: list[tuple[str, str]], exemplars: bool = False):
    for i, (expr, legend) in enumerate(queries):
        panel = panel.with_target(_query(expr, legend, chr(ord("A") + i), exemplars))
    return panel


def timeseries(
    title: str,
    description: str,
    unit: str,
    queries: list[tuple[str, str]],
    *,
    width: int = 12,
    height: int = 8,
    min_val: float | None = 0,
    max_val: float | None = None,
    exemplars: bool = False,
) -> gts.Panel:
    panel = (
        gts.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(width)
        .height(height)
        .line_width(1)
        .fill_opacity(10)
        .legend(
            gc.VizLegendOptions()
            .display_mode(cm.LegendDisplayMode.LIST)
            .placement(cm.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(gc.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING))
    )
    if min_val is not None:
        panel = panel.min(min_val)
    if max_val is not None:
        panel = panel.max(max_val)
    return _targets(panel, queries, exemplars)


def stat(
    title: str, description: str, unit: str, queries: list[tuple[str, str]], *, width: int = 6
) -> gstat.Panel:
    panel = (
        gstat.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(width)
        .height(6)
        .reduce_options(gc.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    return _targets(panel, queries)


def quantiles(metric: str, selector: str, by: str, legend_by: str) -> list[tuple[str, str]]:
    """p50/p90/p99 of a histogram: ``histogram_quantile`` over ``rate`` of the buckets."""
    group = f"{by}, le" if by else "le"
    return [
        (
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"p{int(q * 100)} {legend_by}".strip(),
        )
        for q in (0.5, 0.9, 0.99)
    ]


# ---------------------------------------------------------------------------------------------- variables
def datasource_var() -> gd.DatasourceVariable:
    return gd.DatasourceVariable("datasource").id("datasource").label("Data source").type("prometheus")


def query_var(name: str, label: str, query: str, *, multi: bool) -> gd.QueryVariable:
    var = (
        gd.QueryVariable(name)
        .id(name)  # the SDK's default id is the same zero UUID for every variable; Grafana keys state by id
        .label(label)
        .datasource(DS)
        .query({"query": query, "refId": f"{name}-var"})
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
    )
    if multi:
        var = var.multi(True).include_all(True).all_value(".*")
    return var


def variables(ns_metric: str, model_query: str, engine_query: str) -> list:
    return [
        datasource_var(),
        query_var("namespace", "Namespace", f"label_values({ns_metric}, namespace)", multi=False),
        query_var("model", "Model", model_query, multi=True),
        query_var("engine", "Engine", engine_query, multi=True),
    ]


def new_dashboard(uid: str, title: str, description: str, tags: list[str]) -> gd.Dashboard:
    return (
        gd.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["vllm-stack", *tags])
        .editable()
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
    )


# ---------------------------------------------------------------------------------------------- overview
def overview() -> gd.Dashboard:
    d = new_dashboard(
        "vllm-stack-overview",
        "vllm-stack: overview",
        "Traffic, latency and engine load of the models served by vllm-stack (vLLM engine metrics and "
        "router metrics).",
        ["vllm", "overview"],
    ).variables(
        variables(
            "vllm:num_requests_running",
            'label_values(vllm:num_requests_running{namespace="$namespace"}, model_name)',
            'label_values(vllm:num_requests_running{namespace="$namespace", model_name=~"$model"}, pod)',
        )
    )

    d = d.with_row(gd.Row("Traffic"))
    d = d.with_panel(
        timeseries(
            "Request rate by model",
            "Requests per second through the router, by model.",
            "reqps",
            [
                (
                    f"sum by (model) (rate(vllm_stack_router_requests_total{{{RTR}}}[{RATE}]))",
                    "{{model}}",
                )
            ],
            width=9,
        )
    )
    d = d.with_panel(
        timeseries(
            "Errors by model",
            "Non-2xx responses per second by model and status (HTTP code, client_closed, upstream_error).",
            "reqps",
            [
                (
                    f'sum by (model, status) (rate(vllm_stack_router_requests_total{{{RTR}, status!~"2.."}}[{RATE}]))',
                    "{{model}} {{status}}",
                )
            ],
            width=9,
        )
    )
    d = d.with_panel(
        stat(
            "Engines up",
            "Engines per model that Prometheus scrapes successfully, and engines the router considers "
            "healthy (max over router replicas).",
            "short",
            [
                (
                    f"count by (model_name) (vllm:num_requests_running{{{ENG}}} and on (namespace, pod) (up == 1))",
                    "{{model_name}} scraped",
                ),
                (
                    f"sum by (model) (max by (model, engine) (vllm_stack_router_engine_healthy{{{RTR_ENG}}}))",
                    "{{model}} healthy (router)",
                ),
            ],
        )
    )

    d = d.with_row(gd.Row("Latency (engine)"))
    d = d.with_panel(
        timeseries(
            "Time to first token",
            "TTFT p50/p90/p99 measured by the engines.",
            "s",
            quantiles("vllm:time_to_first_token_seconds", ENG, "model_name", "{{model_name}}"),
            width=8,
        )
    )
    d = d.with_panel(
        timeseries(
            "Inter-token latency",
            "Time between consecutive output tokens, p50/p90/p99, measured by the engines.",
            "s",
            quantiles("vllm:inter_token_latency_seconds", ENG, "model_name", "{{model_name}}"),
            width=8,
        )
    )
    d = d.with_panel(
        timeseries(
            "End-to-end request latency",
            "Request latency p50/p90/p99 measured by the engines (queueing included).",
            "s",
            quantiles("vllm:e2e_request_latency_seconds", ENG, "model_name", "{{model_name}}"),
            width=8,
        )
    )

    d = d.with_row(gd.Row("Engine load"))
    d = d.with_panel(
        timeseries(
            "Running requests per engine",
            "Requests in the engine's running batch.",
            "short",
            [(f"sum by (pod) (vllm:num_requests_running{{{ENG}}})", "{{pod}}")],
            width=6,
        )
    )
    d = d.with_panel(
        timeseries(
            "Waiting requests per engine",
            "Requests queued in the engine (the autoscaling signal).",
            "short",
            [(f"sum by (pod) (vllm:num_requests_waiting{{{ENG}}})", "{{pod}}")],
            width=6,
        )
    )
    d = d.with_panel(
        timeseries(
            "KV cache utilisation",
            "Fraction of the engine's KV cache blocks in use (vllm:kv_cache_usage_perc is 0..1).",
            "percentunit",
            [(f"max by (pod) (vllm:kv_cache_usage_perc{{{ENG}}})", "{{pod}}")],
            width=6,
            max_val=1,
        )
    )
    d = d.with_panel(
        timeseries(
            "Prefix-cache hit rate",
            "Prompt tokens found in the engines' prefix cache over prompt tokens looked up.",
            "percentunit",
            [
                (
                    f"sum by (model_name) (rate(vllm:prefix_cache_hits_total{{{ENG}}}[{RATE}]))"
                    f" / sum by (model_name) (rate(vllm:prefix_cache_queries_total{{{ENG}}}[{RATE}]))",
                    "{{model_name}}",
                )
            ],
            width=6,
            max_val=1,
        )
    )
    d = d.with_panel(
        timeseries(
            "Token throughput",
            "Prompt (prefill) and generated tokens per second.",
            "short",
            [
                (
                    f"sum by (model_name) (rate(vllm:prompt_tokens_total{{{ENG}}}[{RATE}]))",
                    "{{model_name}} prompt",
                ),
                (
                    f"sum by (model_name) (rate(vllm:generation_tokens_total{{{ENG}}}[{RATE}]))",
                    "{{model_name}} generation",
                ),
            ],
            width=24,
        )
    )
    return d


# ---------------------------------------------------------------------------------------------- router
def router() -> gd.Dashboard:
    d = new_dashboard(
        "vllm-stack-router",
        "vllm-stack: router",
        "The vllm-stack router: traffic per engine, routing decisions, retries, circuit breakers and "
        "engine health as the router sees them (vllm_stack_router_* metrics).",
        ["router"],
    ).variables(
        variables(
            "vllm_stack_router_build_info",
            # models with an engine, and configured models whose requests wait for one (scale from zero)
            'label_values({__name__=~"vllm_stack_router_engine_healthy|vllm_stack_router_queue_length", '
            'namespace="$namespace"}, model)',
            'label_values(vllm_stack_router_engine_healthy{namespace="$namespace", model=~"$model"}, engine)',
        )
    )

    d = d.with_row(gd.Row("Traffic"))
    d = d.with_panel(
        timeseries(
            "Requests by engine",
            "Requests per second the router sent to each engine.",
            "reqps",
            [
                (
                    f"sum by (engine) (rate(vllm_stack_router_requests_total{{{RTR_ENG}}}[{RATE}]))",
                    "{{engine}}",
                )
            ],
        )
    )
    d = d.with_panel(
        timeseries(
            "Errors by engine",
            "Non-2xx outcomes per second by engine and status (HTTP code, client_closed, upstream_error).",
            "reqps",
            [
                (
                    f'sum by (engine, status) (rate(vllm_stack_router_requests_total{{{RTR_ENG}, status!~"2.."}}[{RATE}]))',
                    "{{engine}} {{status}}",
                )
            ],
        )
    )
    d = d.with_panel(
        timeseries(
            "In-flight requests by engine",
            "Requests the router has open to each engine.",
            "short",
            [
                (
                    f'sum by (engine) (vllm_stack_router_in_flight_requests{{{RTR_NS}, engine=~"$engine"}})',
                    "{{engine}}",
                )
            ],
            width=8,
        )
    )
    d = d.with_panel(
        timeseries(
            "Router-observed latency (p90)",
            "p90 of time to first token, inter-token latency and request duration as the client sees "
            "them through the router.",
            "s",
            [
                (
                    f"histogram_quantile(0.9, sum by (model, le) (rate(vllm_stack_router_{m}_bucket{{{RTR}}}[{RATE}])))",
                    f"{{{{model}}}} {label}",
                )
                for m, label in (
                    ("ttft_seconds", "TTFT"),
                    ("itl_seconds", "ITL"),
                    ("request_duration_seconds", "duration"),
                )
            ],
            width=8,
        )
    )
    d = d.with_panel(
        timeseries(
            "Time to first token, with traces",
            "p50 and p90 TTFT as clients see it through the router. With the router's tracing on "
            "(routerSpec.otel), each point on the curve is an exemplar: the trace_id of a request in that "
            "TTFT bucket; with the chart's Grafana datasource (monitoring.grafanaDatasource.tracesUrl) a "
            "click opens that request's trace, router spans and the engine's.",
            "s",
            [
                (
                    f"histogram_quantile({q}, sum by (model, le) (rate(vllm_stack_router_ttft_seconds_bucket{{{RTR}}}[{RATE}])))",
                    f"{{{{model}}}} p{int(q * 100)}",
                )
                for q in (0.5, 0.9)
            ],
            width=8,
            exemplars=True,
        )
    )
    d = d.with_panel(
        stat(
            "Router replicas by version",
            "Router processes reporting vllm_stack_router_build_info.",
            "short",
            [(f"count by (version) (vllm_stack_router_build_info{{{RTR_NS}}})", "{{version}}")],
            width=8,
        )
    )

    d = d.with_row(gd.Row("Routing"))
    d = d.with_panel(
        timeseries(
            "Decisions by strategy and reason",
            "Routing decisions per second, by strategy and the reason the engine was picked.",
            "ops",
            [
                (
                    f"sum by (strategy, reason) (rate(vllm_stack_router_routing_decisions_total{{{RTR_NS}}}[{RATE}]))",
                    "{{strategy}} {{reason}}",
                )
            ],
        )
    )
    d = d.with_panel(
        timeseries(
            "Routing-decision latency",
            "Time the scheduler takes to pick an engine, p50/p90/p99.",
            "s",
            quantiles("vllm_stack_router_routing_decision_seconds", RTR_NS, "", ""),
        )
    )
    d = d.with_panel(
        timeseries(
            "Retries",
            "Requests retried on another engine (nothing had reached the client yet), by model and reason.",
            "ops",
            [
                (
                    f"sum by (model, reason) (rate(vllm_stack_router_retries_total{{{RTR}}}[{RATE}]))",
                    "{{model}} {{reason}}",
                )
            ],
            width=8,
        )
    )

    d = d.with_row(gd.Row("Engine health"))
    d = d.with_panel(
        timeseries(
            "Circuit breakers",
            "Circuit-breaker state per engine: 0 closed, 1 half-open, 2 open (max over router replicas).",
            "short",
            [
                (
                    f'max by (engine) (vllm_stack_router_circuit_breaker_state{{{RTR_NS}, engine=~"$engine"}})',
                    "{{engine}}",
                )
            ],
            width=8,
            max_val=2,
        )
    )
    d = d.with_panel(
        timeseries(
            "Engine health",
            "1 when the router considers the engine healthy for the model, 0 otherwise (min over router "
            "replicas).",
            "short",
            [
                (
                    f"min by (engine, model) (vllm_stack_router_engine_healthy{{{RTR_ENG}}})",
                    "{{engine}} {{model}}",
                )
            ],
            width=8,
            max_val=1,
        )
    )
    d = d.with_panel(
        timeseries(
            "Engine metric scrape errors",
            "Failed scrapes of the engines' /metrics by the router (its load signal goes stale).",
            "ops",
            [
                (
                    f'sum by (engine) (rate(vllm_stack_router_engine_scrape_errors_total{{{RTR_NS}, engine=~"$engine"}}[{RATE}]))',
                    "{{engine}}",
                )
            ],
            width=8,
        )
    )

    d = d.with_row(gd.Row("Priority queue"))
    d = d.with_panel(
        timeseries(
            "Queue length by model",
            "Requests waiting in the router's per-model queue: every engine of the model is saturated, "
            "or the model has no ready engine yet (scale from zero). Summed over router replicas.",
            "short",
            [(f"sum by (model) (vllm_stack_router_queue_length{{{RTR}}})", "{{model}}")],
            width=6,
        )
    )
    d = d.with_panel(
        timeseries(
            "Queue wait by class (p50, p99)",
            "Time requests spent in the router's queue, by criticality class (critical, standard, "
            "sheddable), observed when they left it for any reason (dispatched, timed out, ...).",
            "s",
            [
                (
                    f"histogram_quantile({q}, sum by (class, le) (rate(vllm_stack_router_queue_wait_seconds_bucket{{{RTR}}}[{RATE}])))",
                    f"p{int(q * 100)} {{{{class}}}}",
                )
                for q in (0.5, 0.99)
            ],
            width=6,
        )
    )
    d = d.with_panel(
        timeseries(
            "Queue exits by outcome",
            "Requests per second leaving the router's queue, by model and outcome: dispatched to an "
            "engine, timeout (503 queue_timeout), client_closed, displaced (429: a full queue made room "
            "for a higher priority), failed.",
            "reqps",
            [
                (
                    f"sum by (model, outcome) (rate(vllm_stack_router_queue_exits_total{{{RTR}}}[{RATE}]))",
                    "{{model}} {{outcome}}",
                )
            ],
            width=6,
        )
    )
    d = d.with_panel(
        timeseries(
            "Shed requests (429) by model",
            "Requests per second answered 429 by model: sheddable requests refused while every engine "
            "was saturated (or requests of higher priority were queued), and full queues.",
            "reqps",
            [
                (
                    f'sum by (model) (rate(vllm_stack_router_requests_total{{{RTR}, status="429"}}[{RATE}]))',
                    "{{model}}",
                )
            ],
            width=6,
        )
    )

    # Tenants (docs/tenants.md): `tenant` is bounded (declared names, default, other).
    d = d.with_row(gd.Row("Tenants"))
    d = d.with_panel(
        timeseries(
            "Queue wait by tenant (p50, p99)",
            "Time requests spent in the router's queue by tenant and priority class (band), observed when "
            "they left it for any reason. Within a band tenants leave in turn, weighted: a quiet tenant's "
            "wait stays short beside a noisy one.",
            "s",
            [
                (
                    f"histogram_quantile({q}, sum by (tenant, class, le) (rate(vllm_stack_router_tenant_queue_wait_seconds_bucket{{{RTR}}}[{RATE}])))",
                    f"p{int(q * 100)} {{{{tenant}}}} {{{{class}}}}",
                )
                for q in (0.5, 0.99)
            ],
            width=8,
        )
    )
    d = d.with_panel(
        timeseries(
            "Rejections by tenant and reason",
            "Requests per second turned away, by tenant and reason: queue_full (429), queue_timeout (429; "
            "503 when the model has no engine), rate_limited (429), evicted (503). Each answer names its "
            "reason in x-llm-d-request-dropped-reason.",
            "reqps",
            [
                (
                    f"sum by (tenant, reason) (rate(vllm_stack_router_tenant_rejections_total{{{RTR_NS}}}[{RATE}]))",
                    "{{tenant}} {{reason}}",
                )
            ],
            width=8,
        )
    )
    d = d.with_panel(
        timeseries(
            "Queue departures by tenant",
            "Requests per second that left the router's queue by tenant (any outcome): under saturation "
            "their ratio within a band follows the tenants' weights.",
            "reqps",
            [
                (
                    f"sum by (tenant) (rate(vllm_stack_router_tenant_queue_wait_seconds_count{{{RTR}}}[{RATE}]))",
                    "{{tenant}}",
                )
            ],
            width=8,
        )
    )

    # The Batch API (/v1/files, /v1/batches; routerSpec.batch): its series have no model or engine label.
    d = d.with_row(gd.Row("Batch API"))
    d = d.with_panel(
        timeseries(
            "Batches by status",
            "Batches in each status: validating, in_progress, finalizing, completed, failed, expired, "
            "cancelling, cancelled: the batch store's figures, which every router replica reports (max "
            "over them).",
            "short",
            [(f"max by (status) (vllm_stack_router_batches{{{RTR_NS}}})", "{{status}}")],
            width=8,
        )
    )
    d = d.with_panel(
        timeseries(
            "Batch lines by outcome",
            "Batch lines per second, summed over router replicas: completed, failed, and retried (shed "
            "by the router under load and sent again later).",
            "ops",
            [
                (
                    f"sum by (outcome) (rate(vllm_stack_router_batch_lines_total{{{RTR_NS}}}[{RATE}]))",
                    "{{outcome}}",
                )
            ],
            width=8,
        )
    )
    d = d.with_panel(
        timeseries(
            "Batch queue depth and lines in flight",
            "Batch lines waiting to be sent in every running batch (the batch store's figure, which "
            "every router replica reports: max over them), and the lines each replica has sent and awaits "
            "(at most its --batch-concurrency).",
            "short",
            [
                (f"max (vllm_stack_router_batch_queue_depth{{{RTR_NS}}})", "waiting"),
                (f"sum by (pod) (vllm_stack_router_batch_lines_in_flight{{{RTR_NS}}})", "{{pod}} in flight"),
            ],
            width=8,
        )
    )
    return d


# ---------------------------------------------------------------------------------------------- LMCache
def lmcache() -> gd.Dashboard:
    """LMCache 0.5.x metrics (``lmcache/observability.py``), exported through the vLLM engine's /metrics.

    Counters are created as ``lmcache:<name>`` with prometheus_client, which exposes them as
    ``lmcache:<name>_total``. Their labels are ``model_name`` (the model *path*), ``served_model_name``,
    ``worker_id`` and ``role``, so the model filter matches ``served_model_name``.
    """
    d = new_dashboard(
        "vllm-stack-lmcache",
        "vllm-stack: LMCache",
        "LMCache KV-cache offloading: hits, local CPU cache, retrieve/store throughput and remote backend "
        "errors (LMCache 0.5.x metrics exported by the vLLM engines).",
        ["lmcache"],
    ).variables(
        variables(
            "lmcache:num_requested_tokens_total",
            'label_values(lmcache:num_requested_tokens_total{namespace="$namespace"}, served_model_name)',
            'label_values(lmcache:num_requested_tokens_total{namespace="$namespace", served_model_name=~"$model"}, pod)',
        )
    )
    d = d.with_row(gd.Row("Hits"))
    d = d.with_panel(
        timeseries(
            "Hit tokens vs requested tokens",
            "Tokens requested from LMCache and tokens found in it, per second.",
            "short",
            [
                (
                    f"sum by (served_model_name) (rate(lmcache:num_requested_tokens_total{{{LMC}}}[{RATE}]))",
                    "{{served_model_name}} requested",
                ),
                (
                    f"sum by (served_model_name) (rate(lmcache:num_hit_tokens_total{{{LMC}}}[{RATE}]))",
                    "{{served_model_name}} hit",
                ),
            ],
        )
    )
    d = d.with_panel(
        timeseries(
            "Token hit ratio",
            "Hit tokens over requested tokens.",
            "percentunit",
            [
                (
                    f"sum by (served_model_name) (rate(lmcache:num_hit_tokens_total{{{LMC}}}[{RATE}]))"
                    f" / sum by (served_model_name) (rate(lmcache:num_requested_tokens_total{{{LMC}}}[{RATE}]))",
                    "{{served_model_name}}",
                )
            ],
            max_val=1,
        )
    )
    d = d.with_row(gd.Row("Local cache and throughput"))
    d = d.with_panel(
        timeseries(
            "Local CPU cache usage",
            "Bytes held in LMCache's local CPU backend, per engine.",
            "bytes",
            [(f"sum by (pod) (lmcache:local_cache_usage{{{LMC}}})", "{{pod}}")],
            width=8,
        )
    )
    d = d.with_panel(
        timeseries(
            "Retrieve / store requests",
            "Retrieve and store requests per second, and tokens stored per second.",
            "ops",
            [
                (
                    f"sum by (pod) (rate(lmcache:num_retrieve_requests_total{{{LMC}}}[{RATE}]))",
                    "{{pod}} retrieve",
                ),
                (f"sum by (pod) (rate(lmcache:num_store_requests_total{{{LMC}}}[{RATE}]))", "{{pod}} store"),
                (
                    f"sum by (pod) (rate(lmcache:num_stored_tokens_total{{{LMC}}}[{RATE}]))",
                    "{{pod}} stored tokens",
                ),
            ],
            width=8,
        )
    )
    d = d.with_panel(
        timeseries(
            "Retrieve / store speed (p50)",
            "Median retrieve and store speed in tokens per second.",
            "short",
            [
                (
                    f"histogram_quantile(0.5, sum by (le) (rate(lmcache:{m}_bucket{{{LMC}}}[{RATE}])))",
                    label,
                )
                for m, label in (("retrieve_speed", "retrieve"), ("store_speed", "store"))
            ],
            width=8,
        )
    )
    d = d.with_row(gd.Row("Remote backend"))
    d = d.with_panel(
        timeseries(
            "Remote backend errors",
            "Failed pings of the remote backend (e.g. the lm:// cache server) per second, and the latest "
            "ping error code.",
            "short",
            [
                (
                    f"sum by (pod) (rate(lmcache:remote_ping_errors_total{{{LMC}}}[{RATE}]))",
                    "{{pod}} errors/s",
                ),
                (f"max by (pod) (lmcache:remote_ping_error_code{{{LMC}}})", "{{pod}} last error code"),
            ],
        )
    )
    d = d.with_panel(
        timeseries(
            "Remote read / write throughput",
            "Bytes per second read from and written to the remote backend.",
            "Bps",
            [
                (
                    f"sum by (pod) (rate(lmcache:num_remote_read_bytes_total{{{LMC}}}[{RATE}]))",
                    "{{pod}} read",
                ),
                (
                    f"sum by (pod) (rate(lmcache:num_remote_write_bytes_total{{{LMC}}}[{RATE}]))",
                    "{{pod}} write",
                ),
            ],
        )
    )
    return d


DASHBOARDS: dict[str, Callable[[], gd.Dashboard]] = {
    "overview.json": overview,
    "router.json": router,
    "lmcache.json": lmcache,
}


def _number_panels(model: dict) -> dict:
    """Give every panel a stable id (the SDK leaves them unset)."""
    for i, panel in enumerate(model.get("panels", []), start=1):
        panel["id"] = i
    return model


def render_dashboards() -> dict[str, dict]:
    """File name -> dashboard model (plain JSON data)."""
    return {
        name: _number_panels(json.loads(json.dumps(factory().build(), cls=JSONEncoder)))
        for name, factory in DASHBOARDS.items()
    }


def render(out_dir: Path = OUT_DIR) -> dict[Path, str]:
    """Every generated file -> its text, exactly as committed: the dashboards, and the chart's copy of
    the rule file (observability/prometheus/rules.yaml is the source)."""
    out = {
        out_dir / name: json.dumps(model, indent=2, sort_keys=True) + "\n"
        for name, model in render_dashboards().items()
    }
    out[RULES_CHART] = RULES_SRC.read_text()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed JSON is stale")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="output directory")
    args = parser.parse_args(argv)

    stale = []
    for path, text in render(args.out).items():
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("stale (run observability/dashboards/build.py):\n  " + "\n  ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
