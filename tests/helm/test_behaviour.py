"""Behaviour of the rendered objects: names, labels, selectors, args, env, probes, volumes, security."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helm.chart import (
    CHART,
    EXAMPLES,
    NAMESPACE,
    RELEASE,
    cache_server_name,
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

pytestmark = pytest.mark.helm

SEED = EXAMPLES / "seed-mistral.yaml"
SEED_KEDA = EXAMPLES / "seed-keda.yaml"


def engine(objs, model):
    return one(objs, "Deployment", engine_name(model, "Deployment"))


# --- the user's production-stack values file -------------------------------------------------------------


def test_seed_engine_command_uses_vllm_032_flags():
    c = container(engine(render([SEED]), "mistral"))
    assert c["image"] == "lmcache/vllm-openai:latest"
    assert c["command"] == ["vllm", "serve"]
    args = c["args"]
    assert args[0] == "mistralai/Mistral-7B-Instruct-v0.2"
    assert flag(args, "--port") == "8000" and flag(args, "--host") == "0.0.0.0"
    assert flag(args, "--served-model-name") == "mistralai/Mistral-7B-Instruct-v0.2"
    assert "--no-enable-prefix-caching" in args and "--no-enable-chunked-prefill" in args
    assert flag(args, "--max-model-len") == "16384"
    assert flag(args, "--dtype") == "bfloat16"
    assert flag(args, "--max-num-seqs") == "32"
    assert flag(args, "--gpu-memory-utilization") == "0.95"
    # maxLoras alone is production-stack's way to ask for LoRA; vLLM ignores --max-loras without --enable-lora.
    assert "--enable-lora" in args and flag(args, "--max-loras") == "4"
    assert json.loads(flag(args, "--kv-transfer-config")) == {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
    }


def test_seed_engine_env_resources_volumes_probes():
    d = engine(render([SEED]), "mistral")
    c = container(d)
    env = env_of(c)
    assert env["PYTHONHASHSEED"]["value"] == "123"  # production-stack's seed
    assert env["LMCACHE_TRACK_USAGE"]["value"] == "false"
    assert env["LMCACHE_LOCAL_CPU"]["value"] == "true"
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"]["value"] == "30"
    res = c["resources"]
    assert res["requests"] == {"cpu": "10", "memory": "64Gi", "nvidia.com/gpu": "1"}
    assert res["limits"]["nvidia.com/gpu"] == "1" and res["limits"]["memory"] == "64Gi"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert (
        c["startupProbe"]["initialDelaySeconds"],
        c["startupProbe"]["periodSeconds"],
        c["startupProbe"]["failureThreshold"],
    ) == (15, 10, 60)
    assert c["livenessProbe"]["failureThreshold"] == 3
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
    assert vols["model-cache"]["persistentVolumeClaim"]["claimName"] == engine_name(
        "mistral", "PersistentVolumeClaim"
    )
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == {"model-cache": "/data", "dshm": "/dev/shm"}
    pvc = one(render([SEED]), "PersistentVolumeClaim", engine_name("mistral", "PersistentVolumeClaim"))
    assert pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert d["spec"]["replicas"] == 1


def test_seed_names_labels_selectors():
    objs = render([SEED])
    d = engine(objs, "mistral")
    sel = d["spec"]["selector"]["matchLabels"]
    # production-stack's selector (its chart's defaults for servingEngineSpec.labels included): an upgrade
    # from its chart keeps it; ours is only added to the pods (vllm-stack.io/model).
    assert sel == {
        "model": "mistral",
        "helm-release-name": RELEASE,
        "app.kubernetes.io/name": "mistral",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "serving-engine",
        "app.kubernetes.io/part-of": "vllm-stack",
        "app.kubernetes.io/managed-by": "helm",
        "environment": "test",
        "release": "test",
    }
    pod_labels = d["spec"]["template"]["metadata"]["labels"]
    assert sel.items() <= pod_labels.items() and pod_labels["vllm-stack.io/model"] == "mistral"
    svc = one(objs, "Service", engine_name("mistral", "Service"))
    assert svc["spec"]["selector"] == sel
    assert (
        svc["spec"]["ports"][0]["targetPort"] == "http" and svc["spec"]["ports"][0]["name"] == "service-port"
    )
    for o in objs:
        assert o["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE, o["metadata"]["name"]
        assert o["metadata"].get("namespace") == NAMESPACE


def test_router_args_follow_the_contract():
    objs = render([SEED])
    d = one(objs, "Deployment", router_name("Deployment"))
    c = container(d)
    assert "command" not in c  # the image's entrypoint is `vllm-stack router`
    assert c["image"] == "ghcr.io/vllm-stack/router:0.1.0"  # production-stack's image takes other flags
    assert c["args"] == [
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--service-discovery",
        "k8s",
        "--k8s-namespace",
        NAMESPACE,
        "--k8s-label-selector",
        f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=serving-engine",
        "--k8s-port",
        "8000",
        "--routing-logic",
        "prefixaware",  # the chart's default: the best strategy by benchmarks/routing
        "--tokenizers",  # the Hub model's tokenizer, fetched by the router (fetchTokenizers)
        "mistralai/Mistral-7B-Instruct-v0.2=hf:mistralai/Mistral-7B-Instruct-v0.2",
        "--engine-scrape-interval",
        "1",
        "--health-check-interval",
        "5",
        "--request-timeout",
        "600",
        "--max-body-bytes",
        "33554432",
        "--log-level",
        "info",
        "--shutdown-grace",
        "50",
        "--config",  # the router's `models` (its configured models: scale from zero, default criticality)
        "/etc/vllm-stack/router/config.yaml",
    ]


def test_router_stops_gracefully_within_the_pod_grace_period(tmp_path):
    """SIGTERM handling fits Kubernetes: a preStop sleep while the pod leaves the Service, then the
    router's own drain (--shutdown-grace) ends before the kubelet's kill."""
    d = one(render([SEED]), "Deployment", router_name("Deployment"))
    pod = d["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 60
    assert container(d)["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    vf = values_file(
        tmp_path, {"routerSpec": {"terminationGracePeriodSeconds": 300, "preStopSleepSeconds": 0}}
    )
    d = one(render([SEED, str(vf)]), "Deployment", router_name("Deployment"))
    assert "lifecycle" not in container(d)
    assert flag(container(d)["args"], "--shutdown-grace") == "295"


def test_engines_stop_after_a_prestop_wait_for_their_answers_under_way(tmp_path):
    """Issue 47: a deleted engine pod is dropped by the router at once, but vLLM aborts what it runs at
    SIGTERM (`--shutdown-timeout` 0): a native preStop sleep (no binary in the image) lets the answers
    under way finish first, within a grace period that leaves vLLM time to exit after it."""
    for d in (engine(render([SEED]), "mistral"), one(render([EXAMPLES / "multi-model.yaml"]), "Deployment",
                                                       engine_name("llama3", "Deployment"))):  # fmt: skip
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60
        assert container(d)["lifecycle"] == {"preStop": {"sleep": {"seconds": 30}}}
    vf = values_file(
        tmp_path, {"servingEngineSpec": {"terminationGracePeriodSeconds": 200, "preStopSleepSeconds": 150}}
    )
    d = engine(render([SEED, str(vf)]), "mistral")
    assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 200
    assert container(d)["lifecycle"]["preStop"]["sleep"]["seconds"] == 150
    assert "lifecycle" not in container(
        engine(render([SEED], ["servingEngineSpec.preStopSleepSeconds=0"]), "mistral")
    )


def test_an_engine_prestop_wait_the_grace_period_would_cut_is_refused():
    error = render_error([SEED], ["servingEngineSpec.preStopSleepSeconds=60"])
    assert (
        "servingEngineSpec.preStopSleepSeconds 60 is not below servingEngineSpec.terminationGracePeriodSeconds 60"
        in error
    )


def test_two_releases_never_see_each_others_engines():
    a, b = render([SEED], release="team-a"), render([SEED], release="team-b")
    sel_a = flag(
        container(one(a, "Deployment", router_name(release="team-a")))["args"], "--k8s-label-selector"
    )
    sel_b = flag(
        container(one(b, "Deployment", router_name(release="team-b")))["args"], "--k8s-label-selector"
    )
    labels_b = one(b, "Deployment", engine_name("mistral", release="team-b"))["spec"]["template"]["metadata"][
        "labels"
    ]
    labels_a = one(a, "Deployment", engine_name("mistral", release="team-a"))["spec"]["template"]["metadata"][
        "labels"
    ]

    def matches(selector, labels):
        return all(labels.get(k) == v for k, v in (kv.split("=") for kv in selector.split(",")))

    assert matches(sel_a, labels_a) and matches(sel_b, labels_b)
    assert not matches(sel_a, labels_b) and not matches(sel_b, labels_a)
    names_a = {(o["kind"], o["metadata"]["name"]) for o in a}
    names_b = {(o["kind"], o["metadata"]["name"]) for o in b}
    assert not names_a & names_b


def test_router_security_rbac_and_service():
    objs = render([SEED])
    d = one(objs, "Deployment", router_name("Deployment"))
    pod = d["spec"]["template"]["spec"]
    c = container(d)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # the one writable mount is /tmp; the router's configuration (its `models`) is mounted read-only
    assert {m["mountPath"]: m.get("readOnly", False) for m in c["volumeMounts"]} == {
        "/tmp": False,
        "/etc/vllm-stack/router": True,
    }
    assert (
        pod["serviceAccountName"] == router_name("ServiceAccount")
        and pod["automountServiceAccountToken"] is True
    )
    role = one(objs, "Role", router_name("Role"))
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    rb = one(objs, "RoleBinding", router_name("RoleBinding"))
    assert rb["roleRef"]["name"] == role["metadata"]["name"]
    assert rb["subjects"] == [
        {"kind": "ServiceAccount", "name": router_name("ServiceAccount"), "namespace": NAMESPACE}
    ]
    assert not find(objs, "ClusterRole") and not find(objs, "ClusterRoleBinding")
    assert one(objs, "PodDisruptionBudget", router_name("PodDisruptionBudget"))["spec"]["maxUnavailable"] == 1
    assert one(objs, "Service", router_name("Service"))["spec"]["ports"][0]["port"] == 80
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"


def test_static_discovery_has_no_rbac_and_no_token(tmp_path):
    v = values_file(
        tmp_path,
        {
            "routerSpec": {
                "serviceDiscovery": "static",
                "staticBackends": "http://a:8000,http://b:8000",
                "staticModels": "m",
            }
        },
    )
    objs = render([v])
    c = container(one(objs, "Deployment", router_name("Deployment")))
    assert flag(c["args"], "--service-discovery") == "static"
    assert flag(c["args"], "--static-backends") == "http://a:8000,http://b:8000"
    assert flag(c["args"], "--static-models") == "m"
    assert "--k8s-label-selector" not in c["args"]
    assert not find(objs, "Role") and not find(objs, "RoleBinding")
    assert (
        one(objs, "Deployment", router_name("Deployment"))["spec"]["template"]["spec"][
            "automountServiceAccountToken"
        ]
        is False
    )


def test_external_providers_example_renders_production_stacks_keys():
    """helm/examples/external-providers.yaml (docs/external-providers.md): the router alone, external-only,
    production-stack's keys rendered as they are: the flag from extraArgs, the file from a ConfigMap
    mounted by extraVolumes, the key variable from a Secret (never a plain value), no RBAC."""
    objs = render([EXAMPLES / "external-providers.yaml"])
    deployment = one(objs, "Deployment", router_name("Deployment"))
    c = container(deployment)
    assert flag(c["args"], "--service-discovery") == "external-only"
    assert "--static-backends" not in c["args"]
    assert flag(c["args"], "--external-providers-config") == "/etc/vllm-stack/providers/providers.yaml"
    key = next(e for e in c["env"] if e["name"] == "LOCAL_VLLM_API_KEY")
    assert key == {
        "name": "LOCAL_VLLM_API_KEY",
        "valueFrom": {"secretKeyRef": {"name": "external-provider-keys", "key": "local-vllm"}},
    }
    mount = next(m for m in c["volumeMounts"] if m["name"] == "external-providers")
    assert mount["mountPath"] == "/etc/vllm-stack/providers"
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "external-providers", "configMap": {"name": "external-providers"}} in volumes
    providers = yaml.safe_load(one(objs, "ConfigMap", "external-providers")["data"]["providers.yaml"])
    assert providers["external_providers"][0]["api_key_env_var"] == "LOCAL_VLLM_API_KEY"
    assert (
        not find(objs, "Role")
        and deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    )
    assert not [
        o
        for o in objs
        if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "serving-engine"
    ]


def test_every_container_has_requests_and_limits():
    from tests.helm.chart import values_files

    for f in values_files():
        for o in render([f]):
            spec = (
                o["spec"]["template"]["spec"]
                if o["kind"] == "Deployment"
                else o["spec"]
                if o["kind"] == "Pod"
                else None
            )
            if spec is None:
                continue
            for c in spec["containers"]:
                r = c.get("resources", {})
                for part in ("requests", "limits"):
                    assert {"cpu", "memory"} <= r.get(part, {}).keys(), (
                        f"{f.name}: {o['metadata']['name']}/{c['name']} {part}"
                    )


def test_no_secret_value_in_plain_env():
    from tests.helm.chart import values_files

    for f in values_files():
        for o in render([f]):
            if o["kind"] not in ("Deployment", "Pod"):
                continue
            spec = o["spec"]["template"]["spec"] if o["kind"] == "Deployment" else o["spec"]
            for c in spec["containers"]:
                for e in c.get("env", []):
                    if any(word in e["name"] for word in ("KEY", "TOKEN", "PASSWORD", "SECRET")):
                        assert "value" not in e and "secretKeyRef" in e["valueFrom"], (f.name, e)


# --- models: enabled, several, none ----------------------------------------------------------------------


def test_multi_model_secrets_api_key_and_kv_events():
    objs = render([EXAMPLES / "multi-model.yaml"])
    llama, qwen = engine(objs, "llama3"), engine(objs, "qwen")
    secret = one(objs, "Secret", f"{RELEASE}-secrets")
    assert set(secret["data"]) == {"vllmApiKey"}  # hf_token of llama3 is an existing Secret reference
    for d in (llama, qwen, one(objs, "Deployment", router_name("Deployment"))):
        ref = env_of(container(d))["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": f"{RELEASE}-secrets", "key": "vllmApiKey"}
    assert env_of(container(llama))["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "hf-token",
        "key": "token",
    }
    # prefixaware routing turns KV-event publishing on (with replay, and the engines' cached-token
    # counts for the predicted-versus-actual metric) ...
    for d in (llama, qwen):
        c = container(d)
        cfg = json.loads(flag(c["args"], "--kv-events-config"))
        assert cfg == {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
        }
        assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in c["ports"]
        assert {"name": "kv-replay", "containerPort": 5558, "protocol": "TCP"} in c["ports"]
        assert c["args"].count("--enable-prompt-tokens-details") == 1
    # ... and gives the router each Hub model's tokenizer, fetched with the first model's token.
    router_c = container(one(objs, "Deployment", router_name("Deployment")))
    assert flag(router_c["args"], "--tokenizers") == (
        "meta-llama/Llama-3.1-8B-Instruct=hf:meta-llama/Llama-3.1-8B-Instruct,qwen-small=hf:Qwen/Qwen2.5-1.5B-Instruct"
    )
    router_env = env_of(router_c)
    assert router_env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert router_env["VLLM_STACK_CACHE_DIR"]["value"].startswith("/tmp/")  # the tmp emptyDir
    assert flag(container(qwen)["args"], "--served-model-name") == "qwen-small"
    assert flag(container(qwen)["args"], "--max-num-batched-tokens") == "1000000"
    assert container(qwen)["args"][-3:] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert container(qwen)["image"] == "vllm/vllm-openai:v0.32.0"
    vols = {v["name"]: v for v in qwen["spec"]["template"]["spec"]["volumes"]}
    assert vols["model-cache"]["persistentVolumeClaim"]["claimName"] == "shared-models"
    assert not find(objs, "PersistentVolumeClaim", engine_name("qwen", "PersistentVolumeClaim"))
    assert llama["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    terms = llama["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["key"] == "nvidia.com/gpu.product"
    assert (
        one(objs, "PodDisruptionBudget", engine_name("llama3", "PodDisruptionBudget"))["spec"][
            "maxUnavailable"
        ]
        == "25%"
    )
    router = one(objs, "Deployment", router_name("Deployment"))
    assert "replicas" not in router["spec"]  # the HPA owns it
    assert one(objs, "HorizontalPodAutoscaler")["spec"]["maxReplicas"] == 6
    args = container(router)["args"]
    assert (
        flag(args, "--routing-logic") == "prefixaware"
        and flag(args, "--api-keys-file") == "/etc/vllm-stack/api-keys/keys"
    )


def test_round_robin_engines_publish_no_kv_events():
    c = container(engine(render([SEED], ["routerSpec.routingLogic=roundrobin"]), "mistral"))
    assert "--kv-events-config" not in c["args"]
    assert "--enable-prompt-tokens-details" not in c["args"]
    assert [p["name"] for p in c["ports"]] == ["http"]


def test_disabled_model_keeps_only_its_service_and_claim():
    """As production-stack renders them: the claim keeps the downloaded weights while the model is off, and
    an upgrade from production-stack's chart neither deletes it nor the Service; nothing runs for the model."""
    objs = render([EXAMPLES / "disabled-model.yaml"])
    assert engine(objs, "active")
    parked = [
        (o["kind"], o["metadata"]["name"])
        for o in objs
        if o["metadata"].get("labels", {}).get("vllm-stack.io/model") == "parked"
        or "parked" in o["metadata"]["name"]
    ]
    assert sorted(parked) == [
        ("PersistentVolumeClaim", engine_name("parked", "PersistentVolumeClaim")),
        ("Service", engine_name("parked", "Service")),
    ]
    svc = one(objs, "Service", engine_name("parked", "Service"))
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in find(objs, "Deployment")]
    assert not [p for p in pods if svc["spec"]["selector"].items() <= p.items()]  # it selects no pod


