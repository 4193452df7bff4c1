"""The rendered commands are real: the engine container's arguments, rendered from the user's own
production-stack values file, start the real vLLM 0.32 (CPU build) and serve; the rendered router arguments
start the real router in front of it, and a chat completion goes through both.

What is changed from the rendered arguments, and why (everything else is passed exactly as rendered):
- engine: the model (first argument of `vllm serve MODEL`) becomes `--model <tiny model dir>` because no
  weights can be downloaded here; `--load-format dummy` is added for the same reason.
- engine: `--max-model-len 16384` becomes 2048: the tiny test model has 2048 positions (model-dependent,
  not GPU-dependent).
- engine: `--kv-transfer-config` (LMCacheConnectorV1) is dropped: LMCache's CUDA extension does not load
  without a GPU (GPU-only).
- engine: `--host 0.0.0.0 --port 8000` are dropped; the test bed appends loopback and a free port. The ZMQ
  KV-event endpoint's port 5557 (and its replay port 5558) become free ports, so that parallel test sessions
  do not collide.
- engine: `--gpu-memory-utilization` and `--dtype bfloat16` are kept: the CPU build accepts both (the KV
  cache size on CPU comes from `--kv-cache-memory-bytes`, appended by the test bed).
- engine env: the rendered plain values are kept (PYTHONHASHSEED) except HF_HOME (a pod path) and the
  LMCACHE_* variables (no connector, see above); VLLM_API_KEY, a secretKeyRef in the pod, gets the literal
  the values file stored in the chart's Secret.
- router: `--service-discovery k8s --k8s-namespace --k8s-label-selector --k8s-port` become
  `--service-discovery static --static-backends <engine url>` because no Kubernetes API server can run
  here (the label selector itself is checked in test_behaviour.py); `--host/--port` become loopback and a
  free port. The router runs as `vllm-stack router ARGS`, which is the image's entrypoint.
- router: `--config` names the pod's mount of the router's ConfigMap; it becomes a temporary file holding
  that ConfigMap's rendered `config.yaml`, unchanged.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from vllm_stack_dev.testbed.engines import (
    EngineGroup,
    EngineSpec,
    default_cpus,
    free_port,
    launch,
    stop_process,
)

from tests.helm.chart import (
    EXAMPLES,
    RELEASE,
    container,
    engine_name,
    env_of,
    flag,
    one,
    render,
    router_name,
    values_file,
)

pytestmark = [pytest.mark.helm, pytest.mark.engine]

ROOT = Path(__file__).resolve().parents[2]
ROUTER = Path(sys.executable).parent / "vllm-stack"


def _drop(args: list[str], name: str, with_value: bool = True) -> list[str]:
    if name not in args:
        return args
    i = args.index(name)
    return args[:i] + args[i + 1 + int(with_value) :]


def _replace_value(args: list[str], name: str, value: str) -> list[str]:
    i = args.index(name)
    return [*args[: i + 1], value, *args[i + 2 :]]


def engine_args_for_cpu(rendered: list[str], model_dir: Path, kv_port: int) -> list[str]:
    args = ["--model", str(model_dir), *rendered[1:], "--load-format", "dummy"]
    args = _drop(_drop(args, "--host"), "--port")
    args = _replace_value(args, "--max-model-len", "2048")
    args = _drop(args, "--kv-transfer-config")
    events = json.loads(flag(args, "--kv-events-config"))
    events["endpoint"] = events["endpoint"].replace(":5557", f":{kv_port}")
    if "replay_endpoint" in events:
        events["replay_endpoint"] = events["replay_endpoint"].replace(":5558", f":{free_port()}")
    return _replace_value(args, "--kv-events-config", json.dumps(events))


def router_config_file(objs: list[dict], tmp_path: Path) -> Path | None:
    """The router's rendered ConfigMap content (its `config.yaml`), written where a local router reads it."""
    found = [
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == router_name("ConfigMap")
    ]
    if not found:
        return None
    path = tmp_path / "router-config.yaml"
    path.write_text(found[0]["data"]["config.yaml"])
    return path


def router_args_for_static(
    rendered: list[str], engine_url: str, port: int, config: Path | None = None
) -> list[str]:
    args = list(rendered)
    if "--config" in args:
        assert config is not None, "the rendered router arguments name a config file: pass its content"
        args = _replace_value(args, "--config", str(config))
    for name in ("--k8s-namespace", "--k8s-label-selector", "--k8s-port"):
        args = _drop(args, name)
    args = _replace_value(args, "--service-discovery", "static")
    args = _replace_value(args, "--host", "127.0.0.1")
    args = _replace_value(args, "--port", str(port))
    return [*args, "--static-backends", engine_url]


def _request(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 60):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (urllib.error.URLError, OSError):
        return 0, None


def test_rendered_engine_and_router_commands_serve(tiny_model_dir, tmp_path):
    overlay = values_file(
        tmp_path,
        {"servingEngineSpec": {"vllmApiKey": "rendered-test-key", "kvEvents": {"enabled": True}}},
        "overlay.yaml",
    )
    objs = render([EXAMPLES / "seed-mistral.yaml", overlay])
    engine_c = container(one(objs, "Deployment", engine_name("mistral", "Deployment")))
    router_c = container(one(objs, "Deployment", router_name("Deployment")))
    secret = one(objs, "Secret", f"{RELEASE}-secrets")
    api_key = base64.b64decode(secret["data"]["vllmApiKey"]).decode()
    served = flag(engine_c["args"], "--served-model-name")

    env = {
        name: e["value"]
        for name, e in env_of(engine_c).items()
        if "value" in e and name != "HF_HOME" and not name.startswith("LMCACHE_")
    }
    env["VLLM_API_KEY"] = api_key
    args = engine_args_for_cpu(engine_c["args"], tiny_model_dir, free_port())
    spec = EngineSpec(model_dir=tiny_model_dir, served_model_name=served, args=args, env=env)
    # start_engines() waits on /v1/models, which answers 401 without the key; wait on /health instead.
    group = EngineGroup(
        [launch(spec, name="rendered", cpu=default_cpus(1)[0], log_dir=tmp_path / "engine-logs")]
    )
    router = None
    try:
        engine = group[0]
        deadline = time.monotonic() + 420
        while _request(f"{engine.url}/health", timeout=2)[0] != 200:
            assert engine.is_running(), engine.log_tail()
            assert time.monotonic() < deadline, engine.log_tail()
            time.sleep(1)
        # The engine enforces the key: the router must be sending it.
        assert _request(f"{engine.url}/v1/models")[0] == 401

        port = free_port()
        router_env = {**os.environ, "VLLM_API_KEY": api_key}
        log = (tmp_path / "router.log").open("wb")
        router = subprocess.Popen(
            [
                str(ROUTER),
                "router",
                *router_args_for_static(
                    router_c["args"], engine.url, port, router_config_file(objs, tmp_path)
                ),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=router_env,
            cwd=ROOT,
        )
        deadline = time.monotonic() + 60
        while _request(f"http://127.0.0.1:{port}/ready", timeout=2)[0] != 200:
            assert router.poll() is None, (tmp_path / "router.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()
            time.sleep(0.5)

        status, models = _request(f"http://127.0.0.1:{port}/v1/models")
        assert status == 200 and served in [m["id"] for m in models["data"]]
        status, body = _request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            {"model": served, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
            timeout=120,
        )
        assert status == 200, (tmp_path / "router.log").read_text()
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
        assert body["usage"]["completion_tokens"] >= 1
    finally:
        if router is not None:
            stop_process(router, timeout=15)
        group.stop()
