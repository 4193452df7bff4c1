"""routerSpec.extraArgs: this router's flags pass, production-stack's router flags are rendered as ours,
dropped with a NOTES line naming the reason (a deviation: `strict: true` refuses it) or refused at render
time with the reason; anything else is refused as unknown, before the router would exit on it.
helm/files/router-flags.yaml is the table."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.helm.chart import CHART, container, one, render, render_error, router_name, values_file
from tests.helm.test_production_stack_files import compat_lines, manifest_and_notes
from tests.shared_data import PS_CHART, require
from vllm_stack.router_cli import build_parser

pytestmark = pytest.mark.helm

TABLE = yaml.safe_load((CHART / "files" / "router-flags.yaml").read_text())
# production-stack's router flags: its parser (src/vllm_router/parsers/parser.py on production-stack's main,
# read for this table) and the flags its chart's deployment-router.yaml renders at the commit of
# ../shared/production-stack-chart/ (read from the template below, so none can be missed).
PS_PARSER_FLAGS = (
    "--host", "--port", "--service-discovery", "--k8s-service-discovery-type", "--static-backends",
    "--static-models", "--static-aliases", "--static-model-types", "--static-model-labels",
    "--static-backend-health-checks", "--k8s-port", "--k8s-namespace", "--k8s-label-selector",
    "--k8s-watcher-timeout-seconds", "--backend-health-check-timeout-seconds", "--routing-logic",
    "--lmcache-controller-port", "--session-key", "--callbacks", "--request-rewriter", "--enable-batch-api",
    "--file-storage-class", "--file-storage-path", "--batch-processor", "--engine-stats-interval",
    "--request-stats-window", "--log-stats", "--log-stats-interval", "--dynamic-config-yaml",
    "--dynamic-config-json", "--version", "--feature-gates", "--log-level", "--sentry-dsn",
    "--sentry-traces-sample-rate", "--sentry-profile-session-sample-rate", "--otel-endpoint",
    "--otel-service-name", "--otel-secure", "--prefill-model-labels", "--decode-model-labels",
    "--kv-aware-threshold", "--lmcache-health-check-interval", "--lmcache-worker-timeout",
    # added in 2026 (its commit a6c01db; issue 52)
    "--log-format", "--root-path", "--prefix-min-match-length", "--max-instance-failover-reroute-attempts",
)  # fmt: skip


def ps_router_flags() -> set[str]:
    template = (require(PS_CHART) / "templates" / "deployment-router.yaml").read_text()
    return set(PS_PARSER_FLAGS) | set(re.findall(r'"(--[a-z][a-z0-9-]+)"', template))


def _router_args(tmp_path, extra: list[str]) -> list[str]:
    objs = render([values_file(tmp_path, {"routerSpec": {"extraArgs": extra}})])
    return container(one(objs, "Deployment", router_name()))["args"]


def test_the_table_lists_exactly_this_routers_flags():
    parser = build_parser()
    flags = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--") and opt != "--help":
                flags[opt] = "value" if action.nargs != 0 else "switch"
    assert TABLE["ours"] == flags


def test_every_production_stack_router_flag_is_known():
    known = set(TABLE["ours"]) | set(TABLE["productionStack"])
    assert not ps_router_flags() - known, sorted(ps_router_flags() - known)


@pytest.mark.parametrize("flag", sorted(TABLE["productionStack"]))
def test_each_production_stack_flag_is_mapped_dropped_or_refused(tmp_path, flag):
    entry = TABLE["productionStack"][flag]
    words = [flag] if entry["takes"] == "switch" else [flag, "7"]
    values = {"routerSpec": {"extraArgs": words}}
    if "as" in entry:
        args = _router_args(tmp_path, words)
        assert args[-2:] == [entry["as"], "7"] and flag not in args
        build_parser().parse_args(args)
        return
    for value, reason in (entry.get("dropValues") or {}).items():
        objs, notes = manifest_and_notes({"routerSpec": {"extraArgs": [flag, value]}})
        assert flag not in container(one(objs, "Deployment", router_name()))["args"]
        assert f"{flag} {value} not rendered: {reason}" in compat_lines(notes)[("routerSpec.extraArgs",)]
    for value, reason in (entry.get("refuseValues") or {}).items():
        err = render_error([values_file(tmp_path, {"routerSpec": {"extraArgs": [flag, value]}})])
        assert flag in err and reason in err
    if "drop" in entry:
        objs, notes = manifest_and_notes(values)
        assert flag not in container(one(objs, "Deployment", router_name()))["args"]
        line = compat_lines(notes)[("routerSpec.extraArgs",)]
        assert line.startswith(flag) and entry["drop"] in line
    if "refuse" in entry:
        err = render_error([values_file(tmp_path, values)])
        assert flag in err and entry["refuse"] in err and "schema" not in err


def test_this_routers_own_flags_pass_as_given(tmp_path):
    args = _router_args(tmp_path, ["--retries", "4", "--access-log", "--debug-headers", "--queue-timeout=30"])
    assert args[-5:] == ["--retries", "4", "--access-log", "--debug-headers", "--queue-timeout=30"]
    build_parser().parse_args(args)


def test_production_stacks_2026_flags_reach_the_router(tmp_path):
    """--log-format, --prefix-min-match-length, --root-path and --max-instance-failover-reroute-attempts
    in extraArgs are this router's flags, rendered as given (refused or dropped before)."""
    given = ["--log-format", "json", "--max-instance-failover-reroute-attempts", "1"]
    given += ["--prefix-min-match-length", "512", "--root-path", "/vllm"]
    args = _router_args(tmp_path, given)
    assert args[-len(given) :] == given
    parsed = build_parser().parse_args(args)
    assert (parsed.log_format, parsed.retries, parsed.prefix_min_match_length) == ("json", 1, 512)


