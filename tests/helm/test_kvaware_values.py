"""kvaware routing in the chart: production-stack's two kvaware files render into LMCache's controller (a
Deployment and a Service of its own, on production-stack's routerSpec.lmcacheController*Port ports), engines whose
LMCache reports to it under their pod names, and a router that asks it (`--lmcache-controller-url`); what cannot
work (no LMCache engines, ports that disagree, chunks the controller does not hash alike) fails with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helm.chart import (
    EXAMPLES,
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
    values_file,
)
from tests.helm.test_production_stack_files import PS_DIR, compat_lines, load, manifest_and_notes
from tests.shared_data import require
from vllm_stack.router_cli import build_parser

pytestmark = pytest.mark.helm

CONTROLLER = f"{RELEASE}-lmcache-controller"
ROUTER = router_name()
ROUTER_SERVICE = router_name("Service")
PORTS = {"api": 9010, "pull": 9000, "reply": 9001, "heartbeat": 9002}
# production-stack's file -> its one model (the engine Deployment is <release>-<model>)
PS_FILES = {
    "tests__values-09-kvaware-routing.yaml": "opt125m",
    "tutorials__values-17-kv-aware.yaml": "gpt-oss-20b",
}


def ps_path(name: str) -> Path:
    return require(PS_DIR / name)


def model(name: str = "m", **kw) -> dict:
    return {"name": name, "modelURL": "org/m", **kw}


def lmcache_values(router: dict | None = None, **lmcache) -> dict:
    return {
        "servingEngineSpec": {"modelSpec": [model(lmcacheConfig={"enabled": True, **lmcache})]},
        "routerSpec": {"routingLogic": "kvaware", **(router or {})},
    }


def controller_parts(objs: list[dict]) -> tuple[dict, dict, dict]:
    d = one(objs, "Deployment", CONTROLLER)
    return d, container(d, "lmcache-controller"), one(objs, "Service", CONTROLLER)


# --- production-stack's files -----------------------------------------------------------------------------


@pytest.mark.parametrize("helm", sorted(HELMS))
@pytest.mark.parametrize("name", sorted(PS_FILES))
def test_the_controller_is_deployed_with_production_stacks_ports(name, helm):
    objs = render([ps_path(name)], helm=helm)
    d, c, svc = controller_parts(objs)
    assert d["spec"]["replicas"] == 1  # its index is in memory
    assert d["spec"]["strategy"] == {"type": "Recreate"}
    assert c["command"] == [
        "lmcache_controller",
        "--host",
        "0.0.0.0",
        "--port",
        "9010",
        "--monitor-ports",
        '{"pull": 9000, "reply": 9001, "heartbeat": 9002}',
    ]
    assert json.loads(c["command"][-1]) == {k: v for k, v in PORTS.items() if k != "api"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == PORTS
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        k: (v, k) for k, v in PORTS.items()
    }
    assert svc["spec"]["type"] == "ClusterIP"
    pod_labels = d["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels[k] == v for k, v in svc["spec"]["selector"].items())
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["tcpSocket"] == {"port": "api"}, probe
    pod = d["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["resources"]["limits"]["memory"]
    assert env_of(c)["LMCACHE_TRACK_USAGE"]["value"] == "false"


@pytest.mark.parametrize("name", sorted(PS_FILES))
def test_the_engines_report_to_the_controller_under_their_pod_names(name):
    objs = render([ps_path(name)])
    _, ctl, svc = controller_parts(objs)
    engine = container(one(objs, "Deployment", engine_name(PS_FILES[name], "Deployment")))
    env = env_of(engine)
    service_ports = {p["port"] for p in svc["spec"]["ports"]}
    assert env["LMCACHE_ENABLE_CONTROLLER"]["value"] == "true"
    for var, port in (("LMCACHE_CONTROLLER_PULL_URL", 9000), ("LMCACHE_CONTROLLER_REPLY_URL", 9001)):
        host, _, given = env[var]["value"].partition(":")  # LMCache 0.5: host:port, no scheme
        assert (host, int(given)) == (CONTROLLER, port) and port in service_ports, var
    assert env["LMCACHE_LMCACHE_INSTANCE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["LMCACHE_LMCACHE_WORKER_PORTS"]["value"] == "8001"
    assert env["LMCACHE_LMCACHE_WORKER_HEARTBEAT_TIME"]["value"] == "30"
    # LMCache's chunk hashes use Python's hash(): the controller and the engines hash alike.
    assert (
        env_of(ctl)["PYTHONHASHSEED"] == env["PYTHONHASHSEED"] == {"name": "PYTHONHASHSEED", "value": "123"}
    )
    assert ctl["image"] == engine["image"] == "lmcache/vllm-openai:v0.3.9post2"  # the engines' LMCache
    assert "LMCACHE_CHUNK_SIZE" not in env  # LMCache's default, 256: what the controller hashes with


@pytest.mark.parametrize("name", sorted(PS_FILES))
def test_the_router_asks_the_controller(name):
    objs = render([ps_path(name)])
    c = container(one(objs, "Deployment", ROUTER))
    args = c["args"]
    assert flag(args, "--routing-logic") == "kvaware"
    assert flag(args, "--lmcache-controller-url") == f"http://{CONTROLLER}:9010"
    assert "--kv-aware-threshold" not in args  # not given: the router's default
    # The prompt's tokens come from the model's tokenizer, fetched as prefixaware gets it.
    url = {"opt125m": "facebook/opt-125m", "gpt-oss-20b": "openai/gpt-oss-20b"}[PS_FILES[name]]
    assert flag(args, "--tokenizers") == f"{url}=hf:{url}"
    assert env_of(c)["VLLM_STACK_CACHE_DIR"]["value"] == "/tmp/vllm-stack"
    build_parser().parse_args(args)  # the router knows every flag (exits on an unknown one)
    # kvaware asks the controller, not the engines' KV events.
    engine = container(one(objs, "Deployment", engine_name(PS_FILES[name], "Deployment")))
    assert "--kv-events-config" not in engine["args"]


@pytest.mark.parametrize("name", sorted(PS_FILES))
def test_notes_say_where_the_engines_report(name):
    ps_path(name)
    _, notes = manifest_and_notes(load(name))
    lines = compat_lines(notes)
    (text,) = [
        t for p, t in lines.items() if "servingEngineSpec.modelSpec[0].lmcacheConfig.controllerPort" in p
    ]
    assert f"the chart's LMCache controller, {CONTROLLER}" in text
    assert not [p for p in lines if "routerSpec.lmcacheControllerPort" in p]  # used, not ignored


# --- the chart's own spelling -------------------------------------------------------------------------------


def test_threshold_api_port_image_and_ports_are_values(tmp_path):
    values = lmcache_values(
        {
            "kvAwareThreshold": 500,
            "lmcacheControllerPort": 7000,
            "lmcacheControllerReplyPort": "7001",
            "lmcacheControllerHeartbeatPort": 7002,
        }
    )
    values["lmcacheControllerSpec"] = {"apiPort": 7010, "repository": "reg/lmcache", "tag": "v1"}
    values["servingEngineSpec"]["pythonHashSeed"] = "42"
    objs = render([values_file(tmp_path, values)])
    _, c, _ = controller_parts(objs)
    assert c["command"][4] == "7010" and json.loads(c["command"][6]) == {
        "pull": 7000,
        "reply": 7001,
        "heartbeat": 7002,
    }
    assert c["image"] == "reg/lmcache:v1"
    args = container(one(objs, "Deployment", ROUTER))["args"]
    assert flag(args, "--lmcache-controller-url") == f"http://{CONTROLLER}:7010"
    assert flag(args, "--kv-aware-threshold") == "500"
    env = env_of(container(one(objs, "Deployment", engine_name("m", "Deployment"))))
    assert env["LMCACHE_CONTROLLER_PULL_URL"]["value"] == f"{CONTROLLER}:7000"
    assert env["LMCACHE_CONTROLLER_REPLY_URL"]["value"] == f"{CONTROLLER}:7001"
    assert env_of(c)["PYTHONHASHSEED"]["value"] == env["PYTHONHASHSEED"]["value"] == "42"


def test_the_example_file():
    objs = render([EXAMPLES / "kvaware.yaml"])
    _, c, _ = controller_parts(objs)
    engine = container(one(objs, "Deployment", engine_name("llama3", "Deployment")))
    assert c["image"] == engine["image"] == "lmcache/vllm-openai:v0.5.6"  # the chart's LMCache pin
    assert env_of(engine)["LMCACHE_CONTROLLER_PULL_URL"]["value"] == f"{CONTROLLER}:9000"
    args = container(one(objs, "Deployment", ROUTER))["args"]
    assert flag(args, "--kv-aware-threshold") == "2000"
    assert one(objs, "NetworkPolicy", CONTROLLER)
    build_parser().parse_args(args)


def test_worker_ports_default_to_one_per_gpu_worker(tmp_path):
    values = lmcache_values()
    values["servingEngineSpec"]["modelSpec"][0]["vllmConfig"] = {"tensorParallelSize": 2}
    values["servingEngineSpec"]["modelSpec"][0]["requestGPU"] = 2
    env = env_of(
        container(one(render([values_file(tmp_path, values)]), "Deployment", engine_name("m", "Deployment")))
    )
    assert env["LMCACHE_LMCACHE_WORKER_PORTS"]["value"] == "8001,8002"


def test_only_lmcache_models_report_and_an_explicit_controller_wins(tmp_path):
    values = lmcache_values()
    specs = values["servingEngineSpec"]["modelSpec"]
    specs.append(model("plain"))
    specs.append(model("off", lmcacheConfig={"enabled": True, "enableController": False}))
    specs.append(
        model(
            "own",
            lmcacheConfig={
                "enabled": True,
                "enableController": True,
                "controllerPullUrl": "ctl:8300",
                "controllerReplyUrl": "ctl:8400",
            },
        )
    )
    objs = render([values_file(tmp_path, values)])
    env = {
        n: env_of(container(one(objs, "Deployment", engine_name(n, "Deployment"))))
        for n in ("m", "plain", "off", "own")
    }
    assert env["m"]["LMCACHE_CONTROLLER_PULL_URL"]["value"] == f"{CONTROLLER}:9000"
    assert not [k for k in env["plain"] if k.startswith("LMCACHE_")]
    assert "LMCACHE_ENABLE_CONTROLLER" not in env["off"]
    assert env["own"]["LMCACHE_CONTROLLER_PULL_URL"]["value"] == "ctl:8300"
    assert env["own"]["LMCACHE_CONTROLLER_REPLY_URL"]["value"] == "ctl:8400"


def test_the_controller_alone_with_another_routing_logic(tmp_path):
    values = lmcache_values({"routingLogic": "roundrobin"})
    values["lmcacheControllerSpec"] = {"enabled": True}
    objs = render([values_file(tmp_path, values)])
    assert controller_parts(objs)
    env = env_of(container(one(objs, "Deployment", engine_name("m", "Deployment"))))
    assert env["LMCACHE_CONTROLLER_PULL_URL"]["value"] == f"{CONTROLLER}:9000"
    assert "--lmcache-controller-url" not in container(one(objs, "Deployment", ROUTER))["args"]


def test_no_controller_without_kvaware(tmp_path):
    objs = render([values_file(tmp_path, lmcache_values({"routingLogic": "prefixaware"}))])
    assert not find(objs, "Deployment", CONTROLLER) and not find(objs, "Service", CONTROLLER)
    assert "LMCACHE_ENABLE_CONTROLLER" not in env_of(
        container(one(objs, "Deployment", engine_name("m", "Deployment")))
    )


def test_network_policy_lets_engines_report_and_the_router_ask(tmp_path):
    values = lmcache_values()
    values["networkPolicy"] = {"enabled": True}
    objs = render([values_file(tmp_path, values)])
    policy = one(objs, "NetworkPolicy", CONTROLLER)
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "lmcache-controller"
    rules = {
        rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]: sorted(
            p["port"] for p in rule["ports"]
        )
        for rule in policy["spec"]["ingress"]
    }
    assert rules == {"serving-engine": ["heartbeat", "pull", "reply"], "router": ["api"]}
    engines = one(objs, "NetworkPolicy", f"{RELEASE}-engines")
    peers = [p.get("podSelector", {}).get("matchLabels", {}) for p in engines["spec"]["ingress"][0]["from"]]
    assert {"app.kubernetes.io/component": "lmcache-controller"}.items() <= next(
        p for p in peers if p.get("app.kubernetes.io/component") == "lmcache-controller"
    ).items()


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"servingEngineSpec": {"modelSpec": [model()]}, "routerSpec": {"routingLogic": "kvaware"}},
            "routerSpec.routingLogic: kvaware needs LMCache engines",
        ),
        (lmcache_values(chunkSize=512), "lmcacheConfig.chunkSize 512 with the chart's LMCache controller"),
        (
            lmcache_values(enableController=True, controllerPort=9100),
            "lmcacheConfig.controllerPort 9100 differs from routerSpec.lmcacheControllerPort (9000)",
        ),
        (
            lmcache_values(
                {"lmcacheControllerReplyPort": 9500}, enableController=True, controllerReplyPort=9001
            ),
            "lmcacheConfig.controllerReplyPort 9001 differs from routerSpec.lmcacheControllerReplyPort (9500)",
        ),
        (
            lmcache_values({"lmcacheControllerHeartbeatPort": 9010}),
            "routerSpec.lmcacheControllerHeartbeatPort and lmcacheControllerSpec.apiPort are both 9010",
        ),
        (
            {**lmcache_values(), "lmcacheControllerSpec": {"enabled": False}},
            "lmcacheControllerSpec.enabled: false, but routerSpec.routingLogic: kvaware",
        ),
        (
            lmcache_values(workerPorts="8001"),
            None,  # renders: one GPU worker
        ),
    ],
)
def test_what_cannot_work_fails_with_the_reason(tmp_path, values, message):
    if message is None:
        assert render([values_file(tmp_path, values)])
        values["servingEngineSpec"]["modelSpec"][0]["vllmConfig"] = {"tensorParallelSize": 2}
        values["servingEngineSpec"]["modelSpec"][0]["requestGPU"] = 2
        message = "lmcacheConfig.workerPorts gives 1 port(s) for 2 GPU workers"
    assert message in render_error([values_file(tmp_path, values)])
