"""The routers compared by the routing-quality benchmark: how to start each one and when it is ready.

Each contender is a router process started fresh for each run, in its own process group (the Rust
router's launcher hands over to a child process, and a group can be stopped as a whole), with
PR_SET_PDEATHSIG so that no router outlives the benchmark even if the benchmark is killed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from vllm_stack_dev.testbed.engines import spawn_logged
from vllm_stack_dev.testbed.inference_pool import PoolSite

ROOT = Path(__file__).resolve().parents[2]
OURS = ROOT / ".venv" / "bin" / "vllm-stack"
SESSION_HEADER_FLAG = "x-user-id"


@dataclass(frozen=True)
class Setup:
    """What every contender is given: the two engines and the model they serve."""

    engine_urls: list[str]
    kv_event_ports: list[int | None]
    model: str
    model_dir: Path
    block_size: int
    pool: PoolSite | None = None  # the engines' InferencePool on a test cluster (the upstream EPP reads it)


@dataclass(frozen=True)
class Contender:
    """A router configuration: its name in the report, its family ("ours", "rust" or "upstream": the
    Inference Extension's endpoint picker behind our gateway mode) and command."""

    name: str
    family: str
    command: Callable[[Setup, int, int], list[str]]  # (setup, port, metrics port) -> argv
    env: Callable[[Setup], dict[str, str]] = lambda _setup: {}
    #: How long it may take to serve: a picker pair starts its pickers one after the other, each waited
    #: for up to 120 s (llm-d's precise profile also its render sidecar, up to 180 s), then the gateways.
    ready_timeout: float = 90.0


#: Our router's flags per contender. ``prefixaware`` with the model's tokenizer follows the engines'
#: KV events by default (``--kv-events auto``); ``ours-approx`` turns that off, leaving the index of
#: what the router itself sent where.
OUR_FLAGS: dict[str, tuple[str, ...]] = {
    "ours-roundrobin": ("--routing-logic", "roundrobin"),
    "ours-session": ("--routing-logic", "session"),
    "ours-approx": ("--routing-logic", "prefixaware", "--kv-events", "off"),
    "ours-kvevents": ("--routing-logic", "prefixaware", "--kv-events", "on"),
}


def _ours(name: str, tokenizers: bool = False) -> Callable[[Setup, int, int], list[str]]:
    """Command line of our router as contender `name` on `port`.

    The session header is named explicitly (`--session-key x-user-id`, the header the workloads send)
    so the comparison does not depend on the router's default header name."""

    def command(setup: Setup, port: int, _metrics_port: int) -> list[str]:
        args = [
            str(OURS), "router",
            "--host", "127.0.0.1", "--port", str(port),
            "--static-backends", ",".join(setup.engine_urls),
            *OUR_FLAGS[name],
            "--session-key", SESSION_HEADER_FLAG,
            "--log-level", "warning",
        ]  # fmt: skip
        if tokenizers:
            args += ["--tokenizers", f"{setup.model}={setup.model_dir}"]
        return args

    return command


def _picker_pair(picker: str, name: str = "", replicas: int = 1) -> Callable[[Setup, int, int], list[str]]:
    """Our router in gateway mode asking an endpoint picker (``picker_pair.py``): ``ours`` (`vllm-stack
    epp` with contender `name`'s flags), ``upstream`` (the Inference Extension's EPP v1.5.0 on the setup's
    InferencePool), ``llmd`` (llm-d's router, its default profile, on the same pool) or ``llmd-precise``
    (llm-d's router, its precise prefix-cache profile: a render sidecar for tokens, the engines' KV events
    at the pool's KV-event port)."""

    def command(setup: Setup, port: int, _metrics_port: int) -> list[str]:
        args = [sys.executable, str(ROOT / "benchmarks" / "routing" / "picker_pair.py"), "--picker", picker,
                "--port", str(port), "--backends", ",".join(setup.engine_urls), "--replicas", str(replicas)]  # fmt: skip
        if picker in ("upstream", "llmd", "llmd-precise"):
            assert setup.pool is not None, (
                f"the {picker} picker needs the InferencePool (quality.py makes it)"
            )
            args += ["--kubeconfig", str(setup.pool.kubeconfig), "--namespace", setup.pool.namespace,
                     "--pool", setup.pool.pool]  # fmt: skip
            if picker == "llmd-precise":
                args += ["--model", setup.model, "--model-dir", str(setup.model_dir),
                         "--kv-events-port", str(setup.pool.kv_events_port),
                         "--block-size", str(setup.block_size)]  # fmt: skip
        else:
            args += ["--", *OUR_FLAGS[name], "--session-key", SESSION_HEADER_FLAG, "--log-level", "warning",
                     "--tokenizers", f"{setup.model}={setup.model_dir}"]  # fmt: skip
        return args

    return command


def _rust(policy: str, kv_events: bool = False) -> Callable[[Setup, int, int], list[str]]:
    """Command line of the Rust vllm-router with `--policy policy` on `port` (installed on first use)."""

    def command(setup: Setup, port: int, metrics_port: int) -> list[str]:
        from run import install_reference  # benchmarks/router/run.py

        args = [
            str(install_reference()),
            "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *setup.engine_urls,
            "--policy", policy,
            "--prometheus-port", str(metrics_port),
            "--worker-startup-check-interval", "1",
            "--log-level", "warning",
        ]  # fmt: skip
        if kv_events:  # at the engine's own address: with a pool, each binds its Pod IP only
            for url, kv_port in zip(setup.engine_urls, setup.kv_event_ports, strict=True):
                args += ["--kv-event-source", f"{url}=tcp://{urlsplit(url).hostname}:{kv_port}"]
            args += ["--kv-event-block-size", str(setup.block_size), "--kv-event-model", setup.model]
        return args

    return command


def _rust_env(setup: Setup) -> dict[str, str]:
    """The Rust router finds a local tokenizer through VLLM_ROUTER_TOKENIZER (when it tokenizes at all)."""
    return {"VLLM_ROUTER_TOKENIZER": str(setup.model_dir)}


PAIR_READY = 180.0  # one picker (up to 120 s) and its gateway
PRECISE_READY = 360.0  # llm-d's precise picker: its render sidecar (up to 180 s) first
CONTENDERS: dict[str, Contender] = {
    "ours-roundrobin": Contender("ours-roundrobin", "ours", _ours("ours-roundrobin")),
    "ours-session": Contender("ours-session", "ours", _ours("ours-session")),
    "ours-approx": Contender("ours-approx", "ours", _ours("ours-approx", tokenizers=True)),
    "ours-kvevents": Contender("ours-kvevents", "ours", _ours("ours-kvevents", tokenizers=True)),
    "ours-epp": Contender(
        "ours-epp", "ours", _picker_pair("ours", "ours-kvevents"), ready_timeout=PAIR_READY
    ),
    "upstream-epp": Contender("upstream-epp", "upstream", _picker_pair("upstream"), ready_timeout=PAIR_READY),
    "llmd-router": Contender("llmd-router", "upstream", _picker_pair("llmd"), ready_timeout=PAIR_READY),
    # picker replicas: two pickers, each behind its own gateway, requests to the gateways in turn
    "ours-epp-x2": Contender(
        "ours-epp-x2", "ours", _picker_pair("ours", "ours-kvevents", replicas=2), ready_timeout=2 * PAIR_READY
    ),
    "llmd-router-x2": Contender(
        "llmd-router-x2", "upstream", _picker_pair("llmd", replicas=2), ready_timeout=2 * PAIR_READY
    ),
    "llmd-router-precise": Contender(
        "llmd-router-precise", "upstream", _picker_pair("llmd-precise"), ready_timeout=PRECISE_READY
    ),
    "llmd-router-precise-x2": Contender(
        "llmd-router-precise-x2",
        "upstream",
        _picker_pair("llmd-precise", replicas=2),
        ready_timeout=2 * PRECISE_READY,
    ),  # fmt: skip
    "rust-cache_aware": Contender("rust-cache_aware", "rust", _rust("cache_aware"), _rust_env),
    "rust-kv_aware": Contender("rust-kv_aware", "rust", _rust("kv_aware", kv_events=True), _rust_env),
}


def unavailable(name: str) -> str | None:
    """Why contender `name` cannot run here, or None. Checked once, before any engine starts."""
    contender = CONTENDERS[name]
    if contender.family == "ours":
        return None
    if name.startswith("llmd-router"):
        from vllm_stack_dev.testbed.upstream_epp import LLMD_EPP_ENV, llmd_epp_binary

        return (
            None
            if llmd_epp_binary()
            else f"llm-d's router is not built ({LLMD_EPP_ENV}: benchmarks/routing/llmd.md)"
        )
    if contender.family == "upstream":
        from vllm_stack_dev.gotools import epp_binary

        return None if epp_binary().is_file() else f"{epp_binary()} is missing: run `make install`"
    try:
        from run import install_reference

        install_reference()
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        return f"vllm-router could not be installed: {str(detail).strip().splitlines()[-1:]}"
    return None


@dataclass
class RouterProcess:
    """A started router: its process (group leader), port and log."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    metrics_url: str

    def policy_metrics(self, limit: int = 60) -> list[str]:
        """The router's own metrics about cache/KV/policy decisions, to see what a policy really did.

        Why: a KV-aware policy that silently falls back to load-only scoring looks like a bad
        cache policy in the engines' figures; its own counters tell the two apart."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
                text = response.read().decode(errors="replace")
        except (OSError, ValueError) as exc:
            return [f"(metrics not read: {exc})"]
        pattern = re.compile(r"kv|cache|prefix|policy|tokeni", re.IGNORECASE)
        lines = [line for line in text.splitlines() if line and line[0] != "#" and pattern.search(line)]
        return lines[:limit]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the router's process group, SIGKILL what is left after `timeout` seconds."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)


def start(
    contender: Contender, setup: Setup, port: int, metrics_port: int, log_dir: Path, tag: str
) -> RouterProcess:
    """Start `contender` on `port` (Rust: metrics on `metrics_port`); output to log_dir/<tag>.log."""
    log_path = log_dir / f"{tag}.log"
    command = contender.command(setup, port, metrics_port)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(contender.env(setup))
    process = spawn_logged(command, log_path, env, cwd=ROOT)
    metrics = metrics_port if contender.family == "rust" else port
    return RouterProcess(contender.name, process, port, log_path, f"http://127.0.0.1:{metrics}/metrics")


def wait_ready(router: RouterProcess, model: str, timeout: float = 90.0) -> None:
    """Until the router answers /v1/models listing `model` (it has found the engines), or fail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if router.process.poll() is not None:
            raise RuntimeError(f"{router.name} exited with {router.process.returncode}:\n{router.log_tail()}")
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(f"{router.url}/v1/models", timeout=2) as response:
                if response.status == 200 and f'"{model}"' in response.read().decode():
                    return
        time.sleep(0.3)
    raise TimeoutError(f"{router.name} not ready in {timeout:.0f} s:\n{router.log_tail()}")


def add_router_benchmarks_to_path() -> None:
    """benchmarks/router/run.py holds install_reference(); make it importable as `run`."""
    path = str(ROOT / "benchmarks" / "router")
    if path not in sys.path:
        sys.path.insert(0, path)