def test_routing_logic_priority_is_rendered(tmp_path):
    """production-stack's routingLogic: priority (merged after its commit a6c01db) reaches the router."""
    objs = render([values_file(tmp_path, {"routerSpec": {"routingLogic": "priority"}})])
    args = container(one(objs, "Deployment", router_name()))["args"]
    assert args[args.index("--routing-logic") + 1] == "priority"
    assert build_parser().parse_args(args).routing_logic == "priority"


def test_root_path_is_rendered_and_the_probes_follow_it(tmp_path):
    """production-stack's routerSpec.rootPath: --root-path, and the kubelet's probes under it (the router
    serves both; the probes' paths say the prefix is served)."""
    objs = render([values_file(tmp_path, {"routerSpec": {"rootPath": "/vllm"}})])
    main = container(one(objs, "Deployment", router_name()))
    assert main["args"][main["args"].index("--root-path") + 1] == "/vllm"
    build_parser().parse_args(main["args"])
    assert main["livenessProbe"]["httpGet"]["path"] == "/vllm/health"
    assert main["startupProbe"]["httpGet"]["path"] == "/vllm/health"
    assert main["readinessProbe"]["httpGet"]["path"] == "/vllm/ready"
    (tmp_path / "plain").mkdir()
    plain = container(one(render([values_file(tmp_path / "plain", {})]), "Deployment", router_name()))
    assert "--root-path" not in plain["args"] and plain["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_stream_continuation_is_on_unless_the_values_turn_it_off(tmp_path):
    """routerSpec.streamContinuation: false renders --no-stream-continuation; the default renders nothing
    (the router's default is on)."""
    objs = render([values_file(tmp_path, {"routerSpec": {"streamContinuation": False}})])
    args = container(one(objs, "Deployment", router_name()))["args"]
    assert build_parser().parse_args(args).stream_continuation is False
    (tmp_path / "plain").mkdir()
    plain = container(one(render([values_file(tmp_path / "plain", {})]), "Deployment", router_name()))["args"]
    assert (
        "--no-stream-continuation" not in plain
        and build_parser().parse_args(plain).stream_continuation is not False
    )


@pytest.mark.parametrize(
    "extra, word", [(["--bogus"], "--bogus"), (["stray"], "stray"), (["--log-stats", "x"], "x")]
)
def test_unknown_flags_and_stray_words_are_refused_before_the_router_would_exit(tmp_path, extra, word):
    err = render_error([values_file(tmp_path, {"routerSpec": {"extraArgs": extra}})])
    assert word in err and "routerSpec.extraArgs" in err


def test_strict_refuses_a_dropped_flag(tmp_path):
    err = render_error(
        [values_file(tmp_path, {"strict": True, "routerSpec": {"extraArgs": ["--log-stats"]}})]
    )
    assert "strict: 1 deviation(s)" in err and "--log-stats not rendered" in err
