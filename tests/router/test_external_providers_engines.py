"""External providers against a real vLLM engine playing the provider: served over TLS (a certificate
from a CA made in the test) and started with ``--api-key``, so the router must present the provider's
key from its environment variable and verify the provider against the CA bundle it was given.
Chat and completions, streamed and not, ``/v1/models`` beside nothing local (external-only), the key
nowhere in answers, ``/engines``, ``/metrics`` or the router's log; a CA that did not sign the
engine's certificate is refused with an OpenAI-shaped 502 that says why."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from vllm_stack_dev.testbed.engines import (
    Engine,
    EngineSpec,
    default_cpus,
    launch,
    port_for_later,
    wait_ready,
)

from tests.conftest import CHAT_MODEL, READY_TIMEOUT
from tests.fakes.certs import ServerCert, make_ca_and_server_cert
from tests.helm.chart import ROOT
from tests.router.helpers import FAST, client, http, serving, wait_for
from vllm_stack.app import build_router

pytestmark = pytest.mark.engine

KEY = "sk-engine-as-provider-5f0c2a"
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ServerCert:
    return make_ca_and_server_cert(tmp_path_factory.mktemp("provider-ca"), name="provider-ca")


@pytest.fixture(scope="module")
def provider(certs: ServerCert, tiny_model_dir: Path, engine_logs_dir: Path) -> Iterator[Engine]:
    """A real vLLM engine behind TLS that asks for ``KEY`` on its API."""
    spec = EngineSpec(
        tiny_model_dir,
        CHAT_MODEL,
        kv_events=False,
        enable_lora=False,
        extra_args=["--api-key", KEY, "--ssl-certfile", certs.cert_file, "--ssl-keyfile", certs.key_file],
    )
    engine = launch(
        spec, name="tls-provider", cpu=default_cpus(1)[0], log_dir=engine_logs_dir, ca_file=certs.ca_file
    )
    try:
        wait_ready([engine], READY_TIMEOUT)
        yield engine
    finally:
        engine.stop()


def providers_file(tmp_path: Path, api_base: str) -> str:
    doc = {
        "external_providers": [
            {
                "name": "tls-vllm",
                "type": "openai",
                "api_base": api_base,
                "api_key_env_var": "PROVIDER_KEY",
                "models": [{"id": CHAT_MODEL, "type": "chat", "aliases": ["remote-llama"]}],
            }
        ]
    }
    path = tmp_path / "providers.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


async def test_a_real_engine_behind_tls_with_a_key_serves_as_a_provider(
    provider: Engine, certs: ServerCert, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    router = build_router(
        {
            **FAST,
            "service_discovery": "external-only",
            "external_providers_config": providers_file(tmp_path, provider.url),
            "external_ca_file": certs.ca_file,
        },
        environ={"PROVIDER_KEY": KEY},
    )
    answers: list[str] = []
    async with serving(router) as url, http(url) as h:
        await wait_for(
            lambda: router.registry.healthy_count == 1,
            what="the provider healthy (its /v1/models with the key)",
        )
        models = (await h.get("/v1/models")).json()["data"]
        assert {(m["id"], m["owned_by"]) for m in models} == {
            (CHAT_MODEL, "tls-vllm"),
            ("remote-llama", "tls-vllm"),
        }
        c = client(url, api_key="the-clients-own-key")  # replaced by the provider's key
        for model in (CHAT_MODEL, "remote-llama"):
            chat = await c.chat.completions.create(model=model, messages=MSG, max_tokens=4)
            assert chat.choices[0].message.content and chat.model == CHAT_MODEL
            answers.append(chat.model_dump_json())
        stream = await c.chat.completions.create(
            model="remote-llama", messages=MSG, max_tokens=5, stream=True
        )
        chunks = [chunk async for chunk in stream]
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
        answers += [chunk.model_dump_json() for chunk in chunks]
        done = await c.completions.create(model="remote-llama", prompt="one two", max_tokens=4)
        assert done.choices[0].text and done.usage.completion_tokens == 4
        answers.append(done.model_dump_json())
        streamed = await c.completions.create(model=CHAT_MODEL, prompt="one two", max_tokens=4, stream=True)
        parts = [part async for part in streamed]
        assert "".join(p.choices[0].text for p in parts if p.choices)
        answers += [p.model_dump_json() for p in parts]
        for path in ("/engines", "/metrics", "/v1/models"):
            answers.append((await h.get(path)).text)
        assert 'engine="external:tls-vllm"' in answers[-2]
    answers.append(caplog.text)  # the router's log (the provider's own holds its --api-key, naturally)
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in provider.log_tail(400)  # it answered, key accepted
    for text in answers:
        assert KEY not in text


async def test_a_ca_that_did_not_sign_the_provider_is_refused(provider: Engine, tmp_path: Path) -> None:
    """The router verifies the provider: with another CA bundle no request reaches it, and the client
    reads why in an OpenAI-shaped 502."""
    other = make_ca_and_server_cert(tmp_path / "other", name="other-ca")
    router = build_router(
        {
            **FAST,
            "service_discovery": "external-only",
            "external_providers_config": providers_file(tmp_path, provider.url),
            "external_ca_file": other.ca_file,
        },
        environ={"PROVIDER_KEY": KEY},
    )
    async with serving(router) as url, httpx.AsyncClient(base_url=url) as h:
        await wait_for(
            lambda: router.registry.engines()[0].last_error is not None, what="the provider's failed check"
        )
        answer = await h.post(
            "/v1/chat/completions", json={"model": CHAT_MODEL, "messages": MSG, "max_tokens": 2}
        )
    assert answer.status_code == 502
    assert answer.headers["x-vllm-stack-error"]
    error = answer.json()["error"]
    assert error["code"] == "upstream_unreachable" and "CERTIFICATE_VERIFY_FAILED" in error["message"]
    assert KEY not in answer.text


def _example_for(provider: Engine, certs: ServerCert, tmp_path: Path) -> Path:
    """helm/examples/external-providers.yaml with this test's provider: its URL, its CA beside the
    providers file in the ConfigMap (the provider serves https here), its key in the Secret."""
    values = yaml.safe_load((ROOT / "helm" / "examples" / "external-providers.yaml").read_text())
    secret, config_map = values["extraObjects"]
    secret["stringData"]["local-vllm"] = KEY
    providers = yaml.safe_load(config_map["data"]["providers.yaml"])
    providers["external_providers"][0]["api_base"] = provider.url
    # a flag, not the file's ca_file: `up` moves the mount, and rewrites paths in arguments only
    values["routerSpec"]["extraArgs"] += ["--external-ca-file", "/etc/vllm-stack/providers/ca.pem"]
    config_map["data"] = {
        "providers.yaml": yaml.safe_dump(providers),
        "ca.pem": Path(certs.ca_file).read_text(),
    }
    path = tmp_path / "external-providers.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def test_the_example_values_file_runs_with_vllm_stack_up(
    provider: Engine, certs: ServerCert, tmp_path: Path
) -> None:
    """`vllm-stack up` on the chart's external-providers example: the router alone (external-only), its
    providers file and CA from the ConfigMap, the key from the Secret; the provider's model answers."""
    logs = tmp_path / "stack"
    command = [
        sys.executable,
        "-m",
        "vllm_stack_dev.cli",
        "up",
        "-f",
        str(_example_for(provider, certs, tmp_path)),
    ]
    command += ["--port", str(port_for_later()), "--log-dir", str(logs)]
    log = tmp_path / "up.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 120
        while not (logs / "stack.json").exists():
            assert process.poll() is None, (
                f"vllm-stack up exited {process.returncode}:\n{log.read_text()[-4000:]}"
            )
            assert time.monotonic() < deadline, f"vllm-stack up not up in 120 s:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)  # noqa: ASYNC251 - a sync test polling a file the other process writes
        stack = json.loads((logs / "stack.json").read_text())
        with httpx.Client(base_url=stack["base_url"], timeout=60) as h:
            deadline = time.monotonic() + 60
            while {m["id"] for m in h.get("/models").json()["data"]} != {CHAT_MODEL, "remote-llama"}:
                assert time.monotonic() < deadline, "the provider's models in /v1/models within 60 s"
                time.sleep(0.2)
            answer = h.post(
                "/chat/completions", json={"model": "remote-llama", "messages": MSG, "max_tokens": 3}
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == CHAT_MODEL
    finally:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(60)
    for path in [log, *logs.rglob("*.log")]:  # up's own output and every process's log
        assert KEY not in path.read_text(errors="replace"), path
