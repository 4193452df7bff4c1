"""``vllm-stack check -f values.yaml``: what the chart would do differently from what the values ask, ranked.

The chart computes its deviations once (``vllm-stack.deviations`` in helm/templates/_compat.tpl): NOTES.txt
lists them, and ``strict: true`` turns them into a failed render. This command renders the release as
``helm install --dry-run=client`` does (no cluster needed) and prints that list, so that whoever renders
with ``helm template`` (Argo CD, Flux) sees what only NOTES would have said; ``--strict`` renders with
``strict=true``, so the verdict is the chart's own.

Every line gets a severity (issue 46), for GitOps gates (``--fail-on``, default ``breaks``):

- ``error``: the chart refuses the values;
- ``breaks``: it renders, but the workload will not start or will not work as the file meant;
- ``differs``: it works, but not as production-stack's chart would (limits added, labels renamed, ports removed);
- ``info``: said for the record (keys ignored harmlessly, behaviour equal to production-stack's).

The chart's lines are ranked by ``RULES`` (the first match; the last rule, the catch-all, makes the rest
``differs``: a new chart line is "not as production-stack" until ranked otherwise). Besides them, the command
says what the render changes without any key asking (``unasked``): limits production-stack would not set,
``HF_HOME``, dropped environment variables, the ServiceMonitor ``job`` label, the router Role's verbs, removed
Service ports.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import yaml

from vllm_stack_dev.up.render import NAMESPACE, RELEASE, RenderError, render_release

SEVERITIES = ("error", "breaks", "differs", "info")
#: a finding's most characters as printed (after its severity column: ~160 a line), unless --verbose
SHORT = 150

#: (severity, regular expression searched in a chart deviation line), first match wins.
RULES: list[tuple[str, str]] = [
    # the workload will not start, or not work as the file meant
    ("breaks", r"older than LMCache 0\.5"),
    ("breaks", r"--enable-sleep-mode without VLLM_SERVER_DEV_MODE=1"),
    ("breaks", r"\.chatTemplate: --chat-template .* as given; the file must be in the image"),
    ("info", r"with routingLogic \S+ this chart deploys no controller, so it stays off"),
    # said for the record: production-stack's behaviour, or a key that asks for nothing here
    ("info", r"\.tag: the vLLM release of .* is unknown"),
    ("info", r"\.keda: off: the block has no enabled: true"),
    ("info", r"is not deployed \(|no model is deployed"),
    ("info", r"production-stack's pre-0\.5 PD keys, rendered in LMCache 0\.5's names"),
    ("info", r"\.enablePD: implied by the model's role"),
    ("info", r"\.pvcMatchLabels: the model's PVC selects"),
    ("info", r"the engines report to the chart's LMCache controller"),
    ("info", r"KEDA owns the replica count"),
    ("info", r"not bundled: install prometheus-community"),
    ("info", r"routerSpec\.enablePD: the router runs with --disaggregation"),
    ("info", r"routingLogic: disaggregated_prefill_orchestrated rendered as disaggregated_prefill"),
    ("info", r"\.vllmConfig\.v1: nothing to set"),
    ("info", r"no memory limit rendered"),
    ("info", r": (ignored|not used|not deployed|not rendered|unused)\b"),
    ("info", r"enabled: false, not registered"),
    ("info", r"rendered \(LMCACHE_P2P_\*\) as production-stack does"),
    ("info", r"read by the engines, so it must be on their file system"),
    # works, but not as production-stack's chart would
    ("differs", r"."),
]


@dataclass(frozen=True)
class Finding:
    severity: str
    path: str
    text: str

    def line(self, verbose: bool = False) -> str:
        full = f"{self.path}: {self.text}"
        return full if verbose else shorten(full)


def shorten(line: str, limit: int = SHORT) -> str:
    """The line up to its first clause break (``; ``) and at most ``limit`` characters, cut at a word."""
    head = line.split("; ", 1)[0]
    if len(head) <= limit:
        return head
    cut = head[: limit - 1].rsplit(" ", 1)[0]
    return f"{cut.rstrip(',;:')}…"


def severity_of(line: str) -> str:
    for severity, pattern in RULES:
        if re.search(pattern, line):
            return severity
    return "differs"


def _finding(line: str) -> Finding:
    path, _, text = line.partition(": ")
    return Finding(severity_of(line), path, text)


def _models(values: dict) -> list[dict]:
    spec = values.get("servingEngineSpec") or {}
    return [m for m in spec.get("modelSpec") or [] if isinstance(m, dict)]


def _env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env") or []}


def unasked(values: dict, objects: list[dict], release: str = RELEASE) -> list[Finding]:
    """What the render changes that no key asked for, against production-stack's chart (its templates at the
    commit of ../shared/production-stack-chart), as ``differs`` findings."""
    out: list[Finding] = []
    deployments = {o["metadata"]["name"]: o for o in objects if o.get("kind") == "Deployment"}
    shared = bool((values.get("sharedPvcStorage") or {}).get("enabled"))
    for i, m in enumerate(_models(values)):
        d = deployments.get(f"{release}-{m.get('name')}-deployment-vllm")
        if d is None:
            continue
        p = f"servingEngineSpec.modelSpec[{i}]"
        c = d["spec"]["template"]["spec"]["containers"][0]
        limits = (c.get("resources") or {}).get("limits") or {}
        if not m.get("resources"):
            for key, what in (("memory", "limitMemory"), ("cpu", "limitCPU")):
                if key in limits and not m.get(what):
                    out.append(
                        Finding(
                            "differs",
                            f"{p}.{what}",
                            f"{key} limit {limits[key]} rendered (production-stack sets none without {what}):"
                            " a limit equal to the request, Guaranteed QoS",
                        )
                    )
        env = _env(c)
        ps_home = "/data/shared-pvc-storage" if shared else ("/data" if "pvcStorage" in m else "/tmp")
        if env.get("HF_HOME") not in (None, ps_home):
            out.append(
                Finding(
                    "differs",
                    f"{p}.env",
                    f"HF_HOME is {env['HF_HOME']}, the model cache volume (production-stack: {ps_home})",
                )
            )
        vc = m.get("vllmConfig")
        if isinstance(vc, dict) and str(vc.get("v0")) != "1" and "PROMETHEUS_MULTIPROC_DIR" not in env:
            out.append(
                Finding(
                    "differs",
                    f"{p}.vllmConfig.prometheusMultiprocDir",
                    "PROMETHEUS_MULTIPROC_DIR=/tmp not set (production-stack sets it with any vllmConfig):"
                    " vLLM keeps its metrics in-process unless you give prometheusMultiprocDir",
                )
            )
        if (m.get("lmcacheConfig") or {}).get("enabled") and "VLLM_RPC_TIMEOUT" not in env:
            out.append(
                Finding(
                    "differs",
                    f"{p}.lmcacheConfig",
                    "VLLM_RPC_TIMEOUT=1000000 and LMCACHE_USE_EXPERIMENTAL not set (production-stack's):"
                    " vLLM's default RPC timeout applies; give them in env if you relied on them",
                )
            )
    if any(o.get("kind") == "Service" and o["metadata"]["name"].endswith("-engine-service") for o in objects):
        out.append(
            Finding(
                "differs",
                "servingEngineSpec",
                "the engine Services have no ports 55555 and 9999 (production-stack's PD transfer ports):"
                " nothing here connects to them through a Service",
            )
        )
    router = (values.get("routerSpec") or {}).get("enableRouter", True)
    if router and any(
        o.get("kind") == "Service" and o["metadata"]["name"] == f"{release}-router-service" for o in objects
    ):
        out.append(
            Finding(
                "differs",
                "routerSpec",
                "the router Service has no port 9000 (lmcache-port: production-stack's router hosts LMCache's"
                " controller there; here it is its own Service)",
            )
        )
    for role in (
        o for o in objects if o.get("kind") == "Role" and o["metadata"]["name"] == f"{release}-reader"
    ):
        verbs = sorted({v for rule in role.get("rules") or [] for v in rule.get("verbs") or []})
        if verbs != ["get", "list", "patch", "watch"]:
            out.append(
                Finding(
                    "differs",
                    "routerSpec",
                    f"the router Role allows {', '.join(verbs)} on pods (production-stack: get, list, patch, watch):"
                    " the router only lists and watches",
                )
            )
    for mon in (o for o in objects if o.get("kind") == "ServiceMonitor"):
        for ep in mon["spec"].get("endpoints") or []:
            jobs = [
                r.get("replacement") for r in ep.get("relabelings") or [] if r.get("targetLabel") == "job"
            ]
            if jobs:
                out.append(
                    Finding(
                        "differs",
                        "monitoring.serviceMonitor",
                        f"{mon['metadata']['name']} sets the job label to {jobs[-1]} (production-stack: the"
                        " Service's name): queries that select production-stack's job need the new name",
                    )
                )
    return out


def findings(values: Sequence[Path], sets: Sequence[str] = (), **where: str) -> list[Finding]:
    """Every finding for the values, in severity order (the chart's lines, then the unasked ones);
    a refusal is one ``error`` finding. ``where``: render_release's release and namespace."""
    release = where.get("release", RELEASE)
    try:
        rendered = render_release(values, sets, **where)
    except RenderError as error:
        return [Finding("error", "values", clean_error(str(error)))]
    merged: dict = {}
    for path in values:
        merged = _merge(merged, yaml.safe_load(Path(path).read_text()) or {})
    found = [_finding(line) for line in rendered.deviations]
    found += unasked(merged, rendered.objects, release)
    return sorted(found, key=lambda f: SEVERITIES.index(f.severity))


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def clean_error(message: str) -> str:
    """Helm's refusal without its "Error: INSTALLATION FAILED:" and template-location prefixes."""
    message = re.sub(r"^Error: (INSTALLATION FAILED: )?", "", message.strip())
    message = re.sub(r"^execution error at \([^)]*\): ", "", message)
    return message


def failing(found: Sequence[Finding], fail_on: str) -> list[Finding]:
    """The findings at ``fail_on`` or above (an error always fails)."""
    level = SEVERITIES.index(fail_on)
    return [f for f in found if SEVERITIES.index(f.severity) <= level or f.severity == "error"]


def check(
    values: Sequence[Path],
    sets: Sequence[str] = (),
    *,
    strict: bool = False,
    fail_on: str = "breaks",
    verbose: bool = False,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    out: TextIO = sys.stdout,
) -> int:
    """Print the findings by severity; 1 when any is at ``fail_on`` or above (``strict``: the chart's own
    strict=true render, which fails on any deviation), else 0."""
    if strict:
        try:
            render_release(values, [*sets, "strict=true"], release=release, namespace=namespace)
        except RenderError as error:
            print(f"error: {clean_error(str(error))}", file=out)
            return 1
    found = findings(values, sets, release=release, namespace=namespace)
    if not found:
        print("No deviations: the chart renders what the values ask.", file=out)
        return 0
    counts = {s: sum(f.severity == s for f in found) for s in SEVERITIES}
    print(", ".join(f"{n} {s}" for s, n in counts.items() if n) + f" (--fail-on {fail_on}):", file=out)
    for f in found:
        print(f"  {f.severity:<7} {f.line(verbose)}", file=out)
    return 1 if failing(found, fail_on) else 0


def readme_table(paths: Sequence[Path]) -> str:
    """helm/README.md's table: for each file, the error and breaks lines as printed, and the count of the
    differs and info lines (tests/up/test_check.py keeps it equal to the output)."""
    rows = ["| file | error / breaks | differs | info |", "|---|---|---|---|"]
    for path in paths:
        found = findings([path])
        bad = "<br>".join(
            f"{f.severity}: `{f.line()}`".replace("|", "\\|")
            for f in found
            if f.severity in ("error", "breaks")
        )
        counts = [sum(f.severity == s for f in found) for s in ("differs", "info")]
        rows.append(f"| `{path.name}` | {bad or '—'} | {counts[0]} | {counts[1]} |")
    return "\n".join(rows)
