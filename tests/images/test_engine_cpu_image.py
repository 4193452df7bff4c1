"""The CPU engine image (`ghcr.io/vllm-stack/engine-cpu:v0.32.0`, engine-image/engine-cpu.Dockerfile) run as
the chart runs its engines and its cache server: `vllm serve` of the tiny model with the rendered engine
arguments, environment and mounts (as the image's user, which the chart's engine pods keep) answers a chat
completion; production-stack's tutorial 13 (its `--chat-template` on the claim `vllm-templates-pvc`, mounted
at /templates) starts and its template shapes the prompt, while the old chart's render (no mount) exits at
start; `lmcache_server` starts as the chart's cache-server user on a read-only root file system.

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
from tests.images.pod import exit_code, is_running, log_of, require_podman, running, set_flag
from tests.shared_data import PS_VALUES, require

pytestmark = [pytest.mark.image_builds, pytest.mark.helm]

IMAGE = engine_cpu_reference()
REPOSITORY, TAG = IMAGE.rsplit(":", 1)
ENGINE_READY_S = 300.0
ENGINE_EXIT_S = 180.0
MODEL_MOUNT = "/models/tiny"
TEMPLATE_MARKER = "TEMPLATE-MARKER"


@pytest.fixture(scope="module")
def engine_image() -> str:
    require_podman()
    print(build_engine_image())
    return IMAGE


def _local_engine_args(spec: dict, port: int) -> list[str]:
    """The rendered engine args as this machine runs them: the tiny Llama (mounted read-only at MODEL_MOUNT,
    dummy weights) for the chart's model, loopback and free ports (also the KV-event ports), a 256 MiB KV
    cache, float32 on CPUs with AMX, and `--enforce-eager` where the render lacks it (as `vllm-stack up`
    adds it: the image has no C++ compiler for torch.compile's CPU kernels)."""
    events, replay = free_port(), free_port()
    model, args = spec["args"][0], spec["args"][1:]
    args = set_flag(set_flag(args, "--host", "127.0.0.1"), "--port", str(port))
    events_config = json.loads(args[args.index("--kv-events-config") + 1])
    events_config.update(endpoint=f"tcp://*:{events}", replay_endpoint=f"tcp://*:{replay}")
    args = set_flag(args, "--kv-events-config", json.dumps(events_config))
    assert model != MODEL_MOUNT  # the chart's model (a Hub name) is replaced by the local tiny Llama
    return [
        MODEL_MOUNT,
        *args,
        "--load-format",
        "dummy",
        "--kv-cache-memory-bytes",
        str(256 << 20),
        *dtype_override(),
        *([] if "--enforce-eager" in args else ["--enforce-eager"]),
    ]


async def _wait_healthy(http: aiohttp.ClientSession, base: str, cid: str) -> None:
    deadline = time.monotonic() + ENGINE_READY_S
    while True:
        try:
            async with http.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=2)) as response:
                if response.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):
            pass
        if not await is_running(cid):
            pytest.fail(f"the engine container {cid[:12]} exited before answering /health")
        if time.monotonic() > deadline:
            pytest.fail(
                f"the engine container {cid[:12]} did not answer /health within {ENGINE_READY_S:.0f} s"
            )
        await asyncio.sleep(1)


