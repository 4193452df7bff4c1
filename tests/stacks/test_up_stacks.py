"""`make test-stacks`: every chart example that deploys an engine, and production-stack values files
that render, brought up with `vllm-stack up` as a user would; each model answers through the router
(a chat completion, or an embedding for a pooling model), and Ctrl-C (SIGINT to its process group)
stops every part (no port of the
stack is still open afterwards).

Real parts throughout: vLLM engines (CPU build, the tiny model with dummy weights under each rendered
name), the router, LMCache's `lmcache_server` and `lmcache_controller`. Not part of `make test` (about
a minute per stack): `make test` brings up its own three stacks in tests/tutorials/.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from vllm_stack_dev.testbed.engines import port_for_later
from vllm_stack_dev.up.run import still_listening

from tests.helm.chart import EXAMPLES, ROOT
from tests.helm.test_production_stack_files import PS_DIR
from tests.shared_data import require

pytestmark = [pytest.mark.stacks, pytest.mark.engine, pytest.mark.helm]

NO_ENGINE = {"no-models.yaml"}  # refused by `up` itself: nothing to run (tests/up/test_plan.py)
# its provider is an engine the test starts behind TLS (tests/router/test_external_providers_engines.py)
NEEDS_PROVIDER = {"external-providers.yaml"}
PRODUCTION_STACK = [  # one of each kind: two pods, several models, API key, session, offload, LoRA, PD
    "tests__values-01-2pods-minimal-example.yaml",
    "tests__values-04-multiple-models.yaml",
    "tests__values-05-secure-vllm.yaml",
    "tests__values-06-session-routing.yaml",
    "tutorials__values-05-cpu-offloading.yaml",
    "tutorials__values-09-lora-helm.yaml",
    "tests__values-10-disagg-prefill.yaml",  # LMCache PD: NixlConnector on both pools here
]  # tutorials__values-13-tool-enabled.yaml: its llama3_json tool parser needs Llama 3's special tokens,
# which the tiny model's tokenizer lacks (the engine refuses to start); the plan itself is tested in tests/up
UP_TIMEOUT_S = 600


def _cases() -> list[pytest.param]:
    cases = [
        pytest.param(path, id=f"examples/{path.name}")
        for path in sorted(EXAMPLES.glob("*.yaml"))
        if path.name not in NO_ENGINE | NEEDS_PROVIDER
    ]
    return cases + [pytest.param(PS_DIR / name, id=f"production-stack/{name}") for name in PRODUCTION_STACK]


def _wait_up(process: subprocess.Popen, stack_json: Path, log: Path) -> dict:
    deadline = time.monotonic() + UP_TIMEOUT_S
    while not stack_json.exists():
        if process.poll() is not None:
            raise AssertionError(f"vllm-stack up exited {process.returncode}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"vllm-stack up not up after {UP_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    return json.loads(stack_json.read_text())


def _ask(client: httpx.Client, stack: dict, model: str) -> None:
    engine = next(p for p in stack["processes"] if p["component"] == "engine" and p["model"] == model)
    if "pooling" in engine["argv"]:
        answer = client.post("/embeddings", json={"model": model, "input": "Hello"})
        assert answer.status_code == 200, (model, answer.text)
        assert answer.json()["data"][0]["embedding"]
    else:
        answer = client.post(
            "/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
        )
        assert answer.status_code == 200, (model, answer.text)
        assert answer.json()["model"] == model


@pytest.mark.parametrize("values", _cases())
def test_stack_comes_up_answers_each_model_and_stops(values: Path, tmp_path: Path) -> None:
    require(values)  # production-stack's files are in ../shared: missing, this fails, never skips
    log = tmp_path / "up.log"
    logs = tmp_path / "stack"
    command = [sys.executable, "-m", "vllm_stack_dev.cli", "up", "-f", str(values)]
    command += ["--port", str(port_for_later()), "--log-dir", str(logs)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=os.environ
        )
    try:
        stack = _wait_up(process, logs / "stack.json", log)
        headers = {"Authorization": f"Bearer {stack['api_key']}"} if stack["api_key"] else {}
        with httpx.Client(base_url=stack["base_url"], headers=headers, timeout=120) as client:
            served = {m["id"] for m in client.get("/models").json()["data"]}
            assert set(stack["models"]) <= served
            for model in stack["models"]:
                _ask(client, stack, model)
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground process group
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(f"vllm-stack up did not stop in 90 s:\n{log.read_text()[-3000:]}") from None
    assert process.returncode == 0, log.read_text()[-3000:]
    still_open = still_listening(stack)
    assert not still_open, f"still listening after the stop: {still_open}"
