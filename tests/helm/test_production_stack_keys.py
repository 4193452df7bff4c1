"""Every key of production-stack's chart (its values.yaml, its values.schema.json, and the keys its templates
read, at the commit of ../shared/production-stack-chart/; tests/helm/pskeys.py enumerates them) is honoured,
said in NOTES, or refused with a sentence naming it, never with a bare schema error.

Honoured is shown side by side: both charts render one model with and without the key (set to a value
production-stack accepts, tests/helm/pskeys_data.py), and every field production-stack's rendering changes is
compared with ours at the same object (same kind and name) and place. Fields this chart renders otherwise on
purpose are listed there with the reason (pskeys_data.EQUIVALENT), and are what helm/README.md "Coming from
production-stack" says."""

from __future__ import annotations

import collections

import pytest

from tests.helm import pskeys
from tests.helm.pskeys_data import EXTRA, OVERRIDES, allowed
from tests.shared_data import PS_CHART, require

pytestmark = pytest.mark.helm

# Refused with the reason, because the chart does not ship the component or the router has no such feature.
REFUSED = {
    "cacheserverSpec.replicaCount",  # 2: each replica would hold its own entries
    "loraAdapters.[].adapterSource.pattern",  # production-stack's operator
    "routerSpec.k8sServiceDiscoveryType",  # service-name
    "routerSpec.route.main.kind",  # GRPCRoute for an HTTP API
    "servingEngineSpec.modelSpec.[].lmcacheConfig.controllerPort",  # without enableController
    "servingEngineSpec.modelSpec.[].lmcacheConfig.controllerReplyPort",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.enableController",  # without a controller address
    "servingEngineSpec.modelSpec.[].lmcacheConfig.enableNixl",  # alone: pre-0.5 LMCache, translated with nixlRole
    "servingEngineSpec.modelSpec.[].lmcacheConfig.enablePD",  # without a role
    "servingEngineSpec.modelSpec.[].lmcacheConfig.instanceId",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.nixlBufferDevice",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.nixlBufferSize",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.nixlEnableGc",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.nixlPeerHost",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.nixlPeerPort",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.nixlRole",
    "servingEngineSpec.modelSpec.[].lmcacheConfig.workerPort",
    "servingEngineSpec.modelSpec.[].raySpec.enabled",  # multi-node Ray
    "servingEngineSpec.modelSpec.[].raySpec.headNode.initContainer",
    "servingEngineSpec.modelSpec.[].raySpec.headNode.requestCPU",
    "servingEngineSpec.modelSpec.[].raySpec.headNode.requestGPU",
    "servingEngineSpec.modelSpec.[].raySpec.headNode.requestMemory",
    "servingEngineSpec.modelSpec.[].raySpec.headNode.resources",
}
# The keys the issue found stopping at a bare schema error: each honoured now.
ONCE_SCHEMA_ERRORS = (
    "servingEngineSpec.env",
    "servingEngineSpec.modelSpec.[].pvcExistingClaimName",
    "servingEngineSpec.modelSpec.[].pvcStorage.emptyDir",
    "servingEngineSpec.modelSpec.[].vllmConfig.prometheusMultiprocDir",
)


def _keys() -> list[str]:
    require(PS_CHART)
    return list(pskeys.ps_keys())


@pytest.fixture(scope="module")
def verdicts() -> dict[str, pskeys.Verdict]:
    from concurrent.futures import ThreadPoolExecutor

    keys = _keys()
    with ThreadPoolExecutor(2) as pool:
        found = pool.map(lambda k: pskeys.judge(k, OVERRIDES, allowed(k), EXTRA), keys)
    return dict(zip(keys, found, strict=True))


def test_the_keys_are_production_stacks_own(verdicts):
    keys = set(verdicts)
    assert len(keys) > 300
    for key in (
        *ONCE_SCHEMA_ERRORS,
        "servingEngineSpec.modelSpec.[].vllmConfig.v0",
        "routerSpec.extraArgs",
        "routerSpec.route.main.httpsRedirect",
        "servingEngineSpec.modelSpec.[].keda.triggers.metadata.query",
        "loraController.enableLoraController",
    ):
        assert key in keys, key


def test_no_key_stops_at_a_bare_schema_error_or_differs_unsaid(verdicts):
    bad = {
        k: f"{v.outcome}: {v.detail}"
        for k, v in verdicts.items()
        if v.outcome not in ("honoured", "noted", "refused")
    }
    assert not bad, "\n".join(f"{k}: {why}" for k, why in sorted(bad.items()))


def test_refusals_are_the_listed_ones_and_say_why(verdicts):
    refused = {k for k, v in verdicts.items() if v.outcome == "refused"}
    assert refused == REFUSED
    for key in refused:
        detail = verdicts[key].detail
        assert "schema" not in detail and pskeys.names_key(detail, key), (key, detail)


def test_the_keys_that_stopped_at_a_schema_error_are_honoured(verdicts):
    for key in ONCE_SCHEMA_ERRORS:
        assert verdicts[key].outcome == "honoured", (key, verdicts[key].detail)


def test_most_keys_are_honoured_as_production_stack_renders_them(verdicts):
    counts = collections.Counter(v.outcome for v in verdicts.values())
    assert counts["honoured"] >= 250, counts
    compared = sum(int(v.detail.split()[0]) for v in verdicts.values() if v.outcome == "honoured")
    assert compared >= 600, compared  # fields compared side by side, over all keys


def test_every_equivalence_is_used():
    """Guard: a reason listed for a field that no key's rendering changes any more is stale."""
    from tests.helm.pskeys_data import EQUIVALENT

    used = set()
    for key in _keys():
        p = pskeys.probe(key, OVERRIDES, EXTRA)
        before, after = pskeys.ps_pair(p, EXTRA)
        if before is None or after is None:
            continue
        b, a = pskeys.indexed(before), pskeys.indexed(after)
        changed = [pskeys.field(path) for path, v in a.items() if b.get(path, "<absent>") != v]
        for prefix, patterns in EQUIVALENT.items():
            if prefix == "*" or key == prefix or key.startswith(prefix + "."):
                used |= {(prefix, pat) for pat in patterns if any(pat in f for f in changed)}
    listed = {(prefix, pat) for prefix, patterns in EQUIVALENT.items() for pat in patterns}
    assert not listed - used, sorted(listed - used)


def test_dashboard_labels_and_annotations(tmp_path):
    """grafanaDashboards' labels and annotations reach this chart's own dashboard ConfigMaps."""
    from tests.helm.chart import render, values_file

    values = {
        "grafanaDashboards": {
            "enabled": True,
            "labels": {"grafana_dashboard": "1"},
            "annotations": {"folder": "llm"},
        }
    }
    cms = [o for o in render([values_file(tmp_path, values)]) if "-grafana-" in o["metadata"]["name"]]
    assert cms and all(cm["metadata"]["labels"]["grafana_dashboard"] == "1" for cm in cms)
    assert all(cm["metadata"]["annotations"] == {"folder": "llm"} for cm in cms)
