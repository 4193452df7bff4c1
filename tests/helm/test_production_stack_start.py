"""What production-stack's values files do once their engines start (issue 46): the render was valid, the Pod
was not. Each test here failed on the chart before: memory vLLM's own flags pin, a `keda` block without
`enabled`, tutorial 13's chat template on production-stack's claim, the disaggregated-prefill files' GPU
pinning and their image's older LMCache, V0's prefix caching, `pvcStorage` beside `pvcExistingClaimName`, and
production-stack's `ExternalName` Service type. The empty `serde` is in tests/helm/test_lmcache_env.py (LMCache's
own loader)."""

from __future__ import annotations

import pytest

from tests.helm.chart import container, engine_name, env_of, find, one
from tests.helm.test_production_stack_files import (
    compat_lines,
    dry_run,
    engines,
    load,
    manifest_and_notes,
    rendered,
)

pytestmark = pytest.mark.helm


def _model(**kw) -> dict:
    return {"servingEngineSpec": {"modelSpec": [{"name": "m", "modelURL": "org/m", **kw}]}}


def _engine(values: dict) -> tuple[dict, dict[tuple[str, ...], str]]:
    objs, notes = manifest_and_notes(values)
    return one(objs, "Deployment", engine_name("m", "Deployment")), compat_lines(notes)


# --- memory vLLM's own flags pin ---------------------------------------------------------------------------


def test_cpu_offload_gb_is_counted_per_gpu_worker():
    """The issue's example: 40 GiB of weights offloaded per GPU x 2 workers; the old render limited it to 24Gi
    and NOTES said "raised to 24Gi"."""
    d, lines = _engine(
        _model(
            requestMemory="16Gi",
            requestGPU=2,
            vllmConfig={"tensorParallelSize": 2, "extraArgs": ["--cpu-offload-gb", "40"]},
        )
    )
    res = container(d)["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"] == "104Gi"  # 80 + 20 shm + 4
    line = lines[("servingEngineSpec.modelSpec[0].requestMemory",)]
    assert "80Gi vLLM CPU weight offload (--cpu-offload-gb 40 per GPU worker x 2 workers)" in line
    # the = spelling and vLLM's underscore spelling are the same flag
    d, _ = _engine(_model(requestMemory="16Gi", vllmConfig={"extraArgs": ["--cpu_offload_gb=20"]}))
    assert container(d)["resources"]["limits"]["memory"] == "26Gi"


def test_v0_swap_space_is_counted_and_v1_allocates_none():
    v0 = {"vllmVersion": "0.8.5", "vllmConfig": {"v0": "1", "tensorParallelSize": 2}, "requestGPU": 2}
    d, lines = _engine(_model(requestMemory="16Gi", **v0))
    # vLLM's default 4 GiB per GPU worker x 2 + 20Gi /dev/shm + 4Gi
    assert container(d)["resources"]["limits"]["memory"] == "32Gi"
    assert (
        "8Gi vLLM V0 swap space (--swap-space 4, vLLM's default per GPU worker x 2 workers)"
        in (lines[("servingEngineSpec.modelSpec[0].requestMemory",)])
    )
    v0["vllmConfig"]["extraArgs"] = ["--swap-space", "16"]
    d, _ = _engine(_model(requestMemory="16Gi", **v0))
    assert container(d)["resources"]["limits"]["memory"] == "56Gi"
    d, _ = _engine(_model(requestMemory="16Gi", vllmConfig={"extraArgs": ["--swap-space", "16"]}))
    assert container(d)["resources"]["limits"]["memory"] == "16Gi"  # V1: no swap space


