"""Runs a tutorial's marked steps in order, as a reader would, with a test's few substitutions.

Every tutorial test has the same shape: replace the tutorial's fixed port and directory with the
test's own, run each step with bash (or the project's Python), and start the one step that keeps
running (the router) in its own process group, wait until it answers ``/ready``, and stop the group
at the end. The test then asserts on what each step printed.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from vllm_stack_dev.testbed.engines import port_for_later
from vllm_stack_dev.waiting import wait_http_ok, wait_until

from tests.tutorials.markdown import Step, steps

ROOT = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 300
READY_TIMEOUT_S = 60


TUTORIAL_PORTS = ("8000", "8001", "8002", "9090")  # the fixed ports tutorials write, replaced by tests


def tutorial_port() -> int:
    """A port for a tutorial's fixed one: free until the test's process binds it (``port_for_later``),
    and with no tutorial port inside it, so that replacing one never rewrites another's replacement."""
    while True:
        port = port_for_later()
        if not any(fixed in str(port) for fixed in TUTORIAL_PORTS):
            return port


def tutorial_env(**extra: str) -> dict[str, str]:
    """This environment with the project's helm and virtualenv first on PATH, plus ``extra``."""
    path = f"{ROOT / '.tools' / 'helm4'}:{ROOT / '.venv' / 'bin'}:{os.environ['PATH']}"
    return {**os.environ, "PATH": path, **extra}


class TutorialRun:
    """One run of one tutorial: ``replacements`` maps the tutorial's text to the test's own (a port, a
    directory); ``server_step`` is the step that keeps running, serving on ``port`` (``server_running``: it is
    already running, started by the same step of another tutorial)."""

    def __init__(
        self,
        tutorial: Path,
        *,
        replacements: Mapping[str, str],
        env: Mapping[str, str],
        port: int,
        log_dir: Path,
        server_step: str = "router",
        ready_timeout: float = READY_TIMEOUT_S,
        server_running: bool = False,
        ready_line: str | None = None,
    ) -> None:
        self.steps = steps(tutorial)
        self.replacements = dict(replacements)
        self.env = dict(env)
        self.port = port
        self.log_path = log_dir / f"{server_step}.log"
        self.server_step = server_step
        self.ready_timeout = ready_timeout
        self.server_running = server_running  # the same server step is already running (another tutorial's)
        self.ready_line = ready_line  # the server is ready once its output has this line (as a reader sees)
        self.outputs: dict[str, list[str]] = {}

    @property
    def names(self) -> list[str]:
        return [step.name for step in self.steps]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def substituted(self, step: Step) -> str:
        code = step.code
        for old, new in self.replacements.items():
            code = code.replace(old, new)
        return code

    def run_all(self, after_server_start: Callable[[str], None] | None = None) -> dict[str, list[str]]:
        """Run every step in order; ``after_server_start(url)`` runs once the server is ready.

        Returns each step's printed output, a list per step name (a step may appear more than once).
        """
        with self._server_stopped_at_end() as start_server:
            for step in self.steps:
                code = self.substituted(step)
                if step.name == self.server_step:
                    if self.server_running:
                        continue
                    start_server(code)
                    if after_server_start is not None:
                        after_server_start(self.url)
                    continue
                self.outputs.setdefault(step.name, []).append(self._run(step, code))
        return self.outputs

    def run_step(self, name: str) -> str:
        """Run the first step called ``name`` alone (a render step, which needs no server) and return what
        it printed."""
        step = next(step for step in self.steps if step.name == name)
        return self._run(step, self.substituted(step))

    def _run(self, step: Step, code: str) -> str:
        command = (
            ["bash", "-euo", "pipefail", "-c", code]
            if step.language == "bash"
            else [str(ROOT / ".venv/bin/python"), "-c", code]
        )
        proc = subprocess.run(
            command, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S
        )
        assert proc.returncode == 0, (
            f"step {step.name} failed ({proc.returncode}):\n{code}\n{proc.stdout}\n{proc.stderr}"
        )
        return proc.stdout

    @contextmanager
    def _server_stopped_at_end(self) -> Iterator[Callable[[str], None]]:
        servers: list[subprocess.Popen[bytes]] = []

        def start(code: str) -> None:
            with self.log_path.open("wb") as log:
                server = subprocess.Popen(  # its own process group: stopped as a whole below
                    ["bash", "-c", code],
                    cwd=ROOT,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            servers.append(server)
            try:
                wait_http_ok(f"{self.url}/ready", self.ready_timeout, server)
                if self.ready_line is not None:
                    wait_until(
                        lambda: self.ready_line in self.log_path.read_text(errors="replace"),
                        self.ready_timeout,
                        server,
                        f"the {self.server_step} step (until it prints {self.ready_line!r})",
                    )
            except RuntimeError as exc:
                raise AssertionError(f"{exc}:\n{self.log_path.read_text()[-2000:]}") from None

        try:
            yield start
        finally:
            for server in servers:
                _stop_group(server)


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group (a graceful stop), SIGKILL it if it has not gone in 15 s."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(5)
