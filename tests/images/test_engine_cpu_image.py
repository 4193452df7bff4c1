"""The CPU engine image (`ghcr.io/vllm-stack/engine-cpu:v0.32.0`, engine-image/engine-cpu.Dockerfile) run as
the chart runs its engines and its cache server: `vllm serve` of the tiny model with the rendered engine
arguments, environment and mounts (as the image's user, which the chart's engine pods keep) answers a chat
completion; `lmcache_server` starts as the chart's cache-server user on a read-only root file system.

Only with `-m image_builds` (`make test-images`): the first run builds the image (minutes, ~7 GB) from the
engine environment's wheels. Adapted from the render, as `vllm-stack up` adapts it: the model (the tiny
Llama, mounted read-only, with `--load-format dummy`), loopback host and free ports (also the KV-event
ports), `--dtype float32` on CPUs with AMX, a 256 MiB KV cache.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import aiohttp
import pytest
import yaml
from vllm_stack_dev.images import build_engine_image, engine_cpu_reference
from vllm_stack_dev.testbed.engines import dtype_override, free_port

from tests.helm.chart import (
    EXAMPLES,
    cache_server_name,
    container,
    engine_name,
    find,
    one,
    render,
    values_file,
)
from tests.images.pod import is_running, require_podman, running, set_flag

pytestmark = [pytest.mark.image_builds, pytest.mark.helm]

IMAGE = engine_cpu_reference()
REPOSITORY, TAG = IMAGE.rsplit(":", 1)
ENGINE_READY_S = 300.0
MODEL_MOUNT = "/models/tiny"


@pytest.fixture(scope="module")
def engine_image() -> str:
    require_podman()
    print(build_engine_image())
    return IMAGE


async def test_vllm_serve_of_the_tiny_model_answers(engine_image, tiny_model_dir: Path, tmp_path: Path):
    values = yaml.safe_load((EXAMPLES / "local-default.yaml").read_text())
    for model in values["servingEngineSpec"]["modelSpec"]:
        model.update(repository=REPOSITORY, tag=TAG)
    objs = render([values_file(tmp_path, values)])
    deployment = find(objs, "Deployment", engine_name(values["servingEngineSpec"]["modelSpec"][0]["name"]))[0]
    pod = deployment["spec"]["template"]["spec"]
    spec = container(deployment)
    assert spec["image"] == IMAGE and spec["command"] == ["vllm", "serve"]
    port, events, replay = free_port(), free_port(), free_port()
    model, args = spec["args"][0], spec["args"][1:]
    served = args[args.index("--served-model-name") + 1]
    args = set_flag(set_flag(args, "--host", "127.0.0.1"), "--port", str(port))
    events_config = json.loads(args[args.index("--kv-events-config") + 1])
    events_config.update(endpoint=f"tcp://*:{events}", replay_endpoint=f"tcp://*:{replay}")
    args = set_flag(args, "--kv-events-config", json.dumps(events_config))
    args = [
        MODEL_MOUNT,
        *args,
        "--load-format",
        "dummy",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        *dtype_override(),
    ]
    assert model != MODEL_MOUNT  # the chart's model (a Hub name) is replaced by the local tiny Llama
    volume = ("--volume", f"{tiny_model_dir}:{MODEL_MOUNT}:ro")
    fields = {"status.podIP": "127.0.0.1"}
    async with (
        running(pod, spec, {}, tmp_path, args, command=spec["command"], extra=volume, fields=fields) as cid,
        aiohttp.ClientSession() as http,
    ):
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + ENGINE_READY_S
        while True:
            try:
                async with http.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=2)) as response:
                    if response.status == 200:
                        break
            except (aiohttp.ClientError, TimeoutError):
                pass
            if not await is_running(cid):
                pytest.fail(f"the engine container {cid[:12]} exited before answering /health")
            if time.monotonic() > deadline:
                pytest.fail(
                    f"the engine container {cid[:12]} did not answer /health within {ENGINE_READY_S:.0f} s"
                )
            await asyncio.sleep(1)
        body = {"model": served, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
        async with http.post(f"{base}/v1/chat/completions", json=body) as response:
            text = await response.text()
            assert response.status == 200, text
            assert json.loads(text)["usage"]["completion_tokens"] > 0


async def test_lmcache_server_starts(engine_image, tmp_path: Path):
    values = yaml.safe_load((EXAMPLES / "cache-server.yaml").read_text())
    values["cacheserverSpec"].update(repository=REPOSITORY, tag=TAG)
    objs = render([values_file(tmp_path, values)])
    deployment = one(objs, "Deployment", cache_server_name())
    pod = deployment["spec"]["template"]["spec"]
    spec = container(deployment)
    assert spec["image"] == IMAGE and spec["securityContext"]["readOnlyRootFilesystem"] is True
    program, host, _ = spec["command"]
    assert (program, host) == ("lmcache_server", "0.0.0.0")
    port = free_port()
    async with running(pod, spec, {}, tmp_path, [], command=[program, "127.0.0.1", str(port)]) as cid:
        deadline = time.monotonic() + 120
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2):
                    break  # what the kubelet's tcpSocket probe checks
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"lmcache_server in {cid[:12]} did not listen on {port} within 120 s")
                await asyncio.sleep(0.5)
