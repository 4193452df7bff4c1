"""The chart's LoRA adapter registry: production-stack's `loraAdapters` layout becomes the router's
`lora_adapters`, base models' engines can load adapters at run time, weighted names and the admin key
reach the router, and the router accepts the configuration it is given."""

from __future__ import annotations

import pytest
import yaml

from tests.helm.chart import (
    ROOT,
    container,
    engine_name,
    env_of,
    flag,
    one,
    render,
    render_error,
    router_name,
    values_file,
)
from tests.shared_data import require
from vllm_stack.config import load_config
from vllm_stack.engines.adapters import AdapterCatalog

pytestmark = pytest.mark.helm

LORA_HELM = ROOT.parent / "shared" / "production-stack-values" / "tutorials__values-09-lora-helm.yaml"


def router_config(objs: list[dict]) -> dict:
    return yaml.safe_load(one(objs, "ConfigMap", router_name("ConfigMap"))["data"]["config.yaml"])


def test_production_stacks_lora_file_registers_its_adapter_with_the_router(tmp_path) -> None:
    objs = render([require(LORA_HELM)])
    config = router_config(objs)
    assert config["lora_adapters"] == [
        {
            "name": "llama-3.1-nemoguard-8b-topic-control",  # adapterSource.adapterName: what clients request
            "source": "hf:nvidia/llama-3.1-nemoguard-8b-topic-control",
            "base_model": "meta-llama/Llama-3.1-8B-Instruct",  # baseModel "llama3" is the modelSpec's name
            "tier": "warm",
        }
    ]
    router = container(one(objs, "Deployment", router_name("Deployment")))
    assert flag(router["args"], "--config") == "/etc/vllm-stack/router/config.yaml"
    engine = container(one(objs, "Deployment", engine_name("llama3", "Deployment")))
    assert "--enable-lora" in engine["args"]
    names = [e["name"] for e in engine["env"]]
    assert names.count("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == 1  # the file sets it itself: not twice
    # the router loads what the chart renders
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = load_config({"static_backends": "http://e:8000"}, str(path))
    catalog = AdapterCatalog.from_settings(loaded.lora_adapters, loaded.weighted_models)
    assert (
        catalog.get("llama-3.1-nemoguard-8b-topic-control").lora_path
        == "nvidia/llama-3.1-nemoguard-8b-topic-control"
    )


def test_adapters_tiers_weighted_names_and_admin_keys(tmp_path) -> None:
    values = {
        "servingEngineSpec": {"modelSpec": [{"name": "tiny", "modelURL": "org/tiny", "replicaCount": 1}]},
        "loraAdapters": [
            {
                "name": "a1",
                "baseModel": "tiny",
                "tier": "hot",
                "adapterSource": {"type": "local", "adapterPath": "/data/a1"},
            },
            {
                "name": "a2",
                "baseModel": "org/tiny",
                "enabled": False,
                "adapterSource": {"type": "local", "adapterPath": "/x"},
            },
        ],
        "routerSpec": {
            "weightedModels": {"chat": [{"model": "org/tiny", "weight": 90}, {"model": "a1", "weight": 10}]},
            "adminApiKeysSecret": {"secretName": "admins", "secretKey": "keys"},
            "config": {"retries": 3},
        },
    }
    objs = render([values_file(tmp_path, values)])
    config = router_config(objs)
    assert config["retries"] == 3
    assert config["lora_adapters"] == [
        {"name": "a1", "source": "/data/a1", "base_model": "org/tiny", "tier": "hot"}
    ]
    assert config["weighted_models"] == values["routerSpec"]["weightedModels"]
    deployment = one(objs, "Deployment", router_name("Deployment"))
    router = container(deployment)
    assert flag(router["args"], "--admin-api-keys-file") == "/etc/vllm-stack/admin-keys/keys"
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["admin-keys"]["secret"]["secretName"] == "admins"
    engine = container(one(objs, "Deployment", engine_name("tiny", "Deployment")))
    assert "--enable-lora" in engine["args"]
    assert env_of(engine)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "True"


def test_an_adapter_whose_base_model_is_not_deployed_is_refused(tmp_path) -> None:
    values = {
        "servingEngineSpec": {"modelSpec": [{"name": "tiny", "modelURL": "org/tiny", "replicaCount": 1}]},
        "loraAdapters": [
            {"name": "a1", "baseModel": "other", "adapterSource": {"type": "local", "adapterPath": "/a"}}
        ],
    }
    assert 'baseModel "other" is no deployed modelSpec' in render_error([values_file(tmp_path, values)])