def test_replica_count_zero_is_kept_not_made_one(tmp_path):
    """0 is a model kept scaled to zero (production-stack's files use it); only a missing count is 1."""
    sets = ("servingEngineSpec.modelSpec[0].replicaCount=0",)
    assert engine(render([EXAMPLES / "local-default.yaml"], sets), "tiny-llama")["spec"]["replicas"] == 0
    keda = ("servingEngineSpec.modelSpec[0].keda.enabled=true",)
    so = one(
        render([EXAMPLES / "local-default.yaml"], sets + keda),
        "ScaledObject",
        engine_name("tiny-llama", "ScaledObject"),
    )
    assert so["spec"]["minReplicaCount"] == 0 and so["spec"]["maxReplicaCount"] == 1


def test_no_models_renders_router_only():
    objs = render([EXAMPLES / "no-models.yaml"])
    components = {
        o["metadata"]["labels"].get("app.kubernetes.io/component") for o in objs if o["kind"] != "Secret"
    }
    assert components == {"router", "test"}
    # production-stack's Secret, rendered (empty) whenever engines are on, as there
    assert one(objs, "Secret", f"{RELEASE}-secrets").get("data") is None


def test_engines_off_removes_every_engine_object(tmp_path):
    v = values_file(tmp_path, {"servingEngineSpec": {"enableEngine": False}})
    objs = render([SEED, v])
    assert not [
        o for o in objs if o["metadata"]["labels"].get("app.kubernetes.io/component") == "serving-engine"
    ]
    assert not find(objs, "Secret")


