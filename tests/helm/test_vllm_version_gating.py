"""The chart renders only engine flags the vLLM of the model's image parses (helm/files/vllm-flags.yaml): the
release comes from the model's vllmVersion, servingEngineSpec.vllmVersion, or a vllm/vllm-openai:vX.Y.Z tag;
any other image counts as the newest release the table knows, and NOTES says so. What is left out is said,
with what then happens (prefixaware routing without KV events); V0 is asked for only where it exists."""

from __future__ import annotations

import json

import pytest

from tests.helm.chart import container, engine_name, env_of, flag, one, render, render_error, values_file
from tests.helm.test_production_stack_files import compat_lines, manifest_and_notes
from tests.helm.test_vllm_flags import TABLE
from tests.shared_data import PS_VALUES, require

pytestmark = pytest.mark.helm

NEWEST = TABLE["releases"]["newest"]


def _engine(objs, model="m"):
    return one(objs, "Deployment", engine_name(model))


def _model(**kw) -> dict:
    return {"servingEngineSpec": {"modelSpec": [{"name": "m", "modelURL": "org/m", **kw}]}}


def _ps(name):
    return require(PS_VALUES / name)


@pytest.mark.parametrize(
    "name",
    [
        "tutorials__values-25-v100-single-gpu.yaml",
        "tutorials__values-25-v100-multi-gpu-tp2.yaml",
        "tutorials__values-25-v100-multi-gpu-tp4.yaml",
    ],
)
def test_v0_8_5_gets_no_kv_events_but_its_v0_engine(name):
    """production-stack's V100 files: vllm/vllm-openai:v0.8.5, the default prefixaware routing, vllmConfig.v0."""
    objs, notes = manifest_and_notes(__import__("yaml").safe_load(_ps(name).read_text()))
    (d,) = [
        o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-deployment-vllm")
    ]
    c = container(d)
    assert "--kv-events-config" not in c["args"] and "kv-events" not in [p["name"] for p in c["ports"]]
    assert env_of(c)["VLLM_USE_V1"]["value"] == "0"  # production-stack's v0: "1", which vLLM 0.8.5 has
    lines = compat_lines(notes)
    line = lines[("servingEngineSpec.modelSpec[0].tag",)]
    assert "--kv-events-config not rendered: vLLM 0.8.5 does not parse it (it came with vLLM 0.9.0)" in line
    assert "the router's own record of the prompts it sent where" in line
    assert not [p for p in lines if "vllmConfig.v0" in p[0]]  # honoured, not a deviation
    # the router still routes by prefix: its own index of what it sent (no engine publishes events)
    router = container(one(objs, "Deployment", "vllm-stack-deployment-router"))
    assert flag(router["args"], "--routing-logic") == "prefixaware"


def test_the_same_model_on_a_current_vllm_gets_kv_events():
    objs = render(sets=['json:servingEngineSpec.modelSpec=[{"name":"m","modelURL":"org/m"}]'])
    c = container(_engine(objs))
    kv = json.loads(flag(c["args"], "--kv-events-config"))
    assert kv["enable_kv_cache_events"] is True and "kv-events" in [p["name"] for p in c["ports"]]


@pytest.mark.parametrize(
    "model, version",
    [
        ({"repository": "vllm/vllm-openai", "tag": "v0.8.5"}, "0.8.5"),
        ({"repository": "registry.example/vllm/vllm-openai", "tag": "v0.9.2"}, "0.9.2"),
        ({"repository": "lmcache/vllm-openai", "tag": "latest", "vllmVersion": "0.8.5"}, "0.8.5"),
        ({"repository": "my/own", "tag": "x", "vllmVersion": "v0.8.5"}, "0.8.5"),
    ],
)
def test_the_release_comes_from_vllm_version_or_a_vllm_tag(tmp_path, model, version):
    objs, notes = manifest_and_notes(_model(**model))
    has_events = "--kv-events-config" in container(_engine(objs))["args"]
    assert has_events == (version != "0.8.5")
    assert not [p for p in compat_lines(notes) if "the vLLM release of" in compat_lines(notes)[p]]


