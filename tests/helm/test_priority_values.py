"""Request priority in the chart: the router's `models` (every deployed model, its `criticality` and
whether its engines run vLLM's priority scheduler), adapters' criticality, `routerSpec.priority` as router
settings, the priority keys' Secret, and the KEDA wake-up that counts requests waiting in the router."""

from __future__ import annotations

import pytest
import yaml

from tests.helm.chart import (
    NAMESPACE,
    RELEASE,
    container,
    engine_name,
    flag,
    one,
    render,
    render_error,
    router_name,
    run_helm,
    values_file,
)
from vllm_stack.config import load_config
from vllm_stack.router_cli import build_parser

pytestmark = pytest.mark.helm

HELMS = ["helm3", "helm4"]


def router_config(objs: list[dict]) -> dict:
    return yaml.safe_load(one(objs, "ConfigMap", router_name("ConfigMap"))["data"]["config.yaml"])


def engine_args(objs: list[dict], model: str) -> list[str]:
    return container(one(objs, "Deployment", engine_name(model, "Deployment")))["args"]


def models(*entries: dict) -> dict:
    return {"servingEngineSpec": {"modelSpec": list(entries)}}


def test_every_deployed_model_is_in_the_routers_models(tmp_path) -> None:
    values = models(
        {"name": "a", "modelURL": "org/a", "criticality": "critical", "schedulingPolicy": "priority"},
        {"name": "b", "modelURL": "org/b", "vllmConfig": {"extraArgs": ["--scheduling-policy", "priority"]}},
        {"name": "c", "modelURL": "org/c", "vllmConfig": {"extraArgs": ["--scheduling-policy=priority"]}},
        {"name": "d", "modelURL": "org/d", "criticality": "sheddable", "schedulingPolicy": "fcfs"},
        {"name": "e", "modelURL": "org/e", "vllmConfig": {"servedModelName": "chat"}},
        {"name": "f", "modelURL": "org/f", "enabled": False, "criticality": "critical"},
    )
    objs = render([values_file(tmp_path, values)])
    assert router_config(objs)["models"] == [
        {"name": "org/a", "criticality": "critical", "engine_priority": True},
        {"name": "org/b", "engine_priority": True},  # production-stack users write the flag in extraArgs
        {"name": "org/c", "engine_priority": True},
        {"name": "org/d", "criticality": "sheddable"},
        {"name": "chat"},  # the served name; no criticality: the router's default (standard)
    ]
    router = container(one(objs, "Deployment", router_name("Deployment")))
    assert flag(router["args"], "--config") == "/etc/vllm-stack/router/config.yaml"
    # the vLLM flag: from schedulingPolicy, or as the user wrote it in extraArgs, and never twice
    assert flag(engine_args(objs, "a"), "--scheduling-policy") == "priority"
    for model, written in [
        ("b", ["--scheduling-policy", "priority"]),
        ("c", ["--scheduling-policy=priority"]),
    ]:
        args = engine_args(objs, model)
        assert [a for a in args if a.startswith("--scheduling-policy")] == written[:1], args
        assert args[-len(written) :] == written
    assert flag(engine_args(objs, "d"), "--scheduling-policy") == "fcfs"
    assert not [a for a in engine_args(objs, "e") if a.startswith("--scheduling-policy")]
    # the router accepts the configuration it is given
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(router_config(objs)))
    loaded = load_config({"static_backends": "http://e:8000"}, str(path))
    assert [m["name"] for m in loaded.models] == ["org/a", "org/b", "org/c", "org/d", "chat"]


def test_the_same_policy_in_both_places_renders_once_and_a_conflict_is_refused(tmp_path) -> None:
    both = {"name": "a", "modelURL": "org/a", "schedulingPolicy": "priority"}
    values = models({**both, "vllmConfig": {"extraArgs": ["--scheduling-policy", "priority"]}})
    args = engine_args(render([values_file(tmp_path, values)]), "a")
    assert args.count("--scheduling-policy") == 1 and args[-2:] == ["--scheduling-policy", "priority"]
    values = models(
        {**both, "schedulingPolicy": "fcfs", "vllmConfig": {"extraArgs": ["--scheduling-policy=priority"]}}
    )
    err = render_error([values_file(tmp_path, values, "conflict.yaml")])
    assert "schedulingPolicy fcfs and --scheduling-policy priority in vllmConfig.extraArgs disagree" in err


