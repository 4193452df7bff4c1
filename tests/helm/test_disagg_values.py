"""Disaggregated prefill in the chart: production-stack's two PD files render into a prefill pool, a decode pool
and a router that orchestrates them over LMCache 0.5's PD protocol (their pre-0.5 nixl* keys translated); the
chart's own `role: prefill|decode` without LMCache gives the router's default (vllm) protocol; what cannot
work (several router replicas with LMCache's notifications, roles that disagree) fails with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.helm.chart import (
    HELMS,
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
    run_helm,
    values_file,
)
from tests.helm.test_production_stack_files import PS_DIR, compat_lines, load, manifest_and_notes
from tests.shared_data import require
from vllm_stack.router_cli import build_parser

pytestmark = pytest.mark.helm

PS_FILES = ["tutorials__values-16-disagg-prefill.yaml", "tests__values-10-disagg-prefill.yaml"]
ROUTER = router_name()
ROUTER_SERVICE = router_name("Service")
ROLE = "vllm-stack.io/role"


def ps_path(name: str) -> Path:
    return require(PS_DIR / name)


def pools(objs: list[dict]) -> tuple[dict, dict]:
    """The prefill and the decode engine Deployment (production-stack's files name them *-prefill, *-decode)."""
    engines = [d for d in find(objs, "Deployment") if d["metadata"]["name"] != ROUTER]
    (prefill,) = [d for d in engines if d["metadata"]["name"].endswith("-prefill-deployment-vllm")]
    (decode,) = [d for d in engines if d["metadata"]["name"].endswith("-decode-deployment-vllm")]
    return prefill, decode


def kv_role(deployment: dict) -> str | None:
    config = flag(container(deployment)["args"], "--kv-transfer-config")
    return json.loads(config)["kv_role"] if config else None


def router_args(objs: list[dict]) -> list[str]:
    return container(one(objs, "Deployment", ROUTER))["args"]


def pool_values(**router) -> dict:
    """The chart's own spelling: two pools of one model by `role`, no LMCache."""
    return {
        "servingEngineSpec": {
            "modelSpec": [
                {"name": "prefill", "modelURL": "org/m", "role": "prefill", "replicaCount": 2},
                {"name": "decode", "modelURL": "org/m", "role": "decode", "replicaCount": 3},
            ]
        },
        "routerSpec": router,
    }


# --- production-stack's files -----------------------------------------------------------------------------


@pytest.mark.parametrize("helm", sorted(HELMS))
@pytest.mark.parametrize("name", PS_FILES)
def test_production_stack_pd_files_render(name, helm):
    proc = run_helm(helm, "template", RELEASE, ".", "-n", "llm", "-f", str(ps_path(name)))
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", PS_FILES)
def test_prefill_pool_is_an_lmcache_sender_that_notifies_the_router(name):
    objs = render([ps_path(name)])
    prefill, _ = pools(objs)
    assert prefill["spec"]["template"]["metadata"]["labels"][ROLE] == "prefill"
    assert prefill["metadata"]["labels"][ROLE] == "prefill"
    assert ROLE not in prefill["spec"]["selector"]["matchLabels"]  # a Deployment's selector is immutable
    assert kv_role(prefill) == "kv_producer"
    env = env_of(container(prefill))
    assert (env["LMCACHE_ENABLE_PD"]["value"], env["LMCACHE_PD_ROLE"]["value"]) == ("true", "sender")
    assert (
        env["LMCACHE_PD_PROXY_HOST"]["value"]
        == ROUTER_SERVICE
        == one(objs, "Service", ROUTER_SERVICE)["metadata"]["name"]
    )
    assert env["LMCACHE_PD_PROXY_PORT"]["value"] == "7500"
    # nixlBufferSize / nixlBufferDevice in LMCache 0.5's names; no pre-0.5 variable is set.
    assert env["LMCACHE_PD_BUFFER_SIZE"]["value"] == "1073741824"
    assert env["LMCACHE_PD_BUFFER_DEVICE"]["value"] == "cuda"
    assert not [k for k in env if "NIXL_ROLE" in k or "NIXL_PEER" in k or k == "LMCACHE_ENABLE_NIXL"]


@pytest.mark.parametrize("name", PS_FILES)
def test_decode_pool_is_an_lmcache_receiver_on_the_files_port(name):
    _, decode = pools(render([ps_path(name)]))
    assert decode["spec"]["template"]["metadata"]["labels"][ROLE] == "decode"
    assert decode["metadata"]["labels"][ROLE] == "decode"
    assert kv_role(decode) == "kv_consumer"
    env = env_of(container(decode))
    assert env["LMCACHE_PD_ROLE"]["value"] == "receiver"
    assert env["LMCACHE_PD_PEER_INIT_PORT"]["value"] == "55555"  # nixlPeerPort
    assert env["LMCACHE_PD_PEER_ALLOC_PORT"]["value"] == "7400"  # not given: LMCache's default
    assert env["LMCACHE_PD_PEER_HOST"]["value"] == "0.0.0.0"


@pytest.mark.parametrize("name", PS_FILES)
def test_pods_given_gpus_get_no_node_wide_cuda_visible_devices(name, tmp_path):
    """With requestGPU the device plugin gives each pod its own GPUs, numbered from 0: production-stack's "1"
    would hide the only one. As the files are (no GPU requested) the pinning is kept
    (tests/helm/test_production_stack_start.py)."""
    values = yaml.safe_load(ps_path(name).read_text())
    for m in values["servingEngineSpec"]["modelSpec"]:
        m["requestGPU"] = 1
    path = tmp_path / "gpus.yaml"
    path.write_text(yaml.safe_dump(values))
    for d in pools(render([path])):
        assert "CUDA_VISIBLE_DEVICES" not in env_of(container(d))


@pytest.mark.parametrize("name", PS_FILES)
def test_the_router_orchestrates_over_lmcache_pd(name):
    objs = render([ps_path(name)])
    args = router_args(objs)
    assert flag(args, "--routing-logic") == "disaggregated_prefill"
    assert "--disaggregation" in args
    assert flag(args, "--disagg-protocol") == "lmcache"
    assert flag(args, "--disagg-receiver-init-port") == "55555"
    assert flag(args, "--disagg-notify-port") == "7500"
    parsed = build_parser().parse_args(args)  # exits (SystemExit) on an unknown flag
    assert (parsed.disaggregation, parsed.disagg_protocol) == (True, "lmcache")
    assert (parsed.disagg_receiver_init_port, parsed.disagg_receiver_alloc_port) == (55555, 7400)
    # production-stack's own model-label flags stay as written (the role labels win where both are given).
    assert flag(args, "--prefill-model-labels") and flag(args, "--decode-model-labels")
    router = container(one(objs, "Deployment", ROUTER))
    assert {"name": "pd-notify", "containerPort": 7500, "protocol": "TCP"} in router["ports"]
    ports = one(objs, "Service", ROUTER_SERVICE)["spec"]["ports"]
    assert {"name": "pd-notify", "port": 7500, "targetPort": "pd-notify", "protocol": "TCP"} in ports


def test_the_notes_say_what_became_of_the_pre_05_keys():
    _, notes = manifest_and_notes(load("tests__values-10-disagg-prefill.yaml"))
    lines = compat_lines(notes)
    pre, dec = "servingEngineSpec.modelSpec[0].lmcacheConfig", "servingEngineSpec.modelSpec[1].lmcacheConfig"
    assert "pd.role sender" in lines[(f"{pre}.enableNixl", f"{pre}.nixlRole")]
    assert "nixlPeerPort as pd.peerInitPort" in lines[(f"{dec}.enableNixl", f"{dec}.nixlRole")]
    assert "told its receiver per request" in lines[(f"{pre}.nixlPeerHost", f"{pre}.nixlPeerPort")]
    assert "no such setting" in lines[(f"{dec}.nixlEnableGc",)]
    assert "implied by the model's role (decode" in lines[(f"{dec}.enablePD",)]
    assert (
        f"{dec}.cudaVisibleDevices",
    ) not in lines  # no GPU requested: kept as production-stack renders it
    assert "--disaggregation" in lines[("routerSpec.enablePD",)]


@pytest.mark.parametrize("values", [{"replicaCount": 2}, {"hpa": {"enabled": True}}])
def test_several_router_replicas_with_lmcache_pd_fail_with_the_reason(tmp_path, values):
    extra = values_file(tmp_path, {"routerSpec": values})
    err = render_error([ps_path(PS_FILES[0]), extra])
    assert "the router must run as one replica" in err
    assert "notifies one address, the router Service" in err


def test_network_policy_opens_the_notify_port_to_engines_only(tmp_path):
    extra = values_file(tmp_path, {"networkPolicy": {"enabled": True}})
    objs = render([ps_path(PS_FILES[0]), extra])
    policy = one(objs, "NetworkPolicy", router_name("NetworkPolicy"))
    open_rule, notify_rule = policy["spec"]["ingress"]
    assert "from" not in open_rule and open_rule["ports"] == [{"port": "http", "protocol": "TCP"}]
    assert notify_rule["ports"] == [{"port": "pd-notify", "protocol": "TCP"}]
    (peer,) = notify_rule["from"]
    assert peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "serving-engine"
    # KV caches move from the prefill to the decode engines: engines reach each other.
    engines = one(objs, "NetworkPolicy", f"{RELEASE}-engines")["spec"]["ingress"][0]["from"]
    assert any(
        p.get("podSelector", {}).get("matchLabels", {}).get("app.kubernetes.io/component") == "serving-engine"
        for p in engines
    )


def test_each_pool_keeps_its_own_autoscaling(tmp_path):
    values = load(PS_FILES[0])
    for m, top in zip(values["servingEngineSpec"]["modelSpec"], (4, 8), strict=True):
        m["keda"] = {"enabled": True, "minReplicaCount": 1, "maxReplicaCount": top}
    objs = render([values_file(tmp_path, values)])
    prefill, decode = pools(objs)
    scaled = {
        so["spec"]["scaleTargetRef"]["name"]: so["spec"]["maxReplicaCount"]
        for so in find(objs, "ScaledObject")
    }
    assert scaled == {prefill["metadata"]["name"]: 4, decode["metadata"]["name"]: 8}


# --- the chart's own spelling -------------------------------------------------------------------------------


def test_roles_without_lmcache_use_the_routers_vllm_protocol(tmp_path):
    objs = render([values_file(tmp_path, pool_values())])
    prefill, decode = pools(objs)
    assert prefill["spec"]["template"]["metadata"]["labels"][ROLE] == "prefill"
    assert decode["spec"]["template"]["metadata"]["labels"][ROLE] == "decode"
    assert (prefill["spec"]["replicas"], decode["spec"]["replicas"]) == (2, 3)
    assert kv_role(prefill) is None  # no LMCache, no connector of the chart's: vLLM's own (extraArgs)
    args = router_args(objs)
    assert "--disaggregation" in args and "--disagg-protocol" not in args
    assert "lmcache" not in args
    build_parser().parse_args(args)
    assert [p["name"] for p in one(objs, "Service", ROUTER_SERVICE)["spec"]["ports"]] == ["router-sport"]
    assert "LMCACHE_PD_ROLE" not in env_of(container(prefill))


def test_roles_with_lmcache_but_no_pd_keep_the_vllm_protocol(tmp_path):
    values = pool_values()
    for m in values["servingEngineSpec"]["modelSpec"]:
        m["lmcacheConfig"] = {"enabled": True}
    objs = render([values_file(tmp_path, values)])
    prefill, decode = pools(objs)
    assert (kv_role(prefill), kv_role(decode)) == ("kv_producer", "kv_consumer")
    assert "--disagg-protocol" not in router_args(objs)


def test_a_model_without_a_role_gets_no_label_and_serves_whole_requests(tmp_path):
    values = {
        "servingEngineSpec": {
            "modelSpec": [{"name": "m", "modelURL": "org/m", "lmcacheConfig": {"enabled": True}}]
        }
    }
    objs = render([values_file(tmp_path, values)])
    d = one(objs, "Deployment", engine_name("m", "Deployment"))
    # No label: production-stack's --prefill-model-labels would otherwise be overridden by "both".
    assert ROLE not in d["spec"]["template"]["metadata"]["labels"] and kv_role(d) == "kv_both"
    assert "--disaggregation" not in router_args(objs)
    values["servingEngineSpec"]["modelSpec"][0]["lmcacheConfig"]["kvRole"] = "kv_both"
    d = one(
        render([values_file(tmp_path, values, "kv-both.yaml")]), "Deployment", engine_name("m", "Deployment")
    )
    assert d["spec"]["template"]["metadata"]["labels"][ROLE] == "both"


def test_orchestrated_is_the_routers_disaggregated_prefill(tmp_path):
    objs, notes = manifest_and_notes(pool_values(routingLogic="disaggregated_prefill_orchestrated"))
    args = container(one(objs, "Deployment", ROUTER))["args"]
    assert flag(args, "--routing-logic") == "disaggregated_prefill"
    assert "orchestrates every disaggregated request" in compat_lines(notes)[("routerSpec.routingLogic",)]


def _model(**kw) -> dict:
    return {"name": "m", "modelURL": "org/m", **kw}


@pytest.mark.parametrize(
    "models, message",
    [
        (
            [_model(role="prefill", lmcacheConfig={"enabled": True, "pd": {"role": "receiver"}})],
            "role prefill (a prefill engine) and lmcacheConfig.pd.role receiver (a decode engine) disagree",
        ),
        (
            [_model(lmcacheConfig={"enabled": True, "kvRole": "kv_consumer", "pd": {"role": "sender"}})],
            "disagree",
        ),
        (
            [_model(lmcacheConfig={"enabled": True, "enablePD": True})],
            "enablePD asks for disaggregated prefill",
        ),
        (
            [_model(lmcacheConfig={"enabled": False, "kvRole": "kv_producer"})],
            "lmcacheConfig.enabled is not true",
        ),
        (
            [
                _model(name="p", lmcacheConfig={"enabled": True, "pd": {"role": "sender"}}),
                _model(name="d", role="decode"),
            ],
            "a decode model needs lmcacheConfig.pd.role receiver",
        ),
        (
            [
                _model(name="p", lmcacheConfig={"enabled": True, "pd": {"role": "sender"}}),
                _model(
                    name="d1",
                    lmcacheConfig={"enabled": True, "pd": {"role": "receiver", "peerInitPort": 7300}},
                ),
                _model(
                    name="d2",
                    lmcacheConfig={"enabled": True, "pd": {"role": "receiver", "peerInitPort": 7301}},
                ),
            ],
            "the router has one value for all receivers (its --disagg-receiver-init-port)",
        ),
        # production-stack's nixl* keys outside its PD spelling are still refused (LMCache 0.5 ignores them).
        (
            [_model(lmcacheConfig={"enabled": True, "enableNixl": True})],
            "lmcacheConfig.enableNixl is a pre-0.5 LMCache setting",
        ),
        (
            [_model(lmcacheConfig={"enabled": True, "nixlBufferSize": "1024", "pd": {"role": "sender"}})],
            "translated only with lmcacheConfig.enabled, enableNixl: true and nixlRole",
        ),
    ],
)
def test_inconsistent_disaggregation_fails_with_the_reason(tmp_path, models, message):
    values = {"servingEngineSpec": {"modelSpec": models}}
    assert message in render_error([values_file(tmp_path, values)])


def said(notes: list[str], path: str, words: str) -> bool:
    """A NOTES line on `path` (one of several on it) says `words`."""
    return any(line.startswith(f"  {path}: ") and words in line for line in notes)


def test_what_production_stacks_pd_pods_have_and_these_do_not_is_said_and_can_be_had():
    """production-stack runs its PD engines with hostIPC, hostPID and UCX_TLS=cuda_ipc,... and keeps the
    runtime's capabilities; this chart's pods keep their own namespaces and drop every capability.
    NOTES says both, with the key that gives each back; given, the line goes and the pod has it."""
    values = load("tests__values-10-disagg-prefill.yaml")
    objs, notes = manifest_and_notes(values)
    for i in (0, 1):
        where = f"servingEngineSpec.modelSpec[{i}].lmcacheConfig.enablePD"
        assert said(notes, where, "hostIPC and hostPID and UCX_TLS=cuda_ipc")
    assert said(notes, "servingEngineSpec.containerSecurityContext", "needs IPC_LOCK")
    assert not any(pool["spec"]["template"]["spec"].get("hostIPC") for pool in pools(objs))

    for model in values["servingEngineSpec"]["modelSpec"]:
        model["hostIPC"] = True
    values["servingEngineSpec"]["containerSecurityContext"] = {
        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    }
    objs, notes = manifest_and_notes(values)
    for i in (0, 1):
        assert not said(notes, f"servingEngineSpec.modelSpec[{i}].lmcacheConfig.enablePD", "hostIPC")
    assert not said(notes, "servingEngineSpec.containerSecurityContext", "IPC_LOCK")
    for pool in pools(objs):
        pod = pool["spec"]["template"]["spec"]
        assert pod["hostIPC"] is True and pod["hostPID"] is True
        assert "IPC_LOCK" in container(pool)["securityContext"]["capabilities"]["add"]
