"""The rendered NetworkPolicies, evaluated the way Kubernetes does against the rendered pods' labels: with the
Gateway API Inference Extension on, the inference gateway's proxies and the endpoint picker reach the engines;
the router and Prometheus still do; any other pod does not. No cluster runs here, so the evaluation follows the
NetworkPolicy semantics in code (podSelector / namespaceSelector / both, matchLabels and matchExpressions)."""

from __future__ import annotations

import pytest

from tests.helm.chart import NAMESPACE, find, render

pytestmark = pytest.mark.helm


def selects(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector: {} selects everything; matchLabels and matchExpressions must all hold."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def peer_admits(peer: dict, policy_ns: str, pod: dict) -> bool:
    if "ipBlock" in peer:
        return False
    ns_ok = (
        selects(peer["namespaceSelector"], pod["nsLabels"])
        if "namespaceSelector" in peer
        else pod["ns"] == policy_ns
    )
    pod_ok = selects(peer["podSelector"], pod["labels"]) if "podSelector" in peer else True
    return ns_ok and pod_ok


def admitted(policies: list[dict], source: dict, target: dict) -> bool:
    """Whether ingress from `source` to `target` is allowed (ports aside: the chart's rules name none)."""
    applying = [
        p
        for p in policies
        if p["metadata"]["namespace"] == target["ns"]
        and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and selects(p["spec"]["podSelector"], target["labels"])
    ]
    if not applying:
        return True
    return any(
        any(peer_admits(peer, p["metadata"]["namespace"], source) for peer in rule.get("from", []))
        for p in applying
        for rule in p["spec"].get("ingress", [])
    )


def pod(labels: dict, ns: str = NAMESPACE) -> dict:
    return {"labels": labels, "ns": ns, "nsLabels": {"kubernetes.io/metadata.name": ns}}


def rendered_pods(objs: list[dict], component: str) -> list[dict]:
    return [
        pod(d["spec"]["template"]["metadata"]["labels"], d["metadata"]["namespace"])
        for d in find(objs, "Deployment")
        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]


MODELS = (
    "json:servingEngineSpec.modelSpec=" + '[{"name":"a","modelURL":"org/a"},{"name":"b","modelURL":"org/b"}]'
)


def test_inference_gateway_and_endpoint_picker_reach_the_engines():
    objs = render(sets=[MODELS, "inferenceExtension.enabled=true", "networkPolicy.enabled=true"])
    policies = find(objs, "NetworkPolicy")
    engines = rendered_pods(objs, "serving-engine")
    (router,) = rendered_pods(objs, "router")
    assert len(engines) == 2 and policies
    istio_gateway = pod({"gateway.networking.k8s.io/gateway-name": "inference-gateway"}, ns="gateway")
    envoy_gateway = pod(
        {"gateway.envoyproxy.io/owning-gateway-name": "inference-gateway"}, ns="envoy-gateway-system"
    )
    epp = pod({"app": "vllm-stack-epp"})  # inferenceExtension.endpointPickerRef.name's default
    prometheus = pod({"app.kubernetes.io/name": "prometheus"}, ns="monitoring")
    stranger = pod({"app": "curious"})
    stranger_elsewhere = pod({"app": "vllm-stack-epp"}, ns="other")  # the EPP's labels, wrong namespace
    for engine in engines:
        for source in (istio_gateway, envoy_gateway, epp, router, prometheus):
            assert admitted(policies, source, engine), source
        for source in (stranger, stranger_elsewhere):
            assert not admitted(policies, source, engine), source


def test_without_the_inference_extension_only_router_and_prometheus_reach_engines():
    objs = render(sets=[MODELS, "networkPolicy.enabled=true"])
    policies = find(objs, "NetworkPolicy")
    (router,) = rendered_pods(objs, "router")
    gateway = pod({"gateway.networking.k8s.io/gateway-name": "inference-gateway"}, ns="gateway")
    for engine in rendered_pods(objs, "serving-engine"):
        assert admitted(policies, router, engine)
        assert not admitted(policies, gateway, engine)
        assert not admitted(policies, pod({"app": "vllm-stack-epp"}), engine)


def test_a_custom_endpoint_picker_selector_replaces_the_default():
    objs = render(
        sets=[
            MODELS,
            "inferenceExtension.enabled=true",
            "networkPolicy.enabled=true",
            'json:networkPolicy.endpointPickerFrom=[{"podSelector":{"matchLabels":{"inferencepool":"epp"}}}]',
        ]
    )
    policies = find(objs, "NetworkPolicy")
    engine = rendered_pods(objs, "serving-engine")[0]
    assert admitted(policies, pod({"inferencepool": "epp"}), engine)
    assert not admitted(policies, pod({"app": "vllm-stack-epp"}), engine)
