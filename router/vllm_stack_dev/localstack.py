"""`make run`: the whole stack as local processes — real vLLM engines and the router in front of them.

The router runs as its own process (`vllm-stack router ...`, the same command line the Helm chart
renders, with static discovery instead of Kubernetes) so that what a developer runs locally is what
production runs. Everything is stopped on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from vllm_stack_dev.paths import cache_dir
from vllm_stack_dev.testbed.engines import EngineStartError, start_engines, stop_process
from vllm_stack_dev.testbed.models import build_model

SERVED_MODEL = "tiny-llama"
# Generous: the first start after a fresh install is the slowest, and a busy machine slows it further.
ENGINE_READY_TIMEOUT = 600.0


def router_command(
    port: int, backends: list[str], routing_logic: str, model_dir: Path | None = None
) -> list[str]:
    """The router's command line; with ``prefixaware``, the model's own tokenizer (token mode)."""
    command = [
        sys.executable, "-m", "vllm_stack.cli", "router",
        "--host", "127.0.0.1", "--port", str(port),
        "--service-discovery", "static", "--static-backends", ",".join(backends),
        "--routing-logic", routing_logic,
    ]  # fmt: skip
    if routing_logic == "prefixaware" and model_dir is not None:
        command += ["--tokenizers", f"{SERVED_MODEL}={model_dir}"]
    return command


def wait_http_ok(url: str, timeout: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"router exited with code {process.returncode}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def run_local_stack(
    engines: int = 2, port: int = 8080, size: str = "tiny", routing_logic: str = "prefixaware"
) -> int:
    started = time.monotonic()
    port = int(os.environ.get("VLLM_STACK_PORT", port))
    model_dir = build_model(size, cache_dir() / "models" / size)
    log_dir = Path(tempfile.mkdtemp(prefix="vllm-stack-run-"))
    print(f"==> starting {engines} vLLM engines (CPU build, {size} model); logs in {log_dir}", flush=True)
    try:
        group = start_engines(
            engines, model_dir, SERVED_MODEL, log_dir=log_dir, ready_timeout=ENGINE_READY_TIMEOUT
        )
    except EngineStartError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    with group:
        for engine in group:
            print(f"    {engine.name}: {engine.url}", flush=True)
        router_log = (log_dir / "router.log").open("wb")
        router = subprocess.Popen(
            router_command(port, group.urls, routing_logic, model_dir),
            stdout=router_log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_http_ok(f"http://127.0.0.1:{port}/ready", 60, router)
        except RuntimeError as error:
            router.kill()
            print(f"error: {error}; router log {log_dir / 'router.log'}", file=sys.stderr)
            return 1
        base = f"http://127.0.0.1:{port}/v1"
        print(
            f"\nvllm-stack is up after {time.monotonic() - started:.0f} s.\n"
            f"  OpenAI base URL: {base}\n"
            f"  model:           {SERVED_MODEL}\n"
            f"  router log:      {log_dir / 'router.log'}\n\n"
            f"  curl {base}/chat/completions -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{SERVED_MODEL}", "messages": [{{"role": "user", "content": "Hello!"}}],'
            f' "max_tokens": 16}}\'\n\n'
            "Ctrl-C stops everything.",
            flush=True,
        )
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):
            if router.poll() is not None:
                print(f"router exited with code {router.returncode}", file=sys.stderr)
                break
        print("\n==> stopping", flush=True)
        stop_process(router)
    return 0