def test_servingEngineSpec_vllmVersion_applies_to_every_model_and_a_models_own_wins():
    values = _model(repository="lmcache/vllm-openai", tag="latest")
    values["servingEngineSpec"]["vllmVersion"] = "0.8.5"
    values["servingEngineSpec"]["modelSpec"].append(
        {
            "name": "n",
            "modelURL": "org/n",
            "repository": "lmcache/vllm-openai",
            "tag": "latest",
            "vllmVersion": "0.9.0",
        }
    )
    objs, _ = manifest_and_notes(values)
    assert "--kv-events-config" not in container(_engine(objs, "m"))["args"]
    assert "--kv-events-config" in container(_engine(objs, "n"))["args"]


@pytest.mark.parametrize(
    "image",
    [("vllm/vllm-openai", "latest"), ("lmcache/vllm-openai", "v0.3.9post2"), ("rocm/vllm", "instinct_main")],
)
def test_an_unknown_release_counts_as_the_newest_and_notes_say_so(image):
    objs, notes = manifest_and_notes(_model(repository=image[0], tag=image[1]))
    line = compat_lines(notes)[("servingEngineSpec.modelSpec[0].tag",)]
    assert f"the vLLM release of {image[0]}:{image[1]} is unknown" in line and f", {NEWEST}:" in line
    assert "vllmVersion" in line
    assert "--kv-events-config" in container(_engine(objs))["args"]


def test_the_charts_own_images_are_its_pins_without_a_word():
    for model in ({}, {"lmcacheConfig": {"enabled": True}}):
        _, notes = manifest_and_notes(_model(**model))
        assert not [p for p in compat_lines(notes) if p[0].endswith(".tag")], model


@pytest.mark.parametrize(
    "version, vllm_config, present, absent",
    [
        (
            "0.8.4",
            {"enableChunkedPrefill": False},
            ["--enable-chunked-prefill", "false"],
            ["--no-enable-chunked-prefill"],
        ),
        ("0.8.5", {"enableChunkedPrefill": False}, ["--no-enable-chunked-prefill"], []),
        (
            "0.6.4",
            {"enablePrefixCaching": False},
            [],
            ["--no-enable-prefix-caching", "--enable-prefix-caching"],
        ),
        (
            "0.8.5",
            {"enforceEager": False, "trustRemoteCode": False},
            [],
            ["--no-enforce-eager", "--no-trust-remote-code"],
        ),
        ("0.9.0", {"enforceEager": False}, ["--no-enforce-eager"], []),
    ],
)
def test_switches_are_spelt_as_the_release_parses_them(version, vllm_config, present, absent):
    objs, _ = manifest_and_notes(_model(vllmVersion=version, vllmConfig=vllm_config))
    args = container(_engine(objs))["args"]
    for word in present:
        assert word in args, args
    for word in absent:
        assert word not in args, args


def test_a_flag_the_release_lacks_is_left_out_and_said():
    objs, notes = manifest_and_notes(
        _model(vllmVersion="0.9.0", vllmConfig={"runner": "pooling", "convert": "embed"})
    )
    args = container(_engine(objs))["args"]
    assert "--runner" not in args and "--convert" not in args
    line = compat_lines(notes)[("servingEngineSpec.modelSpec[0].vllmVersion",)]
    assert "--runner pooling not rendered: vLLM 0.9.0 does not parse it (it came with vLLM 0.10.1" in line


