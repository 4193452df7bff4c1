"""Values that render but cannot run are refused with the reason, for deployed models only: more
tensor-parallel workers than GPUs, KEDA's minReplicaCount above maxReplicaCount, a nodePort on a ClusterIP
Service, a model without modelURL. production-stack's default values.yaml keeps a disabled model with
tensorParallelSize 2 on one GPU, and renders; no production-stack file that renders is refused
(tests/helm/test_production_stack_files.py compares all of them with the outcome table)."""

from __future__ import annotations

import pytest

from tests.helm.chart import container, engine_name, one, render, render_error, router_name, values_file
from tests.shared_data import PS_VALUES, require

pytestmark = pytest.mark.helm


def _model(**kw) -> dict:
    return {"servingEngineSpec": {"modelSpec": [{"name": "m", "modelURL": "org/m", **kw}]}}


def _refused(tmp_path, values) -> str:
    err = render_error([values_file(tmp_path, values)])
    assert "schema" not in err
    return err


def _renders(tmp_path, values, name="ok.yaml") -> list[dict]:
    return render([values_file(tmp_path, values, name)])


@pytest.mark.parametrize(
    "model, gpus",
    [
        ({"vllmConfig": {"tensorParallelSize": 2}, "requestGPU": 1}, "1"),
        ({"vllmConfig": {"tensorParallelSize": 2}}, "none"),
        ({"vllmConfig": {"tensorParallelSize": 2, "pipelineParallelSize": 2}, "requestGPU": 2}, "2"),
        (
            {
                "vllmConfig": {"tensorParallelSize": 4},
                "resources": {"limits": {"nvidia.com/gpu": 2, "memory": "64Gi", "cpu": "8"}},
            },
            "2",
        ),
    ],
)
def test_more_parallel_workers_than_gpus_is_refused(tmp_path, model, gpus):
    err = _refused(tmp_path, _model(**model))
    assert "servingEngineSpec.modelSpec[0] (m): vllmConfig.tensorParallelSize" in err
    assert f"but it requests {gpus}" in err and "requestGPU" in err


@pytest.mark.parametrize(
    "model",
    [
        {"vllmConfig": {"tensorParallelSize": 2}, "requestGPU": 2},
        {"vllmConfig": {"tensorParallelSize": 1}},  # one worker on whatever the pod has (a CPU image too)
        {"vllmConfig": {"tensorParallelSize": 2}, "requestGPU": 2, "requestGPUType": "amd.com/gpu"},
        {
            "vllmConfig": {"tensorParallelSize": 2},
            "resources": {"limits": {"nvidia.com/gpu": 2, "memory": "64Gi", "cpu": "8"}},
        },
        {"vllmConfig": {"tensorParallelSize": 2}, "requestGPU": 1, "enabled": False},  # not deployed
    ],
)
def test_enough_gpus_or_a_disabled_model_render(tmp_path, model):
    objs = _renders(tmp_path, _model(**model))
    assert bool([o for o in objs if o["metadata"]["name"] == engine_name("m")]) == (
        model.get("enabled") is not False
    )


def test_production_stacks_default_file_with_its_disabled_tp2_model_renders():
    assert render([require(PS_VALUES / "helm__values.yaml")])


@pytest.mark.parametrize(
    "keda, replicas, words",
    [
        (
            {"minReplicaCount": 3, "maxReplicaCount": 2},
            None,
            "keda.minReplicaCount 3 is above keda.maxReplicaCount 2: KEDA",
        ),
        (
            {"minReplicaCount": 2},
            1,
            "keda.minReplicaCount 2 is above keda.maxReplicaCount 1 (its default: replicaCount, at least 1)",
        ),
    ],
)
def test_keda_min_above_max_is_refused(tmp_path, keda, replicas, words):
    model = {"keda": {"enabled": True, **keda}} | ({"replicaCount": replicas} if replicas is not None else {})
    err = _refused(tmp_path, _model(**model))
    assert words in err and "give a maxReplicaCount of at least" in err


def test_keda_min_up_to_max_renders(tmp_path):
    objs = _renders(tmp_path, _model(keda={"enabled": True, "minReplicaCount": 2, "maxReplicaCount": 2}))
    so = one(objs, "ScaledObject", engine_name("m", "ScaledObject"))["spec"]
    assert so["minReplicaCount"] == so["maxReplicaCount"] == 2
    # off: not checked (no ScaledObject)
    assert _renders(
        tmp_path, _model(keda={"enabled": False, "minReplicaCount": 3, "maxReplicaCount": 1}), "off.yaml"
    )


def test_a_node_port_on_a_cluster_ip_service_is_refused(tmp_path):
    err = _refused(tmp_path, {"routerSpec": {"nodePort": 30080}})
    assert "routerSpec.nodePort 30080 is set, but routerSpec.serviceType is ClusterIP" in err
    objs = _renders(tmp_path, {"routerSpec": {"nodePort": 30080, "serviceType": "NodePort"}})
    assert one(objs, "Service", router_name("Service"))["spec"]["ports"][0]["nodePort"] == 30080


def test_a_deployed_model_without_model_url_is_refused(tmp_path):
    err = _refused(tmp_path, {"servingEngineSpec": {"modelSpec": [{"name": "m"}]}})
    assert "servingEngineSpec.modelSpec[0] (m): modelURL is required" in err
    assert _renders(tmp_path, {"servingEngineSpec": {"modelSpec": [{"name": "m", "enabled": False}]}})


def test_a_valid_model_still_gets_its_gpus(tmp_path):
    objs = _renders(tmp_path, _model(vllmConfig={"tensorParallelSize": 2}, requestGPU=2))
    assert (
        container(one(objs, "Deployment", engine_name("m")))["resources"]["limits"]["nvidia.com/gpu"] == "2"
    )
