"""The LMCACHE_* environment the chart renders is read by LMCache 0.5.6's own configuration loader: every
variable names a real 0.5 key (none silently dropped) and lists, booleans and sizes parse to the values
meant. LMCache cannot be installed here (its CUDA extension needs a GPU and its package import pulls in
torch), so the test loads only its pure-Python configuration modules from the release wheel, which
`make install` downloads to .cache/wheels/ (`pip download lmcache==0.5.6 --no-deps`)."""

from __future__ import annotations

import importlib
import os
import sys
import types
import zipfile

import pytest
import yaml

from tests.helm.chart import EXAMPLES, RELEASE, ROOT, container, engine_name, one, render
from tests.shared_data import PS_VALUES, require

pytestmark = pytest.mark.helm

WHEELS = sorted((ROOT / ".cache" / "wheels").glob("lmcache-0.5.6-*.whl"))
POD_FIELDS = {"metadata.name": "engine-pod-0", "status.podIP": "10.0.0.7"}


@pytest.fixture(scope="module")
def lmcache_config(tmp_path_factory):
    if not WHEELS:
        pytest.fail("LMCache 0.5.6 wheel missing in .cache/wheels: run `make install` (downloads it there)")
    dest = tmp_path_factory.mktemp("lmcache")
    with zipfile.ZipFile(WHEELS[-1]) as wheel:
        for name in ("lmcache/logging.py", "lmcache/v1/config_base.py", "lmcache/v1/config.py"):
            wheel.extract(name, dest)
    saved = {k: v for k, v in sys.modules.items() if k == "lmcache" or k.startswith("lmcache.")}
    sys.path.insert(0, str(dest))
    # config_base imports requests for a remote-config feature the chart does not use.
    stub = "requests" not in sys.modules and importlib.util.find_spec("requests") is None
    if stub:
        sys.modules["requests"] = types.ModuleType("requests")
    try:
        yield importlib.import_module("lmcache.v1.config").LMCacheEngineConfig
    finally:
        sys.path.remove(str(dest))
        for k in [k for k in sys.modules if k == "lmcache" or k.startswith("lmcache.")]:
            del sys.modules[k]
        sys.modules.update(saved)
        if stub:
            del sys.modules["requests"]


