"""The tutorials whose local part is `vllm-stack up` on the tutorial's own values file, run as written:
01 (one model: curl and the OpenAI SDK), 06 (two models behind one router), 07 (session affinity on two
replicas, then round-robin and prefix-aware routers on the same engines), 08 (LMCache's cache server
next to an engine; the offload itself needs a GPU, which the tutorial says).

Each brings up its stack from the rendered chart: real vLLM engines (CPU build, the tiny model with
dummy weights), the real router, the real `lmcache_server`. The only substitutions: the tutorial's
ports (8000 for the router, 8001/8002 for 07's extra routers) are free ports and its scratch folder
/tmp/vllm-stack-tutorial is the test's own. The Kubernetes part of each is rendered with the chart (no
cluster here).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_stack_dev.up.run import READY_LINE, still_listening

from tests.tutorials.render_checks import check_render
from tests.tutorials.runner import ROOT, TutorialRun, tutorial_env, tutorial_port

pytestmark = [pytest.mark.engine, pytest.mark.helm]

STACK_READY_TIMEOUT_S = 480  # `vllm-stack up`: helm template, engines (a minute each on a busy CPU), router


def _run(name: str, tmp_path: Path, extra_ports: tuple[str, ...] = ()) -> dict[str, list[str]]:
    port = tutorial_port()
    replacements = {"8000": str(port), "/tmp/vllm-stack-tutorial": str(tmp_path / "scratch")}
    replacements |= {extra: str(tutorial_port()) for extra in extra_ports}
    tutorial = TutorialRun(
        ROOT / "tutorials" / name,
        replacements=replacements,
        env=tutorial_env(),
        port=port,
        log_dir=tmp_path,
        server_step="stack",
        ready_timeout=STACK_READY_TIMEOUT_S,
        ready_line=READY_LINE,
    )
    assert "stack" in tutorial.names and tutorial.names[0] == "render"
    outputs = tutorial.run_all()  # ends with SIGTERM to `vllm-stack up`
    for stack_json in (tmp_path / "scratch").glob("*/stack.json"):
        left = still_listening(json.loads(stack_json.read_text()))
        assert not left, f"still listening after vllm-stack up stopped: {left}"
    return outputs


def test_minimal_tutorial(tmp_path: Path) -> None:
    out = _run("01-helm-minimal.md", tmp_path)
    check_render("01-helm-minimal.md", out["render"][0])
    models, answer = out["try"][0].splitlines()
    assert models == "['facebook/opt-125m']"
    assert answer.startswith("facebook/opt-125m ") and answer.endswith(" tokens")
    chat, streamed = out["sdk"][0].splitlines()
    assert chat.startswith("chat: ")
    assert int(streamed.split(": ")[1]) >= 2  # chunks, and the last one


def test_multiple_models_tutorial(tmp_path: Path) -> None:
    out = _run("06-multiple-models.md", tmp_path)
    check_render("06-multiple-models.md", out["render"][0])
    lines = out["try"][0].splitlines()
    assert lines[0] == "models: ['Qwen/Qwen2.5-1.5B-Instruct', 'meta-llama/Llama-3.1-8B-Instruct']"
    assert "Qwen/Qwen2.5-1.5B-Instruct answered by Qwen/Qwen2.5-1.5B-Instruct" in lines
    assert "meta-llama/Llama-3.1-8B-Instruct answered by meta-llama/Llama-3.1-8B-Instruct" in lines
    assert "gpt-4: 404 model_not_found" in lines
    engines = out["engines"][0].splitlines()
    assert sorted(engines) == [
        "vllm-stack-llama3-deployment-vllm-0 meta-llama/Llama-3.1-8B-Instruct served 1",
        "vllm-stack-qwen-deployment-vllm-0 Qwen/Qwen2.5-1.5B-Instruct served 1",
    ]


def test_routing_strategies_tutorial(tmp_path: Path) -> None:
    out = _run("07-routing-strategies.md", tmp_path, extra_ports=("8001", "8002"))
    check_render("07-routing-strategies.md", out["render"][0])
    assert out["session"][0].splitlines() == [
        f"{user} -> 1 engine, 4 requests" for user in ("alice", "bob", "carol")
    ]
    roundrobin, prefix = out["strategies"][0].splitlines()
    assert roundrobin == "roundrobin engines per document: [[0, 1], [0, 1]]"
    documents = eval(prefix.split(": ", 1)[1])  # noqa: S307 - the tutorial's own printed list
    assert prefix.startswith("prefixaware") and [len(engines) for engines in documents] == [1, 1]


def test_kv_offload_cache_server_tutorial(tmp_path: Path) -> None:
    out = _run("08-kv-offload-cache-server.md", tmp_path)
    check_render("08-kv-offload-cache-server.md", out["render"][0])
    said = out["cache-server"][0]
    assert said.startswith("cache server listening on 127.0.0.1:")
    assert "--kv-transfer-config LMCacheConnectorV1 -> none" in said and "needs its CUDA extension" in said
    first, second = out["prefix-cache"][0].splitlines()
    assert first.startswith("first") and int(second.rsplit(" ", 1)[1]) > 0, second