def test_a_release_older_than_the_table_keeps_the_flags_its_oldest_release_parses():
    """The table reads releases from its oldest on; a flag that release has may be older still, so a
    vLLM before it keeps it: a 0.5.5 image with two GPUs still gets --tensor-parallel-size 2 (and
    --host, --port, --max-model-len), and only later flags are left out, with NOTES saying both."""
    oldest = TABLE["releases"]["oldest"]
    model = _model(
        repository="vllm/vllm-openai", tag="v0.5.5", requestGPU=2,
        vllmConfig={"tensorParallelSize": 2, "maxModelLen": 1024},
    )  # fmt: skip
    objs, notes = manifest_and_notes(model)
    args = container(_engine(objs))["args"]
    assert flag(args, "--tensor-parallel-size") == "2" and flag(args, "--max-model-len") == "1024"
    assert "--host" in args and "--port" in args
    assert "--kv-events-config" not in args  # came with 0.9.0
    said = [line for line in notes if line.startswith("  servingEngineSpec.modelSpec[0].tag: ")]
    assert [
        line
        for line in said
        if f"vLLM 0.5.5 is older than the oldest release the chart's flag table reads ({oldest}" in line
    ]
    assert [
        line
        for line in said
        if "--kv-events-config not rendered: vLLM 0.5.5 does not parse it (it came with vLLM 0.9.0)" in line
    ]
    assert not [line for line in said if "--tensor-parallel-size" in line or "--host" in line]


def test_extra_args_the_release_cannot_parse_are_refused(tmp_path):
    err = render_error(
        [
            values_file(
                tmp_path, _model(vllmVersion="0.8.5", vllmConfig={"extraArgs": ["--kv-events-config", "{}"]})
            )
        ]
    )
    assert "vllmConfig.extraArgs --kv-events-config: vLLM 0.8.5" in err and "it came with vLLM 0.9.0" in err
    assert "vllmVersion" in err
    # flags the table does not know pass as given (the table lists the flags the chart and the files use)
    objs = render(
        [
            values_file(
                tmp_path, _model(vllmVersion="0.8.5", vllmConfig={"extraArgs": ["--some-new-flag"]}), "b.yaml"
            )
        ]
    )
    assert "--some-new-flag" in container(_engine(objs))["args"]


def test_v0_is_asked_for_only_where_the_release_has_it():
    objs, notes = manifest_and_notes(
        _model(vllmVersion="0.10.2", vllmConfig={"v0": "1"}, lmcacheConfig={"enabled": True})
    )
    c = container(_engine(objs))
    assert env_of(c)["VLLM_USE_V1"]["value"] == "0"
    assert (
        json.loads(flag(c["args"], "--kv-transfer-config"))["kv_connector"] == "LMCacheConnector"
    )  # LMCache's V0 one
    objs, notes = manifest_and_notes(_model(vllmConfig={"v0": "1"}, lmcacheConfig={"enabled": True}))
    c = container(_engine(objs))
    assert "VLLM_USE_V1" not in env_of(c)
    assert json.loads(flag(c["args"], "--kv-transfer-config"))["kv_connector"] == "LMCacheConnectorV1"
    line = compat_lines(notes)[("servingEngineSpec.modelSpec[0].vllmConfig.v0",)]
    assert "vLLM 0.32.0 has only the V1 engine (V0 was removed in 0.11.0)" in line
    # v1: 0 asks for V0 too: where the release has it, it gets it; elsewhere it is said, never refused
    objs, _ = manifest_and_notes(_model(vllmVersion="0.9.0", vllmConfig={"v1": 0}))
    assert env_of(container(_engine(objs)))["VLLM_USE_V1"]["value"] == "0"
    _, notes = manifest_and_notes(_model(vllmConfig={"v1": 0}))
    assert "has only the V1 engine" in compat_lines(notes)[("servingEngineSpec.modelSpec[0].vllmConfig.v1",)]
    # v1 on a release that runs V0 by default (before 0.8.0) selects V1
    objs, _ = manifest_and_notes(_model(vllmVersion="0.7.3", vllmConfig={"v1": 1}))
    assert env_of(container(_engine(objs)))["VLLM_USE_V1"]["value"] == "1"