def test_entries_serving_one_name_must_agree(tmp_path) -> None:
    same = {"modelURL": "org/a", "criticality": "critical"}
    objs = render([values_file(tmp_path, models({"name": "a", **same}, {"name": "b", **same}))])
    assert router_config(objs)["models"] == [{"name": "org/a", "criticality": "critical"}]
    values = models({"name": "a", **same}, {"name": "b", "modelURL": "org/a"})
    err = render_error([values_file(tmp_path, values, "differ.yaml")])
    assert 'servingEngineSpec.modelSpec[1] (b): serves "org/a" like another modelSpec entry' in err


def test_the_users_own_models_setting_is_kept(tmp_path) -> None:
    values = {
        **models({"name": "a", "modelURL": "org/a", "criticality": "critical"}),
        "routerSpec": {"config": {"models": ["org/a", "elsewhere"]}},
    }
    assert router_config(render([values_file(tmp_path, values)]))["models"] == ["org/a", "elsewhere"]


def test_no_models_no_configuration() -> None:
    objs = render()
    assert not [
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == router_name("ConfigMap")
    ]
    assert "--config" not in container(one(objs, "Deployment", router_name("Deployment")))["args"]


@pytest.mark.parametrize("helm", HELMS)
def test_a_bad_criticality_or_policy_names_the_key_and_the_choices(tmp_path, helm) -> None:
    bad = values_file(tmp_path, models({"name": "m", "modelURL": "org/m", "criticality": "urgent"}))
    err = render_error([bad], helm=helm)
    assert "criticality" in err and "sheddable" in err
    bad = values_file(tmp_path, models({"name": "m", "schedulingPolicy": "lifo"}), "policy.yaml")
    err = render_error([bad], helm=helm)
    assert "schedulingPolicy" in err and "priority" in err
    bad_adapter = {
        **models({"name": "m", "modelURL": "org/m"}),
        "loraAdapters": [
            {
                "name": "x",
                "baseModel": "m",
                "criticality": "low",
                "adapterSource": {"type": "local", "adapterPath": "/x"},
            }
        ],
    }
    err = render_error([values_file(tmp_path, bad_adapter, "adapter.yaml")], helm=helm)
    assert "criticality" in err and "sheddable" in err


def test_the_template_refuses_a_bad_criticality_without_the_schema(tmp_path) -> None:
    """The chart's own message (what --skip-schema-validation, or a schema-less tool, gets)."""
    bad = values_file(tmp_path, models({"name": "m", "modelURL": "org/m", "criticality": "urgent"}))
    proc = run_helm("helm4", "template", RELEASE, ".", "--skip-schema-validation", "-f", str(bad))
    assert proc.returncode != 0
    assert (
        'servingEngineSpec.modelSpec[0] (m): criticality must be critical, standard or sheddable (got "urgent")'
        in proc.stderr
    )


def test_adapters_carry_their_criticality(tmp_path) -> None:
    values = {
        **models({"name": "m", "modelURL": "org/m"}),
        "loraAdapters": [
            {
                "name": "x",
                "baseModel": "m",
                "criticality": "sheddable",
                "adapterSource": {"type": "local", "adapterPath": "/x"},
            },
            {"name": "plain", "baseModel": "m", "adapterSource": {"type": "local", "adapterPath": "/p"}},
        ],
    }
    config = router_config(render([values_file(tmp_path, values)]))
    assert config["lora_adapters"] == [
        {"name": "x", "source": "/x", "base_model": "org/m", "tier": "warm", "criticality": "sheddable"},
        {"name": "plain", "source": "/p", "base_model": "org/m", "tier": "warm"},  # none: its base model's
    ]


def test_priority_keys_are_mounted_and_passed(tmp_path) -> None:
    values = {
        "routerSpec": {"priority": {"apiKeysSecret": {"secretName": "raisers", "secretKey": "keys.txt"}}}
    }
    deployment = one(render([values_file(tmp_path, values)]), "Deployment", router_name("Deployment"))
    router = container(deployment)
    assert flag(router["args"], "--priority-api-keys-file") == "/etc/vllm-stack/priority-keys/keys"
    mounts = {m["name"]: m for m in router["volumeMounts"]}
    assert mounts["priority-keys"] == {
        "name": "priority-keys",
        "mountPath": "/etc/vllm-stack/priority-keys",
        "readOnly": True,
    }
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["priority-keys"]["secret"] == {
        "secretName": "raisers",
        "items": [{"key": "keys.txt", "path": "keys"}],
    }
    assert build_parser().parse_args(router["args"]).priority_api_keys_file == (
        "/etc/vllm-stack/priority-keys/keys"
    )
    default = container(one(render(), "Deployment", router_name("Deployment")))
    assert "--priority-api-keys-file" not in default["args"]
    assert "priority-keys" not in {m["name"] for m in default["volumeMounts"]}