# --- LoRA, LMCache, cache server, PD ---------------------------------------------------------------------


def test_lora_flags_and_runtime_updating():
    objs = render([EXAMPLES / "lora.yaml"])
    c = container(engine(objs, "llama3-lora"))
    args = c["args"]
    assert "--enable-lora" in args
    assert (flag(args, "--max-loras"), flag(args, "--max-lora-rank"), flag(args, "--max-cpu-loras")) == (
        "4",
        "16",
        "8",
    )
    mods = [args[i + 1] for i, a in enumerate(args) if a == "--lora-modules"]
    assert mods == ["sql=/data/adapters/sql", "summarize=/data/adapters/summarize"]
    assert env_of(c)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "True"
    r = container(one(objs, "Deployment", router_name("Deployment")))["args"]
    assert flag(r, "--routing-logic") == "session" and flag(r, "--session-key") == "x-user-id"


def test_cache_server_and_lmcache_offload():
    objs = render([EXAMPLES / "cache-server.yaml"])
    cs = one(objs, "Deployment", cache_server_name("Deployment"))
    c = container(cs)
    assert c["command"] == ["lmcache_server", "0.0.0.0", "8080"]
    assert c["image"] == "lmcache/vllm-openai:v0.5.6"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["tcpSocket"]["port"] == "lm"
    assert c["resources"]["limits"]["memory"] == "32Gi"
    svc = one(objs, "Service", cache_server_name("Service"))
    assert svc["spec"]["ports"][0]["port"] == 81
    e = container(engine(objs, "mistral"))
    env = env_of(e)
    assert env["LMCACHE_REMOTE_URL"]["value"] == f"lm://{cache_server_name('Service')}:81"
    assert env["LMCACHE_REMOTE_SERDE"]["value"] == "naive"
    assert env["LMCACHE_LOCAL_DISK"]["value"] == "file:///lmcache/disk/"
    assert env["LMCACHE_MAX_LOCAL_DISK_SIZE"]["value"] == "100"
    assert env["LMCACHE_MAX_LOCAL_CPU_SIZE"]["value"] == "20"
    assert env["LMCACHE_CHUNK_SIZE"]["value"] == "256"
    assert e["image"] == "lmcache/vllm-openai:v0.5.6"  # LMCache image by default when lmcacheConfig.enabled
    vols = {v["name"]: v for v in engine(objs, "mistral")["spec"]["template"]["spec"]["volumes"]}
    assert vols["lmcache-disk"]["emptyDir"]["sizeLimit"] == "100Gi"
    nps = {n["metadata"]["name"]: n for n in find(objs, "NetworkPolicy")}
    cs_np = nps[cache_server_name("NetworkPolicy")]
    assert (
        cs_np["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        == "serving-engine"
    )


def test_cache_server_off_by_default():
    objs = render([SEED])
    assert not find(objs, "Deployment", cache_server_name("Deployment"))
    assert "LMCACHE_REMOTE_URL" not in env_of(container(engine(objs, "mistral")))


LMCACHE_05_KEYS = {
    "chunk_size",
    "local_cpu",
    "max_local_cpu_size",
    "local_disk",
    "max_local_disk_size",
    "remote_url",
    "remote_serde",
    "enable_controller",
    "lmcache_instance_id",
    "controller_pull_url",
    "controller_reply_url",
    "lmcache_worker_ports",
    "enable_p2p",
    "p2p_host",
    "p2p_init_ports",
    "p2p_lookup_ports",
    "enable_pd",
    "pd_role",
    "pd_buffer_size",
    "pd_buffer_device",
    "pd_peer_host",
    "pd_peer_init_port",
    "pd_peer_alloc_port",
    "pd_proxy_host",
    "pd_proxy_port",
    "transfer_channel",
    "nixl_backends",
}


def test_pd_roles_use_lmcache_05_names_only():
    objs = render([EXAMPLES / "pd-roles.yaml"])
    pre, dec = container(engine(objs, "prefill")), container(engine(objs, "decode"))
    for c in (pre, dec):
        for name in env_of(c):
            if name.startswith("LMCACHE_") and name != "LMCACHE_TRACK_USAGE":
                assert name.removeprefix("LMCACHE_").lower() in LMCACHE_05_KEYS, name
    assert json.loads(flag(pre["args"], "--kv-transfer-config"))["kv_role"] == "kv_producer"
    assert json.loads(flag(dec["args"], "--kv-transfer-config"))["kv_role"] == "kv_consumer"
    p, d = env_of(pre), env_of(dec)
    assert (p["LMCACHE_ENABLE_PD"]["value"], p["LMCACHE_PD_ROLE"]["value"]) == ("true", "sender")
    assert (
        p["LMCACHE_PD_PROXY_HOST"]["value"] == router_name("Service")  # the router is the PD proxy
        and p["LMCACHE_PD_PROXY_PORT"]["value"] == "7500"
    )
    assert p["LMCACHE_TRANSFER_CHANNEL"]["value"] == "nixl" and p["LMCACHE_NIXL_BACKENDS"]["value"] == "UCX"
    assert p["LMCACHE_LOCAL_CPU"]["value"] == "false"
    assert d["LMCACHE_PD_ROLE"]["value"] == "receiver"
    assert (d["LMCACHE_PD_PEER_INIT_PORT"]["value"], d["LMCACHE_PD_PEER_ALLOC_PORT"]["value"]) == (
        "7300",
        "7400",
    )
    assert d["LMCACHE_PD_BUFFER_SIZE"]["value"] == "2147483648"
    assert d["LMCACHE_P2P_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert d["LMCACHE_P2P_INIT_PORTS"]["value"] == "8200"
    assert d["LMCACHE_LMCACHE_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert d["LMCACHE_CONTROLLER_PULL_URL"]["value"] == "tcp://lmcache-controller:8300"
    assert d["LMCACHE_LMCACHE_WORKER_PORTS"]["value"] == "8500"


# --- KEDA ------------------------------------------------------------------------------------------------


def test_seed_keda_block_scales_llama3_with_one_element_query():
    objs = render([SEED_KEDA])
    so = one(objs, "ScaledObject", engine_name("llama3", "ScaledObject"))
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": engine_name("llama3"),
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 3)
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (15, 360)
    assert spec["advanced"] == {"restoreToOriginalReplicaCount": False}
    assert isinstance(spec["triggers"], list) and len(spec["triggers"]) == 1
    t = spec["triggers"][0]
    assert t["type"] == "prometheus"
    assert (
        t["metadata"]["query"]
        == f'sum(vllm:num_requests_waiting{{model_name="meta-llama/Llama-3.1-8B-Instruct",namespace="{NAMESPACE}"}})'
    )
    assert t["metadata"]["threshold"] == "5"
    assert t["metadata"]["serverAddress"] == "http://prometheus:9090"  # from the chart-wide trigger
    assert "replicas" not in engine(objs, "llama3")["spec"]  # KEDA owns the replica count


def test_keda_default_trigger_and_scale_from_zero():
    objs = render([EXAMPLES / "keda-scale-from-zero.yaml"])
    so = one(objs, "ScaledObject", engine_name("llama3", "ScaledObject"))["spec"]
    assert so["minReplicaCount"] == 0 and so["maxReplicaCount"] == 4
    queue, wake = so["triggers"]
    assert queue["metadata"] == {
        "query": f'sum(vllm:num_requests_waiting{{model_name="meta-llama/Llama-3.1-8B-Instruct",namespace="{NAMESPACE}"}})',
        "threshold": "5",
        "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
    }
    scope = f'{{model="meta-llama/Llama-3.1-8B-Instruct",namespace="{NAMESPACE}"}}'
    assert wake["metadata"]["query"] == (  # ended requests, plus those waiting in the router's queue
        f"(sum(rate(vllm_stack_router_requests_total{scope}[2m])) or vector(0))"
        f" + (sum(vllm_stack_router_queue_length{scope}) or vector(0))"
    )
    assert wake["metadata"]["activationThreshold"] == "0"
    assert not find(objs, "ScaledObject", engine_name("qwen", "ScaledObject"))  # keda.enabled: false
    assert engine(objs, "qwen")["spec"]["replicas"] == 1


def test_user_promql_is_kept_as_written(tmp_path):
    q = 'sum(rate(vllm:num_requests_running{model_name="x"}[1m]))'
    v = values_file(
        tmp_path,
        {
            "servingEngineSpec": {
                "modelSpec": [
                    {
                        "name": "x",
                        "modelURL": "org/x",
                        "keda": {
                            "enabled": True,
                            "triggers": [
                                {
                                    "type": "prometheus",
                                    "metadata": {
                                        "query": q,
                                        "threshold": 2,
                                        "serverAddress": "http://p:9090",
                                    },
                                },
                                {"type": "cpu", "metricType": "Utilization", "metadata": {"value": "80"}},
                            ],
                        },
                    }
                ]
            }
        },
    )
    t = one(render([v]), "ScaledObject")["spec"]["triggers"]
    assert t[0]["metadata"] == {"query": q, "threshold": "2", "serverAddress": "http://p:9090"}
    assert t[1] == {"type": "cpu", "metricType": "Utilization", "metadata": {"value": "80"}}


# --- observability, exposure, network policy, helm test --------------------------------------------------


def test_monitoring_objects():
    objs = render([EXAMPLES / "monitoring.yaml"])
    sms = {s["metadata"]["name"]: s for s in find(objs, "ServiceMonitor")}
    eng, rt = sms[f"{RELEASE}-engine-servicemonitor"], sms[router_name("ServiceMonitor")]
    assert eng["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "serving-engine"
    assert eng["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    assert eng["spec"]["endpoints"][0]["relabelings"][0]["replacement"] == "vllm-stack-engine"
    assert rt["spec"]["endpoints"][0]["relabelings"][0]["replacement"] == "vllm-stack-router"
    assert eng["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rule = one(objs, "PrometheusRule")
    assert (
        rule["spec"]["groups"]
        == yaml.safe_load((CHART / "files" / "prometheus-rules.yaml").read_text())["groups"]
    )
    cms = [c for c in find(objs, "ConfigMap") if c["metadata"]["labels"].get("grafana_dashboard") == "1"]
    files = sorted((CHART / "files" / "dashboards").glob("*.json"))
    assert len(cms) == len(files) and files
    for cm in cms:
        ((name, body),) = cm["data"].items()
        assert json.loads(body) == json.loads((CHART / "files" / "dashboards" / name).read_text())


def test_exposure_objects():
    objs = render([EXAMPLES / "monitoring.yaml"])
    ing = one(objs, "Ingress")
    assert ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"] == router_name("Service")
    route = one(objs, "HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": router_name("Service"), "port": 80}]
    pool = one(objs, "InferencePool")
    assert (
        pool["spec"]["selector"]["matchLabels"] == engine(objs, "llama3")["spec"]["selector"]["matchLabels"]
    )
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    obj = one(objs, "InferenceObjective")
    assert obj["spec"] == {
        "priority": 10,
        "poolRef": {"group": "inference.networking.k8s.io", "name": pool["metadata"]["name"]},
    }
    np = one(objs, "NetworkPolicy", f"{RELEASE}-engines")
    src = np["spec"]["ingress"][0]["from"]
    assert src[0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"
    assert src[1]["namespaceSelector"] and src[1]["podSelector"]


def test_helm_test_hook_calls_models():
    pod = one(render([SEED]), "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    assert "/v1/models" in c["args"][0]
    assert env_of(c)["ROUTER_URL"]["value"] == f"http://{router_name('Service')}.{NAMESPACE}.svc:80"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_network_policy_lets_engines_reach_each_other_only_for_p2p_or_pd():
    pd = one(render([EXAMPLES / "pd-roles.yaml"]), "NetworkPolicy", f"{RELEASE}-engines")
    peers = pd["spec"]["ingress"][0]["from"]
    components = [
        p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") for p in peers
    ]
    assert components == ["router", None, "serving-engine"]  # the router is the PD proxy: no proxy of its own
    plain = one(render([EXAMPLES / "monitoring.yaml"]), "NetworkPolicy", f"{RELEASE}-engines")
    assert len(plain["spec"]["ingress"][0]["from"]) == 2  # router and Prometheus only


# --- production-stack's own values layout ----------------------------------------------------------------


def test_production_stack_style_file():
    objs = render([EXAMPLES / "production-stack-style.yaml"])
    d = engine(objs, "mistral")
    pod = d["spec"]["template"]["spec"]
    c = container(d)
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert (c["startupProbe"]["initialDelaySeconds"], c["startupProbe"]["failureThreshold"]) == (15, 60)
    assert [t["key"] for t in pod["tolerations"]] == ["nvidia.com/gpu", "dedicated"]  # appended
    assert c["envFrom"] == [{"secretRef": {"name": "s3-registry"}}]
    env = env_of(c)
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token-secret", "key": "token"}
    assert "VLLM_API_KEY" not in env  # {secretName: "", secretKey: ""} means no key
    assert env["LMCACHE_LOG_LEVEL"]["value"] == "INFO"
    assert "--enable-lora" in c["args"] and flag(c["args"], "--gpu-memory-utilization") == "0.95"
    assert flag(c["args"], "--tensor-parallel-size") == "2"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "2"
    assert (
        one(objs, "PersistentVolumeClaim", engine_name("mistral", "PersistentVolumeClaim"))["metadata"][
            "labels"
        ]["team"]
        == "llm"
    )
    emb = container(engine(objs, "embed"))["args"]
    assert (flag(emb, "--runner"), flag(emb, "--convert")) == ("pooling", "embed")
    router = one(objs, "Deployment", router_name("Deployment"))
    assert "replicas" not in router["spec"]
    hpa = one(objs, "HorizontalPodAutoscaler")["spec"]
    assert hpa["maxReplicas"] == 3 and hpa["metrics"][0]["resource"]["target"]["averageUtilization"] == 80
    assert one(objs, "PodDisruptionBudget", router_name("PodDisruptionBudget"))["spec"] == {
        "minAvailable": 1,
        "selector": router["spec"]["selector"],
    }
    svc = one(objs, "Service", router_name("Service"))["spec"]
    assert svc["type"] == "NodePort" and svc["ports"][0]["nodePort"] == 30080
    rc = container(router)
    assert rc["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert rc["livenessProbe"]["initialDelaySeconds"] == 30
    cs = one(objs, "Deployment", cache_server_name("Deployment"))
    assert container(cs)["image"] == "lmcache/vllm-openai:v0.5.6"
    assert cs["spec"]["strategy"] == {"type": "Recreate"}
    (sm,) = find(objs, "ServiceMonitor")  # only the engines asked for one
    assert sm["metadata"]["name"] == f"{RELEASE}-engine-servicemonitor"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    ep = sm["spec"]["endpoints"][0]
    assert (ep["interval"], ep["scrapeTimeout"]) == ("30s", "25s")
    assert ep["relabelings"][-1] == {
        "action": "replace",
        "targetLabel": "job",
        "replacement": "vllm-stack-engine",
    }


def test_model_resources_block_wins(tmp_path):
    res = {
        "requests": {"cpu": "2", "memory": "8Gi", "amd.com/gpu": 1},
        "limits": {"cpu": "2", "memory": "8Gi", "amd.com/gpu": 1},
    }
    v = values_file(
        tmp_path,
        {
            "servingEngineSpec": {
                "modelSpec": [{"name": "m", "modelURL": "org/m", "requestGPU": 1, "resources": res}]
            }
        },
    )
    assert container(engine(render([v]), "m"))["resources"] == res


def test_tolerations_policy_override(tmp_path):
    v = values_file(
        tmp_path,
        {
            "servingEngineSpec": {
                "tolerations": [{"key": "a", "operator": "Exists"}],
                "modelSpec": [
                    {
                        "name": "m",
                        "modelURL": "org/m",
                        "tolerations": [{"key": "b", "operator": "Exists"}],
                        "tolerationsPolicy": "override",
                    }
                ],
            }
        },
    )
    assert [t["key"] for t in engine(render([v]), "m")["spec"]["template"]["spec"]["tolerations"]] == ["b"]


def test_production_stack_named_route():
    objs = render([EXAMPLES / "production-stack-style.yaml"])
    route = one(objs, "HTTPRoute", router_name("HTTPRoute"))
    assert route["spec"]["parentRefs"] == [{"name": "acme-gw"}]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    assert route["spec"]["rules"][0]["backendRefs"] == [{"name": router_name("Service"), "port": 80}]


def test_production_stack_router_image_is_replaced_by_ours(tmp_path):
    """The seed names production-stack's router image, whose CLI differs: our router image runs instead."""
    objs = render([SEED])
    router = container(one(objs, "Deployment", router_name("Deployment")))
    assert router["image"].startswith("ghcr.io/vllm-stack/router:")
    assert "--service-discovery" in router["args"]
    own = render(
        [values_file(tmp_path, {"routerSpec": {"repository": "registry.example/me/router", "tag": "v1"}})]
    )
    assert (
        container(one(own, "Deployment", router_name("Deployment")))["image"]
        == "registry.example/me/router:v1"
    )


def test_router_scheduling_profiles_come_from_routerspec_config(tmp_path):
    """``routerSpec.config.scheduling`` (plugins and profiles) reaches the router, which builds it."""
    from vllm_stack.app import build_router
    from vllm_stack.router_cli import build_parser

    scheduling = {
        "plugins": [
            {"type": "circuit-breaker-filter"},
            {"type": "saturation-filter", "parameters": {"max_waiting": 32}},
            {"type": "least-loaded-scorer"},
            {"type": "request-tracker"},
        ],
        "schedulingProfiles": [
            {
                "name": "shed-when-full",
                "plugins": [
                    {"pluginRef": "circuit-breaker-filter"},
                    {"pluginRef": "saturation-filter"},
                    {"pluginRef": "least-loaded-scorer", "weight": 2},
                ],
            }
        ],
    }
    values = values_file(tmp_path, {"routerSpec": {"config": {"scheduling": scheduling}}})
    objs = render([SEED, values])
    mounted = one(objs, "ConfigMap", router_name("ConfigMap"))["data"]["config.yaml"]
    config_path = tmp_path / "config.yaml"
    config_path.write_text(mounted)
    args = container(one(objs, "Deployment", router_name("Deployment")))["args"]
    assert flag(args, "--config") is not None
    cli = {
        k: v for k, v in vars(build_parser().parse_args(args)).items() if v is not None and k != "config_file"
    }
    router = build_router(cli, str(config_path), environ={})
    profile = router.scheduling_description()["profiles"]["shed-when-full"]
    assert profile["filters"] == ["circuit-breaker-filter", "saturation-filter"]
    assert profile["scorers"] == {"least-loaded-scorer": 2.0}