def test_kv_offloading_is_counted_or_left_unlimited_where_the_chart_cannot_know():
    d, _ = _engine(_model(requestMemory="16Gi", vllmConfig={"extraArgs": ["--kv-offloading-size", "64"]}))
    assert container(d)["resources"]["limits"]["memory"] == "70Gi"  # 64 + 2 shm + 4
    connector = '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"num_cpu_blocks":100000}}'
    d, lines = _engine(
        _model(requestMemory="16Gi", vllmConfig={"extraArgs": ["--kv-transfer-config", connector]})
    )
    res = container(d)["resources"]
    assert res["requests"]["memory"] == "16Gi" and "memory" not in res["limits"]
    line = lines[("servingEngineSpec.modelSpec[0].limitMemory",)]
    assert line.startswith("no memory limit rendered (request 16Gi)") and "OffloadingConnector" in line
    # a limit given is kept, and still checked against what is known
    rc, _, err = dry_run(_model(limitMemory="20Gi", vllmConfig={"extraArgs": ["--cpu-offload-gb", "40"]}))
    assert rc != 0 and "limitMemory 20Gi is below what the engine holds: 40Gi vLLM CPU weight offload" in err


# --- keda without enabled ----------------------------------------------------------------------------------


def test_a_keda_block_without_enabled_is_off_as_in_production_stack():
    values = _model(replicaCount=3, keda={"minReplicaCount": 1, "maxReplicaCount": 4})
    objs, notes = manifest_and_notes(values)
    assert not find(objs, "ScaledObject")
    assert one(objs, "Deployment", engine_name("m", "Deployment"))["spec"]["replicas"] == 3
    line = compat_lines(notes)[("servingEngineSpec.modelSpec[0].keda",)]
    assert "no ScaledObject is rendered and replicaCount stays, as in production-stack" in line
    assert "KEDA owns" not in "\n".join(notes)
    values["servingEngineSpec"]["modelSpec"][0]["keda"]["enabled"] = True
    objs, notes = manifest_and_notes(values)
    assert one(objs, "ScaledObject", engine_name("m", "ScaledObject"))
    assert ("servingEngineSpec.modelSpec[0].keda",) not in compat_lines(notes)


# --- tutorial 13's chat template ----------------------------------------------------------------------------


