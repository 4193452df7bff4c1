"""values.schema.json ships with the chart and is strict: typos, wrong types, enums and ranges fail
`helm template` with a message naming the key; production-stack keys the chart does not implement fail
with an explanation instead of being ignored."""

from __future__ import annotations

import json
import subprocess
import tarfile

import pytest

from tests.helm.chart import CHART, helm_path, render_error, values_file

pytestmark = pytest.mark.helm

HELMS = ["helm3", "helm4"]


def model(**kw):
    return {"servingEngineSpec": {"modelSpec": [{"name": "m", "modelURL": "org/m", **kw}]}}


@pytest.mark.parametrize("helm", HELMS)
def test_typo_in_a_model_names_the_key(tmp_path, helm):
    err = render_error([values_file(tmp_path, model(replicaCont=2))], helm=helm)
    assert "replicaCont" in err and "schema" in err


@pytest.mark.parametrize(
    "values, word",
    [
        ({"routerSpec": {"replicaCont": 2}}, "replicaCont"),
        ({"servingEngineSpec": {"enableEngines": True}}, "enableEngines"),
        ({"routingLogic": "roundrobin"}, "routingLogic"),
        (model(vllmConfig={"maxModelLength": 4096}), "maxModelLength"),
        (model(lmcacheConfig={"enabled": True, "cpuOffloadBufferSize": 5}), "cpuOffloadBufferSize"),
        (model(keda={"minReplicas": 1}), "minReplicas"),
    ],
)
@pytest.mark.parametrize("helm", HELMS)
def test_unknown_keys_are_rejected_by_name(tmp_path, helm, values, word):
    assert word in render_error([values_file(tmp_path, values)], helm=helm)


@pytest.mark.parametrize(
    "values, where",
    [
        ({"routerSpec": {"routingLogic": "fastest"}}, "routingLogic"),
        (model(replicaCount="two"), "replicaCount"),
        (model(replicaCount=-1), "replicaCount"),
        (model(vllmConfig={"gpuMemoryUtilization": 1.5}), "gpuMemoryUtilization"),
        (model(vllmConfig={"dtype": "fp64"}), "dtype"),
        (model(name="Bad_Name"), "name"),
        (model(requestMemory="lots"), "requestMemory"),
        (
            model(keda={"triggers": {"type": "prometheus"}}),
            "triggers",
        ),  # production-stack typed it as an object
        (model(lmcacheConfig={"enabled": True, "pd": {"role": "prefiller"}}), "role"),
        ({"servingEngineSpec": {"containerPort": 70000}}, "containerPort"),
    ],
)
def test_types_enums_and_ranges(tmp_path, values, where):
    assert f"/{where}'" in render_error([values_file(tmp_path, values)])  # the path of the offending key


@pytest.mark.parametrize(
    "values, message",
    [
        (
            model(lmcacheConfig={"enabled": True, "nixlRole": "sender"}),
            "LMCache 0.5 silently ignores; use lmcacheConfig.pd.role",
        ),
        (model(lmcacheConfig={"enabled": True, "enableNixl": True}), "enableNixl"),
        (model(lmcacheConfig={"enabled": True, "controllerPort": 9000}), "controllerPullUrl"),
        ({"routerSpec": {"rootPath": "api/"}}, "rootPath"),
        (
            {
                "loraAdapters": [
                    {"baseModel": "nope", "adapterSource": {"type": "local", "adapterPath": "/a"}}
                ]
            },
            'baseModel "nope" is no deployed modelSpec',
        ),
        (
            {
                "servingEngineSpec": {
                    "modelSpec": [{"name": "a", "modelURL": "o/a"}, {"name": "a", "modelURL": "o/b"}]
                }
            },
            'duplicate model name "a"',
        ),
        (model(existingClaim="c", pvcStorage="1Gi"), "either existingClaim or pvcStorage"),
        (
            model(lmcacheConfig={"enabled": True, "enableController": True}),
            "(m): lmcacheConfig.enableController needs lmcacheConfig.controllerPullUrl here",
        ),
        ({"routerSpec": {"routingLogic": "session"}}, "sessionKey is required"),
        ({"routerSpec": {"serviceDiscovery": "static"}}, "staticBackends is required"),
    ],
)
@pytest.mark.parametrize("helm", HELMS)
def test_unimplemented_or_inconsistent_settings_fail_clearly(tmp_path, helm, values, message):
    assert message in render_error([values_file(tmp_path, values)], helm=helm)


def test_schema_ships_in_the_packaged_chart(tmp_path):
    subprocess.run(
        [str(helm_path("helm4")), "package", str(CHART), "-d", str(tmp_path)], check=True, capture_output=True
    )
    (pkg,) = tmp_path.glob("vllm-stack-*.tgz")
    names = tarfile.open(pkg).getnames()
    assert "vllm-stack/values.schema.json" in names
    assert "vllm-stack/files/prometheus-rules.yaml" in names
    assert not [n for n in names if "/examples/" in n]


def test_schema_is_strict_everywhere():
    """Every object in the schema closes its properties (free-form maps are explicit)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    open_objects = []

    def walk(node, path):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and node.get("additionalProperties", True) is True  # False, or a schema for named entries
            ):
                open_objects.append(path)
            for k, v in node.items():
                walk(v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")

    walk(schema, "")
    assert not open_objects


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"routerSpec": {"k8sServiceDiscoveryType": "service-name"}},
            "k8sServiceDiscoveryType: service-name (production-stack's router then sends to each model's Service) is not implemented",
        ),
        (model(lmcacheConfig={"enabled": True, "controllerPort": 9000}), "without enableController"),
    ],
)
def test_production_stack_keys_fail_only_when_they_ask_for_something(tmp_path, values, message):
    # Issue 12 turned routerSpec.lmcacheControllerPort and requestStatsWindow into NOTES lines and
    # implemented requestGPUMem (HAMi) and initContainer: tests/helm/test_production_stack_files.py.
    assert message in render_error([values_file(tmp_path, values)])


def test_truncated_object_names_never_collide(tmp_path):
    long = "m" * 39
    v = values_file(
        tmp_path,
        {
            "fullnameOverride": "f" * 40,
            "servingEngineSpec": {
                "modelSpec": [
                    {"name": long + "a", "modelURL": "o/a"},
                    {"name": long + "b", "modelURL": "o/b"},
                ]
            },
        },
    )
    assert "is taken by another model" in render_error([v])
