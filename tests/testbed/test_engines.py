"""The test bed's real vLLM engines (CPU build): they serve, stream, publish metrics and stop cleanly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from vllm_stack_dev.testbed.engines import EngineGroup, EngineSpec, EngineStartError, launch, wait_ready

pytestmark = pytest.mark.engine


def test_chat_completion_on_real_engine(engines: EngineGroup) -> None:
    response = httpx.post(
        f"{engines[0].url}/v1/chat/completions",
        json={"model": "tiny-llama", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 8
    assert body["system_fingerprint"].startswith("vllm-0.32")


def test_streamed_completion_arrives_as_sse_chunks(engines: EngineGroup) -> None:
    chunks: list[dict] = []
    done = False
    with httpx.stream(
        "POST",
        f"{engines[1].url}/v1/completions",
        json={
            "model": "tiny-llama",
            "prompt": "Once upon a time",
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=60,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done = True
                continue
            chunks.append(json.loads(payload))
    assert done, "the stream must end with data: [DONE]"
    # vLLM merges the tokens a slow reader has not taken yet into one chunk, so a loaded machine sees
    # fewer chunks than tokens: the count of chunks is the machine's, the count of tokens the engine's.
    text_chunks = [chunk for chunk in chunks if chunk["choices"]]
    assert text_chunks, "the text arrives in chunks of its own"
    assert chunks[-1]["usage"]["completion_tokens"] == 6, chunks[-1]
    assert all(chunk["object"] == "text_completion" for chunk in chunks)


def test_engines_are_configured_as_the_stack_expects(engines: EngineGroup) -> None:
    """Prefix caching on, the vLLM 0.32 metric names present, KV events and LoRA runtime loading enabled."""
    engine = engines[0]
    metrics = engine.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert name in metrics
    assert 'model_name="tiny-llama"' in metrics
    assert engine.kv_events_port is not None
    log = engine.log_path.read_text()
    assert "--enable-prefix-caching" in log and "--kv-events-config" in log and "--enable-lora" in log


def _group_anon_mib(leader: int) -> int:
    """Anonymous memory of a process group (the API server, its engine core and its worker), MiB."""
    total = 0
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            pid = int(status.parent.name)
            if os.getpgid(pid) != leader:
                continue
            fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
        except (OSError, ValueError):
            continue  # the process ended meanwhile
        total += int(fields.get("RssAnon", "0 kB").split()[0]) // 1024
    return total


def test_each_session_engine_stays_within_its_memory_budget(engines: EngineGroup) -> None:
    """The test session's KV cache (256 MiB, VLLM_STACK_ENGINE_KV_CACHE_MIB) keeps an engine under 2.3 GiB
    of anonymous memory (1.9 measured with PyPI's CUDA torch; 2.7 with the 1 GiB default): seven and more
    engines live at once on 24 GiB without swap, and past that the OOM killer takes an idle worker."""
    for engine in engines:
        assert "--kv-cache-memory-bytes 268435456" in engine.log_path.read_text().splitlines()[0]
        used = _group_anon_mib(engine.process.pid)
        assert 0 < used < 2300, f"{engine.name}: {used} MiB anonymous"


def test_lora_adapter_loads_at_runtime(engines: EngineGroup, lora_adapter_dir: Path) -> None:
    url = engines[1].url
    response = httpx.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "tb-lora", "lora_path": str(lora_adapter_dir)},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    try:
        models = {m["id"]: m for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        assert models["tb-lora"]["parent"] == "tiny-llama"
        completion = httpx.post(
            f"{url}/v1/completions", json={"model": "tb-lora", "prompt": "Hi", "max_tokens": 4}, timeout=60
        )
        assert completion.status_code == 200, completion.text
    finally:
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "tb-lora"}, timeout=30)


def test_failed_start_reports_log_tail_and_leaves_no_process(tmp_path: Path) -> None:
    """An engine that cannot start fails fast with its own error text, not a bare time-out."""
    missing = tmp_path / "no-such-model"
    engine = launch(
        EngineSpec(missing, "broken", kv_events=False, enable_lora=False),
        name="broken",
        cpu=0,
        log_dir=tmp_path,
    )
    group = EngineGroup([engine])
    with pytest.raises(EngineStartError) as error:
        wait_ready([engine], timeout=180)
    group.stop()
    assert "exited with code" in str(error.value)
    assert str(missing) in str(error.value), "the log tail names what went wrong"
    with pytest.raises(ProcessLookupError):
        os.killpg(engine.process.pid, 0)


def test_engine_dies_with_a_launcher_that_is_killed(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Even a launcher killed without clean-up (SIGKILL, os._exit) leaves no engine behind."""
    import subprocess
    import sys
    import time

    script = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from vllm_stack_dev.testbed.engines import EngineSpec, launch\n"
        f"engine = launch(EngineSpec({str(tiny_model_dir)!r}), name='orphan', cpu=0, log_dir=Path({str(tmp_path)!r}))\n"
        "print(engine.process.pid, flush=True)\n"
        "time.sleep(3)\n"
        "os._exit(0)\n"
    )
    launcher = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    pid = int(launcher.stdout.split()[0])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)
    os.killpg(pid, 9)
    pytest.fail("the engine outlived its launcher by more than 60 s")
