"""inferenceExtension.epp: the chart deploys this project's endpoint picker (`vllm-stack epp`) for every model's
InferencePool: a Deployment and Service per pool (our picker reads one pool), which the pool's
endpointPickerRef names; one ServiceAccount with a Role holding exactly what the picker asks of the API
server; the router's image, security contexts, scheduling flags and engine key. The rendered command line is
parsed by the router's own parser and built into a router (no cluster: the pool is read at start)."""

from __future__ import annotations

import pytest
import yaml

from tests.helm.chart import (
    EXAMPLES,
    NAMESPACE,
    RELEASE,
    container,
    engine_name,
    env_of,
    find,
    flag,
    one,
    render,
    render_error,
    router_name,
    values_file,
)
from tests.helm.test_network_policy import peer_admits, pod, selects
from tests.helm.test_validate_objects import validate
from vllm_stack.app import build_router
from vllm_stack.router_cli import build_parser

pytestmark = pytest.mark.helm

HELMS = ["helm3", "helm4"]
MODELS = ["a", "b"]
MODEL_SPEC = "json:servingEngineSpec.modelSpec=" + (
    '[{"name":"a","modelURL":"org/a"},{"name":"b","modelURL":"org/b"}]'
)
EPP = [MODEL_SPEC, "inferenceExtension.enabled=true", "inferenceExtension.epp.enabled=true"]
SA = f"{RELEASE}-epp"
COMPONENT = "app.kubernetes.io/component"


def picker_name(model: str) -> str:
    return f"{RELEASE}-{model}-epp"


def pickers(objs: list[dict]) -> list[dict]:
    """Every object of the endpoint picker (its component label)."""
    return [o for o in objs if o["metadata"].get("labels", {}).get(COMPONENT) == "endpoint-picker"]


def picker_args(objs: list[dict], model: str) -> list[str]:
    return container(one(objs, "Deployment", picker_name(model)), "epp")["args"]


# --- off unless asked ------------------------------------------------------------------------------------


@pytest.mark.parametrize("helm", HELMS)
def test_nothing_is_rendered_without_epp_enabled(helm):
    objs = render(sets=[MODEL_SPEC, "inferenceExtension.enabled=true"], helm=helm)
    assert pickers(objs) == []
    assert not find(objs, "ServiceAccount", SA) and not find(objs, "Role", SA)
    for m in MODELS:
        assert not find(objs, "Deployment", picker_name(m))
        # the user's picker, as given
        assert one(objs, "InferencePool", engine_name(m, "InferencePool"))["spec"]["endpointPickerRef"] == {
            "name": "vllm-stack-epp",
            "port": {"number": 9002},
            "failureMode": "FailClose",
        }
    assert pickers(render(helm=helm)) == []


def test_epp_needs_the_pools():
    err = render_error(sets=[MODEL_SPEC, "inferenceExtension.epp.enabled=true"])
    assert "inferenceExtension.enabled" in err


def test_no_model_no_picker():
    objs = render(sets=["inferenceExtension.enabled=true", "inferenceExtension.epp.enabled=true"])
    assert pickers(objs) == [] and not find(objs, "InferencePool")


# --- what is rendered ------------------------------------------------------------------------------------