def load(config_cls, values, model, monkeypatch):
    c = container(one(render([values]), "Deployment", engine_name(model, "Deployment")))
    env = {}
    for e in c["env"]:
        if e["name"].startswith("LMCACHE_"):
            env[e["name"]] = (
                e["value"] if "value" in e else POD_FIELDS[e["valueFrom"]["fieldRef"]["fieldPath"]]
            )
    for k in [k for k in os.environ if k.startswith("LMCACHE_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = config_cls.from_env()
    # Read by LMCache outside the config object (usage telemetry, logging).
    keys = {k.removeprefix("LMCACHE_").lower() for k in env} - {"track_usage", "log_level"}
    unknown = keys - set(vars(cfg))
    assert not unknown, f"not LMCache 0.5 keys (silently ignored): {unknown}"
    return cfg


def test_offload_and_cache_server(lmcache_config, monkeypatch):
    cfg = load(lmcache_config, EXAMPLES / "cache-server.yaml", "mistral", monkeypatch)
    assert (cfg.local_cpu, cfg.max_local_cpu_size, cfg.chunk_size) == (True, 20.0, 256)
    assert (cfg.local_disk, cfg.max_local_disk_size) == ("/lmcache/disk/", 100.0)
    assert (cfg.remote_url, cfg.remote_serde) == (f"lm://{RELEASE}-cache-server-service:81", "naive")


def test_pd_controller_and_p2p(lmcache_config, monkeypatch):
    pre = load(lmcache_config, EXAMPLES / "pd-roles.yaml", "prefill", monkeypatch)
    assert (pre.enable_pd, pre.pd_role, pre.transfer_channel, pre.nixl_backends) == (
        True,
        "sender",
        "nixl",
        ["UCX"],
    )
    assert (pre.pd_proxy_host, pre.pd_proxy_port, pre.local_cpu) == ("vllm-stack-router-service", 7500, False)
    dec = load(lmcache_config, EXAMPLES / "pd-roles.yaml", "decode", monkeypatch)
    assert (dec.pd_role, dec.pd_buffer_size, dec.pd_buffer_device) == ("receiver", 2147483648, "cuda")
    assert (list(dec.pd_peer_init_port), list(dec.pd_peer_alloc_port)) == ([7300], [7400])
    assert (dec.enable_p2p, dec.p2p_host, dec.p2p_init_ports, dec.p2p_lookup_ports) == (
        True,
        "10.0.0.7",
        [8200],
        [8201],
    )
    assert (dec.enable_controller, dec.lmcache_instance_id) == (True, "engine-pod-0")
    assert (dec.controller_pull_url, dec.lmcache_worker_ports) == ("tcp://lmcache-controller:8300", [8500])


def test_production_stacks_pre_05_pd_keys_reach_lmcache_05(lmcache_config, monkeypatch):
    """tutorials__values-16-disagg-prefill.yaml's nixl* keys, translated by the chart (vllm-stack.model.pd)."""
    path = require(PS_VALUES / "tutorials__values-16-disagg-prefill.yaml")
    pre = load(lmcache_config, path, "llama-prefill", monkeypatch)
    assert (pre.enable_pd, pre.pd_role, pre.pd_buffer_size, pre.pd_buffer_device) == (
        True,
        "sender",
        1073741824,
        "cuda",
    )
    assert (pre.pd_proxy_host, pre.pd_proxy_port) == (
        f"{RELEASE}-router-service",
        7500,
    )  # the router is the proxy
    dec = load(lmcache_config, path, "llama-decode", monkeypatch)
    assert (dec.enable_pd, dec.pd_role, dec.pd_peer_host) == (True, "receiver", "0.0.0.0")
    assert (list(dec.pd_peer_init_port), list(dec.pd_peer_alloc_port)) == ([55555], [7400])


def test_seed_file(lmcache_config, monkeypatch):
    cfg = load(lmcache_config, EXAMPLES / "seed-mistral.yaml", "mistral", monkeypatch)
    assert (cfg.local_cpu, cfg.max_local_cpu_size) == (True, 30.0)


def test_kvaware_engines_report_to_the_charts_controller(lmcache_config, monkeypatch):
    """tests__values-09-kvaware-routing.yaml: the controller settings pass LMCache 0.5.6's own checks
    (enable_controller needs an instance id, both URLs and worker ports)."""
    path = require(PS_VALUES / "tests__values-09-kvaware-routing.yaml")
    cfg = load(lmcache_config, path, "opt125m", monkeypatch)
    cfg.validate()
    assert (cfg.enable_controller, cfg.lmcache_instance_id) == (True, "engine-pod-0")
    assert (cfg.controller_pull_url, cfg.controller_reply_url) == (
        f"{RELEASE}-lmcache-controller:9000",
        f"{RELEASE}-lmcache-controller:9001",
    )
    assert (cfg.lmcache_worker_ports, cfg.lmcache_worker_heartbeat_time, cfg.chunk_size) == ([8001], 30, 256)


def _create_serde(config):
    """LMCache 0.5.6's own CreateSerde (lmcache/v1/storage_backend/naive_serde/__init__.py, from the wheel),
    which its RemoteBackend calls with config.remote_serde at construction. The serializer classes it picks
    from import torch, so they are stand-ins here: what is checked is the type the config hands it."""
    with zipfile.ZipFile(WHEELS[-1]) as wheel:
        backend = wheel.read("lmcache/v1/storage_backend/remote_backend.py").decode()
        source = wheel.read("lmcache/v1/storage_backend/naive_serde/__init__.py").decode()
    assert "CreateSerde(\n            config.remote_serde, metadata, config\n        )" in backend
    names = {
        "lmcache.v1.metadata": ["LMCacheMetadata"],
        "lmcache.v1.storage_backend.naive_serde.cachegen_decoder": ["CacheGenDeserializer"],
        "lmcache.v1.storage_backend.naive_serde.cachegen_encoder": ["CacheGenSerializer"],
        "lmcache.v1.storage_backend.naive_serde.kivi_serde": ["KIVIDeserializer", "KIVISerializer"],
        "lmcache.v1.storage_backend.naive_serde.naive_serde": ["NaiveDeserializer", "NaiveSerializer"],
        "lmcache.v1.storage_backend.naive_serde.serde": ["Deserializer", "Serializer"],
    }
    stubs = {}
    for module, classes in names.items():
        stubs[module] = types.ModuleType(module)
        for cls in classes:
            setattr(stubs[module], cls, type(cls, (), {"__init__": lambda self, *a: None}))
    saved = {k: sys.modules.get(k) for k in stubs}
    sys.modules.update(stubs)
    try:
        namespace: dict = {"__name__": "lmcache.v1.storage_backend.naive_serde"}
        exec(compile(source, "naive_serde/__init__.py", "exec"), namespace)
        assert config.remote_serde is not None  # RemoteBackend's own assertion
        return namespace["CreateSerde"](config.remote_serde, None, config)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def test_an_empty_serde_is_lmcaches_default(lmcache_config, monkeypatch, tmp_path):
    """production-stack's default cacheserverSpec.serde is "": its chart then renders no LMCACHE_REMOTE_SERDE.
    Rendered as "", LMCache 0.5.6 keeps it and its remote backend raises ValueError("Invalid type: ") at start."""
    values = {
        "servingEngineSpec": {
            "modelSpec": [
                {
                    "name": "m",
                    "modelURL": "facebook/opt-125m",
                    "requestGPU": 1,
                    "lmcacheConfig": {"enabled": True},
                }
            ]
        },
        "cacheserverSpec": {"enabled": True, "serde": ""},
    }
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    cfg = load(lmcache_config, path, "m", monkeypatch)
    serializer, _ = _create_serde(cfg)  # the old render: ValueError("Invalid type: ")
    assert (cfg.remote_url, cfg.remote_serde) == (f"lm://{RELEASE}-cache-server-service:80", "naive")
    assert type(serializer).__name__ == "NaiveSerializer"
    # an explicit serde still reaches LMCache
    values["cacheserverSpec"]["serde"] = "cachegen"
    path = tmp_path / "cachegen.yaml"  # render() caches by file name
    path.write_text(yaml.safe_dump(values))
    assert load(lmcache_config, path, "m", monkeypatch).remote_serde == "cachegen"