def test_tutorial_13_reads_its_chat_template_from_production_stacks_claim():
    """production-stack mounts the claim vllm-templates-pvc at /templates; without it vLLM exits at start
    (--chat-template names a file that is not there). The engine start itself is not checked here."""
    objs, lines = rendered("tutorials__values-13-tool-enabled.yaml")
    (d,) = engines(objs)
    c = container(d)
    assert (
        c["args"][c["args"].index("--chat-template") + 1]
        == "/templates/tool_chat_template_llama3.1_json.jinja"
    )
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/templates"]
    (volume,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    assert volume["persistentVolumeClaim"]["claimName"] == "vllm-templates-pvc"
    assert not any(
        p[0].endswith(".chatTemplate") for p in lines
    )  # production-stack's behaviour: no deviation
    # a bare file name is production-stack's /templates/<name> on that claim (it was refused)
    d, _ = _engine(_model(chatTemplate="chat.jinja"))
    c = container(d)
    assert c["args"][c["args"].index("--chat-template") + 1] == "/templates/chat.jinja"
    assert any(m["mountPath"] == "/templates" for m in c["volumeMounts"])
    # a path elsewhere is the image's (said); a /templates mount of the user's own wins
    d, lines = _engine(_model(chatTemplate="/opt/t.jinja"))
    assert not any(m["mountPath"] == "/templates" for m in container(d)["volumeMounts"])
    assert ("servingEngineSpec.modelSpec[0].chatTemplate",) in lines
    own = {"extraVolumes": [{"name": "t", "configMap": {"name": "t"}}]}
    own["extraVolumeMounts"] = [{"name": "t", "mountPath": "/templates"}]
    d, _ = _engine(_model(chatTemplate="chat.jinja", **own))
    assert [m["name"] for m in container(d)["volumeMounts"] if m["mountPath"] == "/templates"] == ["t"]


# --- the disaggregated-prefill files --------------------------------------------------------------------------

DISAGG = ["tutorials__values-16-disagg-prefill.yaml", "tests__values-10-disagg-prefill.yaml"]


@pytest.mark.parametrize("name", DISAGG)
def test_disagg_files_keep_their_gpu_pinning_where_the_models_request_no_gpu(name):
    """Their models request no GPU (requestGPU is commented out): the pods see the node's GPUs, and without
    production-stack's CUDA_VISIBLE_DEVICES both engines would take GPU 0."""
    objs, _ = rendered(name)
    pinned = {
        d["metadata"]["name"]: env_of(container(d))["CUDA_VISIBLE_DEVICES"]["value"] for d in engines(objs)
    }
    assert sorted(pinned.values()) == ["0", "1"], pinned
    # a model given GPUs by the device plugin sees only those: the node-wide index is not set (said)
    values = load(name)
    for m in values["servingEngineSpec"]["modelSpec"]:
        m["requestGPU"] = 1
    objs, notes = manifest_and_notes(values)
    assert all("CUDA_VISIBLE_DEVICES" not in env_of(container(d)) for d in engines(objs))
    assert ("servingEngineSpec.modelSpec[1].lmcacheConfig.cudaVisibleDevices",) in compat_lines(notes)


@pytest.mark.parametrize("name", DISAGG)
def test_disagg_files_say_their_image_predates_the_lmcache_settings_rendered(name):
    _, lines = rendered(name)
    for i in (0, 1):
        (line,) = [
            t for p, t in lines.items() if p == (f"servingEngineSpec.modelSpec[{i}].tag",) and "LMCache" in t
        ]
        assert (
            "lmcache/vllm-openai:2025-05-27-v1 runs an LMCache build of 2025-05-27, older than LMCache 0.5"
            in line
        )
        assert "ignores LMCACHE_ENABLE_PD, LMCACHE_PD_*" in line and "lmcache/vllm-openai:v0.5.6" in line
    # an LMCache 0.5 image is not said, an older release is
    for tag, said in [("v0.5.6", False), ("v0.3.9", True), ("2026-01-10", False)]:
        values = load(name)
        for m in values["servingEngineSpec"]["modelSpec"]:
            m["tag"] = tag
        said_now = any(
            "older than LMCache 0.5" in t for t in compat_lines(manifest_and_notes(values)[1]).values()
        )
        assert said_now == said, tag


# --- minors ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["tutorials__values-25-v100-single-gpu.yaml", "tutorials__values-25-v100-multi-gpu-tp2.yaml"]
)
def test_v0_engines_are_not_said_to_cache_prefixes_by_default(name):
    """vLLM 0.8.5 with VLLM_USE_V1=0: V0 leaves prefix caching off, as production-stack's flag does."""
    _, lines = rendered(name)
    assert not any(p[0].endswith("enablePrefixCaching") for p in lines), lines
    d, lines = _engine(_model(vllmVersion="0.7.3", vllmConfig={"maxModelLen": 2048}))
    assert ("servingEngineSpec.modelSpec[0].vllmConfig.enablePrefixCaching",) not in lines
    d, lines = _engine(_model(vllmConfig={"maxModelLen": 2048}))  # V1: on by default, said
    assert ("servingEngineSpec.modelSpec[0].vllmConfig.enablePrefixCaching",) in lines


def test_pvc_storage_beside_an_existing_claim_is_said_unused():
    d, lines = _engine(_model(pvcStorage="50Gi", pvcExistingClaimName="weights"))
    (volume,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "model-cache"]
    assert volume["persistentVolumeClaim"]["claimName"] == "weights"
    assert (
        "pvcExistingClaimName (weights) is the claim" in lines[("servingEngineSpec.modelSpec[0].pvcStorage",)]
    )


@pytest.mark.parametrize("key", ["routerSpec", "cacheserverSpec"])
def test_external_name_services_are_refused_with_a_reason(key):
    values = {key: {"serviceType": "ExternalName"}}
    if key == "cacheserverSpec":
        values[key]["enabled"] = True
    rc, _, err = dry_run(values)
    assert rc != 0 and "schema" not in err
    assert f"{key}.serviceType ExternalName: an ExternalName Service is a DNS alias" in err
