"""The `helm test` pod's command, run as rendered against the local router with real vLLM engines (CPU build):
it proves a chat completion for every chat model, a completion for a base model without a chat template
(facebook/opt-125m, in 15 of production-stack's files: a chat request would get 400 from its engine) and an
embedding for the embedding model, and fails when no engine is up. The success case needs the session's real engines (marker `engine`); the zero-engine case needs
only the router and runs with the chart tests.

What is changed from the rendered pod, and why: `ROUTER_URL` (a cluster DNS name) becomes the local router's
loopback address; the router runs from its rendered arguments with static discovery, as in
test_rendered_commands_run.py (no Kubernetes API server here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from vllm_stack_dev.testbed.engines import free_port, stop_process

from tests.helm.chart import container, env_of, find, one, render, router_name, values_file
from tests.helm.test_rendered_commands_run import (
    ROOT,
    ROUTER,
    _request,
    router_args_for_static,
    router_config_file,
)

pytestmark = pytest.mark.helm


def _start_router(objs: list[dict], backends: str, log_path, wait_for: str) -> tuple[subprocess.Popen, int]:
    """The router from its rendered arguments and configuration; waits until `wait_for` (/ready: an engine
    is up; /health: the router itself is up) answers 200."""
    rendered_args = container(one(objs, "Deployment", router_name("Deployment")))["args"]
    port = free_port()
    log = log_path.open("wb")
    proc = subprocess.Popen(
        [
            str(ROUTER),
            "router",
            *router_args_for_static(rendered_args, backends, port, router_config_file(objs, log_path.parent)),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    deadline = time.monotonic() + 60
    while _request(f"http://127.0.0.1:{port}{wait_for}", timeout=2)[0] != 200:
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.2)
    return proc, port


def _run_pod_command(pod: dict, router_port: int) -> subprocess.CompletedProcess[str]:
    c = pod["spec"]["containers"][0]
    env = {name: e["value"] for name, e in env_of(c).items() if "value" in e}
    env["ROUTER_URL"] = f"http://127.0.0.1:{router_port}"
    assert c["command"] == ["python", "-c"]
    return subprocess.run(
        [sys.executable, "-c", *c["args"]],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _two_models(tmp_path, chat: str, embed: str, name: str = "values.yaml", **first) -> list[dict]:
    values = {
        "servingEngineSpec": {
            "modelSpec": [
                {"name": "chat", "modelURL": chat, **first},
                {"name": "embed", "modelURL": embed, "vllmConfig": {"runner": "pooling", "convert": "embed"}},
            ]
        }
    }
    return render([values_file(tmp_path, values, name)])


def _fails_without_engines(objs: list[dict], tmp_path) -> None:
    pod = one(objs, "Pod", router_name("Pod"))
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: zero engines
    router, port = _start_router(objs, dead, tmp_path / "router-none.log", "/health")
    try:
        proc = _run_pod_command(pod, port)
        assert proc.returncode != 0 and "not served by any engine" in proc.stdout + proc.stderr
    finally:
        stop_process(router, timeout=15)


def test_helm_test_pod_fails_with_zero_engines(tmp_path):
    _fails_without_engines(_two_models(tmp_path, "tiny-llama", "tiny-embed"), tmp_path)


@pytest.mark.engine
def test_helm_test_pod_proves_every_model_and_fails_without_engines(engines, embedding_engine, tmp_path):
    chat, embed = engines[0].served_model_name, embedding_engine.served_model_name
    objs = _two_models(tmp_path, chat, embed)
    pod = one(objs, "Pod", router_name("Pod"))
    backends = ",".join([*engines.urls, embedding_engine.url])
    router, port = _start_router(objs, backends, tmp_path / "router.log", "/ready")
    try:
        proc = _run_pod_command(pod, port)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"{chat} chat ok" in proc.stdout and f"{embed} embed ok" in proc.stdout
    finally:
        stop_process(router, timeout=15)
    _fails_without_engines(objs, tmp_path)
    # The same engine asked as a base model is (POST /v1/completions, what helmTestRequest: completion and
    # helmTest.completionModels choose).
    objs = _two_models(tmp_path, chat, embed, "completion.yaml", helmTestRequest="completion")
    router, port = _start_router(objs, backends, tmp_path / "router-completion.log", "/ready")
    try:
        proc = _run_pod_command(one(objs, "Pod", router_name("Pod")), port)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"{chat} completion ok" in proc.stdout and f"{embed} embed ok" in proc.stdout
    finally:
        stop_process(router, timeout=15)


def _asked(objs: list[dict]) -> dict[str, str]:
    pod = one(objs, "Pod", router_name("Pod"))
    return json.loads(env_of(pod["spec"]["containers"][0])["MODELS"]["value"])


@pytest.mark.parametrize(
    "model, kind",
    [
        ({"modelURL": "facebook/opt-125m"}, "completion"),  # a base model: its tokenizer has no chat template
        ({"modelURL": "distilbert/distilgpt2"}, "completion"),
        ({"modelURL": "facebook/opt-125m", "chatTemplate": "/t/chat.jinja"}, "chat"),  # given one: chat
        ({"modelURL": "meta-llama/Llama-3.1-8B-Instruct"}, "chat"),
        ({"modelURL": "org/m", "vllmConfig": {"runner": "pooling", "convert": "embed"}}, "embed"),
        ({"modelURL": "org/m", "helmTestRequest": "completion"}, "completion"),  # the model's key wins
        ({"modelURL": "facebook/opt-125m", "helmTestRequest": "chat"}, "chat"),
        ({"modelURL": "org/m", "helmTestRequest": "list"}, "pooling"),
    ],
)
def test_the_test_pod_asks_each_model_what_it_can_answer(tmp_path, model, kind):
    objs = render([values_file(tmp_path, {"servingEngineSpec": {"modelSpec": [{"name": "m", **model}]}})])
    assert _asked(objs) == {model.get("vllmConfig", {}).get("servedModelName", model["modelURL"]): kind}


def test_production_stack_files_with_opt_125m_ask_for_completions():
    from tests.helm.test_production_stack_names import rendering
    from tests.shared_data import PS_VALUES, require

    asked = {}
    for name in rendering():
        objs = render([require(PS_VALUES / name)])
        if find(objs, "Pod"):
            asked.update({f"{name}: {m}": k for m, k in _asked(objs).items()})
    opt = {k: v for k, v in asked.items() if k.endswith(": facebook/opt-125m")}
    assert len({k.split(":")[0] for k in opt}) >= 10, opt
    # opt-125m is asked for a chat completion only where the file gives it a chat template
    for key, kind in opt.items():
        name = key.split(":")[0]
        has_template = "chatTemplate" in (PS_VALUES / name).read_text()
        assert kind == ("chat" if has_template else "completion"), key
