"""LMCache 0.5.6's own processes on this machine: its controller, and a stand-in for engines' workers.

LMCache cannot be installed here (its CUDA extension), so its wheel and sortedcontainers (its one
missing pure-Python import) are unpacked from ``.cache/wheels/`` (``make install`` fills it) and run
with the engine environment's Python, which has torch, vLLM and pyzmq. ``lmcache_controller`` runs on
CPU; ``tests/fakes/lmcache_worker.py`` registers instances and admits or evicts chunks through the
controller's ZMQ protocol with LMCache's own message classes (see its docstring for why a stand-in).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import httpx
from vllm_stack_dev.paths import engine_python
from vllm_stack_dev.testbed.engines import free_port, stop_process
from vllm_stack_dev.testbed.lmcache import lmcache_command, lmcache_env

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("lmcache_worker.py")


class Controller:
    """A running ``lmcache_controller`` on loopback: HTTP API at :attr:`url`, worker ports pull/reply."""

    def __init__(self, site: Path, log_path: Path, timeout: float = 120.0) -> None:
        self.api_port, self.pull, self.reply, self.heartbeat = (free_port() for _ in range(4))
        self.url = f"http://127.0.0.1:{self.api_port}"
        self.log_path = log_path
        ports = json.dumps({"pull": self.pull, "reply": self.reply, "heartbeat": self.heartbeat})
        args = ["--host", "127.0.0.1", "--port", str(self.api_port), "--monitor-ports", ports]
        self._log = log_path.open("wb")
        self.proc = subprocess.Popen(
            lmcache_command("lmcache_controller", args),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=lmcache_env(site),
        )
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"lmcache_controller did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)

    def _answers(self) -> bool:
        try:
            return httpx.post(self.url + "/lookup", json={"tokens": [1]}, timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def lookup(self, tokens: list[int]) -> dict[str, list]:
        r = httpx.post(self.url + "/lookup", json={"tokens": tokens}, timeout=10)
        r.raise_for_status()
        return r.json()["layout_info"]

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


class Workers:
    """``tests/fakes/lmcache_worker.py`` connected to ``controller``: instances, admits and evicts."""

    def __init__(self, controller: Controller, site: Path) -> None:
        self.controller = controller
        self.proc = subprocess.Popen(
            [
                str(engine_python()),
                str(WORKER),
                "--pull",
                f"127.0.0.1:{controller.pull}",
                "--reply",
                f"127.0.0.1:{controller.reply}",
            ],  # fmt: skip
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=lmcache_env(site),
            text=True,
        )

    def _ask(self, **command: object) -> dict:
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None and stdout is not None
        stdin.write(json.dumps(command) + "\n")
        stdin.flush()
        line = _read_line(stdout, self.proc)
        return json.loads(line)

    def register(self, instance: str) -> None:
        assert self._ask(op="register", instance=instance) == {"registered": True}

    def admit(self, instance: str, tokens: list[int]) -> None:
        """The chunks of ``tokens`` are in ``instance``'s LMCache; returns once the controller shows it."""
        self._ask(op="admit", instance=instance, tokens=tokens)
        self._until(tokens, lambda layout: layout.get(instance, [None, 0])[1] >= len(tokens) // 256 * 256)

    def evict(self, instance: str, tokens: list[int]) -> None:
        self._ask(op="evict", instance=instance, tokens=tokens)
        self._until(tokens, lambda layout: instance not in layout)

    def _until(self, tokens: list[int], shown: Callable[[dict], bool], within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while True:
            layout = self.controller.lookup(tokens)
            if shown(layout):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"the controller did not take the worker's message: {layout}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        stop_process(self.proc)


def _read_line(stdout: IO[str], proc: subprocess.Popen) -> str:
    line = stdout.readline()
    if not line:
        raise RuntimeError(f"the LMCache worker stand-in exited ({proc.poll()})")
    return line