@pytest.mark.parametrize("helm", HELMS)
def test_one_picker_per_pool_and_the_pool_names_it(helm):
    objs = render(sets=EPP, helm=helm)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in pickers(objs)) == sorted(
        [(kind, picker_name(m)) for m in MODELS for kind in ("Deployment", "Service")]
        + [("ServiceAccount", SA), ("Role", SA), ("RoleBinding", SA)]
    )
    deployments = {m: one(objs, "Deployment", picker_name(m)) for m in MODELS}
    for m in MODELS:
        pool = one(objs, "InferencePool", engine_name(m, "InferencePool"))
        ref = pool["spec"]["endpointPickerRef"]
        assert ref == {"name": picker_name(m), "port": {"number": 9002}, "failureMode": "FailClose"}
        svc = one(objs, "Service", ref["name"])
        grpc = next(p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
        assert grpc == {
            "name": "grpc-ext-proc",
            "port": 9002,
            "targetPort": "grpc",
            "protocol": "TCP",
            "appProtocol": "http2",
        }
        http = next(p for p in svc["spec"]["ports"] if p["name"] == "http")
        assert http["targetPort"] == "http" and http["port"] == 8000
        ports = {p["name"]: p["containerPort"] for p in container(deployments[m], "epp")["ports"]}
        assert ports == {"http": 8000, "grpc": 9002}
        # The Service reaches this pool's picker pods only: not the other pool's, the router or the engines.
        assert svc["spec"]["type"] == "ClusterIP"
        for other, d in deployments.items():
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert selects({"matchLabels": svc["spec"]["selector"]}, labels) == (other == m)
            assert selects(d["spec"]["selector"], labels)
        for d in find(objs, "Deployment"):
            if d["metadata"]["name"] not in {picker_name(x) for x in MODELS}:
                labels = d["spec"]["template"]["metadata"]["labels"]
                assert not selects({"matchLabels": svc["spec"]["selector"]}, labels), d["metadata"]["name"]
        # ... and the pool selects no picker pod.
        for d in deployments.values():
            assert not selects(pool["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])


def test_failure_mode_comes_from_endpoint_picker_ref():
    objs = render(sets=[*EPP, "inferenceExtension.endpointPickerRef.failureMode=FailOpen"])
    for m in MODELS:
        ref = one(objs, "InferencePool", engine_name(m, "InferencePool"))["spec"]["endpointPickerRef"]
        assert ref["failureMode"] == "FailOpen" and ref["name"] == picker_name(m)


@pytest.mark.parametrize("helm", HELMS)
def test_rbac_is_exactly_what_the_picker_asks(helm):
    """`vllm-stack epp --inference-pool`: get on its pool (read once at start, by name), list + watch on pods
    (discovery) and on InferenceObjectives (their priorities). Nothing else, no cluster-wide role."""
    objs = render(sets=EPP, helm=helm)
    role = one(objs, "Role", SA)
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]},
        {
            "apiGroups": ["inference.networking.k8s.io"],
            "resources": ["inferencepools"],
            "resourceNames": [engine_name(m, "InferencePool") for m in MODELS],
            "verbs": ["get"],
        },
        {
            "apiGroups": ["inference.networking.x-k8s.io"],
            "resources": ["inferenceobjectives"],
            "verbs": ["list", "watch"],
        },
    ]
    assert not find(objs, "ClusterRole") and not find(objs, "ClusterRoleBinding")
    binding = one(objs, "RoleBinding", SA)
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": SA}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": SA, "namespace": NAMESPACE}]
    assert one(objs, "ServiceAccount", SA)["automountServiceAccountToken"] is False
    for m in MODELS:
        spec = one(objs, "Deployment", picker_name(m))["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == SA and spec["automountServiceAccountToken"] is True
    # The router keeps its own role (its pods only).
    assert one(objs, "Role", router_name("Role"))["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}
    ]


def test_the_role_names_exactly_what_the_code_calls():
    """The Role's verbs are the API calls of the picker's code: a get of the pool, a list and watch of the
    objectives (vllm_stack.epp.inference_objects) and of the pods (k8s discovery)."""
    import inspect

    from vllm_stack.engines.discovery import kubernetes
    from vllm_stack.epp import inference_objects

    source = inspect.getsource(inference_objects)
    assert "get_namespaced_custom_object(\n            POOL_GROUP" in source
    assert source.count("list_namespaced_custom_object") == 2  # the list, then the watch of that list
    assert (inference_objects.POOL_GROUP, inference_objects.POOL_PLURAL) == (
        "inference.networking.k8s.io",
        "inferencepools",
    )
    assert (inference_objects.OBJECTIVE_GROUP, inference_objects.OBJECTIVE_PLURAL) == (
        "inference.networking.x-k8s.io",
        "inferenceobjectives",
    )
    pods = inspect.getsource(kubernetes)
    assert "read_namespaced_pod" not in pods and "list_namespaced_pod" in pods


# --- the picker's command line ---------------------------------------------------------------------------


@pytest.mark.parametrize("helm", HELMS)
def test_args_name_the_pool_and_the_ext_proc_port(helm, tmp_path):
    objs = render(sets=EPP, helm=helm)
    config = tmp_path / "config.yaml"
    config.write_text(one(objs, "ConfigMap", router_name("ConfigMap"))["data"]["config.yaml"])
    for m in MODELS:
        args = picker_args(objs, m)
        parsed = build_parser("vllm-stack epp").parse_args(args)  # exits on an unknown flag
        assert parsed.ext_proc_port == 9002
        assert parsed.service_discovery == "k8s" and parsed.k8s_namespace == NAMESPACE
        assert parsed.inference_pool == engine_name(m, "InferencePool")
        # The pool gives the selector and port; nothing else does.
        assert (
            parsed.k8s_label_selector is None and parsed.k8s_port is None and parsed.static_backends is None
        )
        assert parsed.endpoint_picker is None and not parsed.disaggregation
        assert parsed.config_file == "/etc/vllm-stack/router/config.yaml"
        cli = {
            k: v
            for k, v in vars(parsed).items()
            if v is not None and k != "config_file" and not k.startswith("hosted_")
        }
        router = build_router(cli, str(config), environ={})
        assert (router.config.ext_proc_port, router.config.inference_pool) == (
            9002,
            engine_name(m, "InferencePool"),
        )


SCHEDULING_FLAGS = (
    "--host",
    "--port",
    "--routing-logic",
    "--session-key",
    "--tokenizers",
    "--engine-scrape-interval",
    "--health-check-interval",
    "--request-timeout",
    "--max-body-bytes",
    "--log-level",
    "--shutdown-grace",
    "--config",
    "--api-keys-file",
    "--priority-api-keys-file",
)


def test_the_router_scheduling_flags_are_the_pickers(tmp_path):
    values = values_file(
        tmp_path,
        {
            "routerSpec": {
                "routingLogic": "session",
                "sessionKey": "x-user",
                "engineScrapeInterval": 2,
                "requestTimeout": 30,
                "maxBodyBytes": 1000000,
                "logLevel": "debug",
                "apiKeysSecret": {"secretName": "clients", "secretKey": "keys"},
                "adminApiKeysSecret": {"secretName": "admins", "secretKey": "keys"},
                "priority": {"apiKeysSecret": {"secretName": "raisers", "secretKey": "keys"}},
                "extraArgs": ["--retries", "3"],
                "otel": {"endpoint": "http://otel:4317", "serviceName": "llm"},
            },
            "inferenceExtension": {"epp": {"extraArgs": ["--json-parser", "stdlib", "--access-log"]}},
        },
    )
    objs = render([values], sets=EPP)
    router = container(one(objs, "Deployment", router_name()))
    picker = container(one(objs, "Deployment", picker_name("a")), "epp")
    for name in SCHEDULING_FLAGS:
        assert flag(picker["args"], name) == flag(router["args"], name), name
        assert flag(picker["args"], name) is not None or name == "--tokenizers", name  # session: none
    assert flag(picker["args"], "--routing-logic") == "session"
    # the router's own: adapter loading (admin keys) and routerSpec.extraArgs stay with the router
    assert "--admin-api-keys-file" in router["args"] and "--admin-api-keys-file" not in picker["args"]
    assert "--retries" in router["args"] and "--retries" not in picker["args"]
    assert picker["args"][-3:] == ["--json-parser", "stdlib", "--access-log"]
    assert flag(picker["args"], "--otel-endpoint") == "http://otel:4317"
    assert flag(picker["args"], "--otel-service-name") == "llm-epp"
    mounts = {v["name"]: v["mountPath"] for v in picker["volumeMounts"]}
    assert mounts == {
        "tmp": "/tmp",
        "config": "/etc/vllm-stack/router",
        "api-keys": "/etc/vllm-stack/api-keys",
        "priority-keys": "/etc/vllm-stack/priority-keys",
    }
    volumes = {
        v["name"]: v for v in one(objs, "Deployment", picker_name("a"))["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["api-keys"]["secret"]["secretName"] == "clients"
    assert volumes["priority-keys"]["secret"]["secretName"] == "raisers"
    assert volumes["config"]["configMap"]["name"] == router_name("ConfigMap")


def test_unknown_extra_args_are_refused(tmp_path):
    values = values_file(tmp_path, {"inferenceExtension": {"epp": {"extraArgs": ["--no-such-flag"]}}})
    assert "--no-such-flag" in render_error([values], sets=EPP)
    values = values_file(tmp_path, {"inferenceExtension": {"epp": {"extraArgs": ["--retries"]}}})
    assert "takes a value" in render_error([values], sets=EPP)


def test_disaggregated_prefill_is_refused():
    err = render_error(
        [EXAMPLES / "pd-roles.yaml"],
        sets=["inferenceExtension.enabled=true", "inferenceExtension.epp.enabled=true"],
    )
    assert "disaggregated prefill" in err and "inferenceExtension.epp" in err


# --- pod: image, security, probes, the engines' key -------------------------------------------------------


@pytest.mark.parametrize("helm", HELMS)
def test_router_image_security_and_health_probes(helm):
    objs = render(sets=EPP, helm=helm)
    router = one(objs, "Deployment", router_name())
    for m in MODELS:
        d = one(objs, "Deployment", picker_name(m))
        spec, c = d["spec"]["template"]["spec"], container(d, "epp")
        assert c["image"] == container(router)["image"]
        assert "command" not in c  # the image's entrypoint, `vllm-stack router`
        assert spec["securityContext"] == router["spec"]["template"]["spec"]["securityContext"]
        assert c["securityContext"] == container(router)["securityContext"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
        assert c["resources"]["limits"] and c["resources"]["requests"]
        assert d["spec"]["replicas"] == 1


@pytest.mark.parametrize(
    "values, secret",
    [
        (
            {"servingEngineSpec": {"vllmApiKey": "sk-engines"}},
            {"name": f"{RELEASE}-secrets", "key": "vllmApiKey"},
        ),
        (
            {"servingEngineSpec": {"vllmApiKey": {"secretName": "eng", "secretKey": "k"}}},
            {"name": "eng", "key": "k"},
        ),
        (
            {"routerSpec": {"vllmApiKey": {"secretName": "rt", "secretKey": "k2"}}},
            {"name": "rt", "key": "k2"},
        ),
        ({}, None),
    ],
)
def test_vllm_api_key_is_the_routers(tmp_path, values, secret):
    objs = render([values_file(tmp_path, values)], sets=EPP)
    router_env = env_of(container(one(objs, "Deployment", router_name())))
    for m in MODELS:
        env = env_of(container(one(objs, "Deployment", picker_name(m)), "epp"))
        if secret is None:
            assert "VLLM_API_KEY" not in env and "VLLM_API_KEY" not in router_env
        else:
            assert env["VLLM_API_KEY"] == router_env["VLLM_API_KEY"]
            assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == secret


def test_the_pickers_run_without_the_router():
    """The picker takes the router's scheduling; without the router Deployment its ConfigMap, the engines'
    KV events (prefixaware) and the tokenizers are still there for it."""
    objs = render(sets=[*EPP, "routerSpec.enableRouter=false"])
    assert not find(objs, "Deployment", router_name())
    assert one(objs, "ConfigMap", router_name("ConfigMap"))
    args = picker_args(objs, "a")
    assert flag(args, "--routing-logic") == "prefixaware" and flag(args, "--tokenizers")
    assert flag(args, "--config") == "/etc/vllm-stack/router/config.yaml"
    engine = container(one(objs, "Deployment", engine_name("a")))
    assert "--kv-events-config" in engine["args"]


def test_every_picker_object_validates():
    objs = render(
        [EXAMPLES / "monitoring.yaml"],
        sets=[MODEL_SPEC, "inferenceExtension.epp.enabled=true", "routerSpec.apiKeysSecret.secretName=k"]
        + ["routerSpec.apiKeysSecret.secretKey=keys"],
    )
    checked = [o for o in objs if o["kind"] in ("InferencePool", "ServiceMonitor", "NetworkPolicy")]
    for obj in pickers(objs) + checked:
        validate(obj)


# --- network policy, monitoring, NOTES ---------------------------------------------------------------------


def admitted_on(policies: list[dict], source: dict, target: dict, port: str) -> bool:
    """Ingress from `source` to `target` on the named port (a rule without ports admits every port)."""
    applying = [
        p
        for p in policies
        if p["metadata"]["namespace"] == target["ns"] and selects(p["spec"]["podSelector"], target["labels"])
    ]
    if not applying:
        return True
    return any(
        any(peer_admits(peer, p["metadata"]["namespace"], source) for peer in rule.get("from", []))
        and (not rule.get("ports") or any(q["port"] == port for q in rule["ports"]))
        for p in applying
        for rule in p["spec"].get("ingress", [])
    )


def deployment_pod(objs: list[dict], name: str) -> dict:
    d = one(objs, "Deployment", name)
    return pod(d["spec"]["template"]["metadata"]["labels"], d["metadata"]["namespace"])


def test_network_policies_with_the_pickers():
    objs = render([EXAMPLES / "kvaware.yaml"], sets=[*EPP[1:], "networkPolicy.enabled=true"])
    policies = find(objs, "NetworkPolicy")
    model = next(d for d in find(objs, "Deployment") if d["metadata"]["name"].endswith("-deployment-vllm"))
    engine = deployment_pod(objs, model["metadata"]["name"])
    (picker_deployment,) = [o for o in pickers(objs) if o["kind"] == "Deployment"]
    picker = deployment_pod(objs, picker_deployment["metadata"]["name"])
    controller = next(
        deployment_pod(objs, d["metadata"]["name"])
        for d in find(objs, "Deployment")
        if d["spec"]["template"]["metadata"]["labels"].get(COMPONENT) == "lmcache-controller"
    )
    gateway = pod({"gateway.networking.k8s.io/gateway-name": "inference-gateway"}, ns="gateway")
    prometheus = pod({"app.kubernetes.io/name": "prometheus"}, ns="monitoring")
    stranger = pod({"app": "curious"})
    # the picker reaches the engines (scrapes, KV events) and, with kvaware, the controller's API
    assert admitted_on(policies, picker, engine, "http")
    assert admitted_on(policies, picker, controller, "api")
    assert not admitted_on(policies, picker, controller, "pull")
    # the gateway reaches the picker's ext_proc port, Prometheus its metrics; nothing else gets in
    assert admitted_on(policies, gateway, picker, "grpc")
    assert not admitted_on(policies, gateway, picker, "http")
    assert admitted_on(policies, prometheus, picker, "http")
    assert not admitted_on(policies, prometheus, picker, "grpc")
    for port in ("grpc", "http"):
        assert not admitted_on(policies, stranger, picker, port)
    # the user's picker's default label is not let in any more: the chart's pickers are the pickers
    assert not admitted_on(policies, pod({"app": "vllm-stack-epp"}), engine, "http")


def test_pickers_are_scraped_under_their_own_job():
    objs = render([EXAMPLES / "monitoring.yaml"], sets=["inferenceExtension.epp.enabled=true"])
    sm = one(objs, "ServiceMonitor", f"{RELEASE}-epp-servicemonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "http"
    assert sm["spec"]["endpoints"][0]["relabelings"][-1]["replacement"] == "vllm-stack-epp"
    svc = one(objs, "Service", picker_name("llama3"))
    assert selects(sm["spec"]["selector"], svc["metadata"]["labels"])
    assert "http" in {p["name"] for p in svc["spec"]["ports"]}
    others = [s for s in find(objs, "Service") if s["metadata"]["name"] != picker_name("llama3")]
    assert not any(selects(sm["spec"]["selector"], s["metadata"]["labels"]) for s in others)


def test_notes_name_each_pool_and_its_picker():
    from tests.helm.test_production_stack_files import manifest_and_notes

    values = yaml.safe_load((EXAMPLES / "monitoring.yaml").read_text())
    values["inferenceExtension"]["epp"] = {"enabled": True}
    _, notes = manifest_and_notes(values)
    line = f"  llama3: InferencePool {engine_name('llama3', 'InferencePool')} -> Service {picker_name('llama3')}:9002"
    assert any(n.startswith(line) for n in notes), notes