async def test_vllm_serve_of_the_tiny_model_answers(engine_image, tiny_model_dir: Path, tmp_path: Path):
    values = yaml.safe_load((EXAMPLES / "local-default.yaml").read_text())
    for model in values["servingEngineSpec"]["modelSpec"]:
        model.update(repository=REPOSITORY, tag=TAG)
    objs = render([values_file(tmp_path, values)])
    deployment = find(objs, "Deployment", engine_name(values["servingEngineSpec"]["modelSpec"][0]["name"]))[0]
    pod = deployment["spec"]["template"]["spec"]
    spec = container(deployment)
    assert spec["image"] == IMAGE and spec["command"] == ["vllm", "serve"]
    port = free_port()
    args = _local_engine_args(spec, port)
    served = args[args.index("--served-model-name") + 1]
    volume = ("--volume", f"{tiny_model_dir}:{MODEL_MOUNT}:ro")
    fields = {"status.podIP": "127.0.0.1"}
    async with (
        running(pod, spec, {}, tmp_path, args, command=spec["command"], extra=volume, fields=fields) as cid,
        aiohttp.ClientSession() as http,
    ):
        base = f"http://127.0.0.1:{port}"
        await _wait_healthy(http, base, cid)
        body = {"model": served, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
        async with http.post(f"{base}/v1/chat/completions", json=body) as response:
            text = await response.text()
            assert response.status == 200, text
            assert json.loads(text)["usage"]["completion_tokens"] > 0


async def _post(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with http.post(url, json=body) as response:
        text = await response.text()
        assert response.status == 200, f"{url}: {text}"
        return json.loads(text)


async def test_tutorial_13_reads_its_chat_template_from_the_claim(
    engine_image, tiny_model_dir: Path, tmp_path: Path
):
    """Issue 46: production-stack's tutorials/values-13-tool-enabled.yaml, its engine Pod run as the chart
    renders it, with a host folder for the claim vllm-templates-pvc holding the file `--chat-template`
    names: the engine starts, and /tokenize and a chat completion render the prompt with that file (its
    marker first; not the tiny model's own template). The same render without the /templates mount (what the
    chart rendered before) exits at start: vLLM refuses a path-like template that does not exist.

    Adapted as for local-default.yaml (see _local_engine_args), and: the CPU image; the model's tool parser,
    hermes for the tiny Llama (llama3_json needs Llama 3.1's <|python_tag|> token, which it lacks; every
    chat request builds the parser); a value for the file's Secret huggingface-credentials (the image runs
    with HF_HUB_OFFLINE=1). Resources are not applied (tests/images/pod.py)."""
    values = yaml.safe_load(require(PS_VALUES / "tutorials__values-13-tool-enabled.yaml").read_text())
    (model,) = values["servingEngineSpec"]["modelSpec"]
    assert model["toolCallParser"] == "llama3_json"
    model.update(repository=REPOSITORY, tag=TAG, toolCallParser="hermes")
    objs = render([values_file(tmp_path, values)])
    deployment = one(objs, "Deployment", engine_name(model["name"]))
    pod = deployment["spec"]["template"]["spec"]
    spec = container(deployment)
    assert spec["image"] == IMAGE and spec["command"] == ["vllm", "serve"]
    template = spec["args"][spec["args"].index("--chat-template") + 1]
    (mount,) = [m for m in spec["volumeMounts"] if m["mountPath"] == "/templates"]
    (claim,) = [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if v["name"] == mount["name"]]
    assert claim == "vllm-templates-pvc" and template.startswith("/templates/")
    folder = tmp_path / "claim-templates"
    folder.mkdir(mode=0o755)
    (folder / template.removeprefix("/templates/")).write_text(
        TEMPLATE_MARKER + "\n{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    (folder / template.removeprefix("/templates/")).chmod(0o644)
    port = free_port()
    args = _local_engine_args(spec, port)
    served = args[args.index("--served-model-name") + 1]
    run = {
        "command": spec["command"],
        "extra": ("--volume", f"{tiny_model_dir}:{MODEL_MOUNT}:ro"),
        "fields": {"status.podIP": "127.0.0.1"},
        "secrets": {"huggingface-credentials": {"HUGGING_FACE_HUB_TOKEN": "hf_unused"}},
    }

    # the chart before e4f6f63: the same args, no /templates mount
    old_pod = {**pod, "volumes": [v for v in pod["volumes"] if v["name"] != mount["name"]]}
    old_spec = {**spec, "volumeMounts": [m for m in spec["volumeMounts"] if m is not mount]}
    async with running(old_pod, old_spec, {}, tmp_path, args, **run) as cid:
        deadline = time.monotonic() + ENGINE_EXIT_S
        while await is_running(cid):
            if time.monotonic() > deadline:
                pytest.fail(
                    f"without /templates, the engine {cid[:12]} still ran after {ENGINE_EXIT_S:.0f} s"
                )
            await asyncio.sleep(1)
        assert await exit_code(cid) != 0
        assert f"The supplied chat template string ({template}) appears path-like, but doesn't exist" in (
            await log_of(cid)
        )

    messages = [{"role": "user", "content": "hello"}]
    async with (
        running(pod, spec, {}, tmp_path, args, claims={claim: folder}, **run) as cid,
        aiohttp.ClientSession() as http,
    ):
        base = f"http://127.0.0.1:{port}"
        await _wait_healthy(http, base, cid)
        tokens = await _post(http, f"{base}/tokenize", {"model": served, "messages": messages})
        prompt = await _post(http, f"{base}/detokenize", {"model": served, "tokens": tokens["tokens"]})
        assert (
            prompt["prompt"].removeprefix("<|begin_of_text|>")
            == f"{TEMPLATE_MARKER}\nuser: hello\nassistant:"
        )
        body = {"model": served, "messages": messages, "max_tokens": 4}
        completion = await _post(http, f"{base}/v1/chat/completions", body)
        assert completion["usage"]["prompt_tokens"] == tokens["count"]  # the same template, the same prompt
        assert completion["usage"]["completion_tokens"] > 0


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