def test_priority_settings_reach_the_router(tmp_path) -> None:
    base = models({"name": "m", "modelURL": "org/m"})
    # the defaults are the router's own: nothing is rendered for them
    assert router_config(render([values_file(tmp_path, base)])) == {"models": [{"name": "org/m"}]}
    values = {
        **base,
        "routerSpec": {
            "priority": {
                "enabled": False,
                "header": "x-tenant-priority",
                "saturation": {"maxWaiting": 8, "maxKvCacheUsage": 0.9},
                "criticalMaxWaiting": 64,
                "criticalReserveSlots": 1,
                "queue": {"maxPerModel": 200, "timeoutSeconds": 30},
            },
            "config": {"queue_timeout": 45},  # routerSpec.config's own setting is kept
        },
    }
    config = router_config(render([values_file(tmp_path, values, "priority.yaml")]))
    assert config == {
        "models": [{"name": "org/m"}],
        "priority_scheduling": False,
        "priority_header": "x-tenant-priority",
        "saturation_max_waiting": 8,
        "saturation_max_kv_cache_usage": 0.9,
        "critical_max_waiting": 64,
        "critical_reserve_slots": 1,
        "queue_max_per_model": 200,
        "queue_timeout": 45,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = load_config({"static_backends": "http://e:8000"}, str(path))
    assert (loaded.priority_scheduling, loaded.priority_header) == (False, "x-tenant-priority")
    assert (loaded.saturation_max_waiting, loaded.saturation_max_kv_cache_usage) == (8, 0.9)
    assert (loaded.critical_max_waiting, loaded.queue_max_per_model, loaded.queue_timeout) == (64, 200, 45)


def test_eviction_values_reach_the_router(tmp_path) -> None:
    base = models({"name": "m", "modelURL": "org/m"})
    off = router_config(render([values_file(tmp_path, base)]))
    assert "eviction_enabled" not in off and "eviction_after" not in off  # off: the router's default
    values = {**base, "routerSpec": {"priority": {"eviction": {"enabled": True, "afterSeconds": 5}}}}
    config = router_config(render([values_file(tmp_path, values, "eviction.yaml")]))
    assert (config["eviction_enabled"], config["eviction_after"]) == (True, 5)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = load_config({"static_backends": "http://e:8000"}, str(path))
    assert (loaded.eviction_enabled, loaded.eviction_after) == (True, 5)


@pytest.mark.parametrize(
    "priority, where",
    [
        ({"eviction": {"afterSeconds": 0}}, "afterSeconds"),
        ({"eviction": {"enabled": "yes"}}, "enabled"),
        ({"saturation": {"maxKvCacheUsage": 1.5}}, "maxKvCacheUsage"),
        ({"queue": {"timeoutSeconds": 0}}, "timeoutSeconds"),
        ({"queue": {"maxPerModel": -1}}, "maxPerModel"),
        ({"header": "x prio"}, "header"),
        ({"maxWaiting": 5}, "maxWaiting"),  # belongs under saturation
    ],
)
def test_priority_values_are_checked(tmp_path, priority, where) -> None:
    assert where in render_error([values_file(tmp_path, {"routerSpec": {"priority": priority}})])


def test_keda_wakes_a_model_on_requests_waiting_in_the_router(tmp_path) -> None:
    values = models(
        {
            "name": "m",
            "modelURL": "org/m",
            "keda": {"enabled": True, "minReplicaCount": 0, "activation": {"enabled": True}},
        }
    )
    so = one(render([values_file(tmp_path, values)]), "ScaledObject", engine_name("m", "ScaledObject"))[
        "spec"
    ]
    (wake,) = [t for t in so["triggers"] if t.get("name") == "router-requests"]
    scope = f'{{model="org/m",namespace="{NAMESPACE}"}}'
    assert wake["metadata"]["query"] == (
        f"(sum(rate(vllm_stack_router_requests_total{scope}[1m])) or vector(0))"
        f" + (sum(vllm_stack_router_queue_length{scope}) or vector(0))"
    )
    assert wake["metadata"]["activationThreshold"] == "0"
