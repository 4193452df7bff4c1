"""Start a planned stack, say where it is, and stop all of it on Ctrl-C (or when one part dies).

Order: LMCache's servers, then every engine in parallel, then the router, then Prometheus. Each
process runs in its own process group, dies with this one (PR_SET_PDEATHSIG), and is stopped as a
group, so that nothing outlives ``vllm-stack up``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vllm_stack_dev.paths import cache_dir, repo_root
from vllm_stack_dev.testbed.engines import (
    EngineGroup,
    EngineSpec,
    EngineStartError,
    dtype_override,
    launch,
    port_for_later,
    spawn_logged,
    stop_group,
    wait_ready,
)
from vllm_stack_dev.testbed.lmcache import lmcache_command, lmcache_env, unpack_lmcache
from vllm_stack_dev.testbed.models import build_lora, build_model
from vllm_stack_dev.up.plan import PlanError, Planner, StackPlan, memory_fit
from vllm_stack_dev.up.prometheus import ENGINE_JOB, ROUTER_JOB, Target, start_prometheus
from vllm_stack_dev.up.render import NAMESPACE, RenderError, render_release
from vllm_stack_dev.waiting import tcp_open, wait_until


@dataclass
class UpOptions:
    values: list[Path]
    sets: list[str] = field(default_factory=list)
    port: int = 8080
    namespace: str = NAMESPACE
    prometheus: bool = False
    prometheus_port: int = 9090
    max_engines: int | None = None
    log_dir: Path | None = None
    ready_timeout: float = 600.0
    dry_run: bool = False


READY_LINE = "Ctrl-C stops everything."  # the summary's last line: stack.json is written, every model answers


class StartError(RuntimeError):
    """A part of the stack did not start; the message names it and its log."""


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return 8.0


def make_plan(options: UpOptions, workdir: Path, model_dir: Path) -> StackPlan:
    release = render_release(options.values, options.sets, namespace=options.namespace)
    plan = Planner(
        release.objects,
        workdir=workdir,
        model_dir=model_dir,
        router_port=options.port,
        free_port=port_for_later,  # bound only when the stack starts: a bind(0) meanwhile must not take it
        cores=sorted(os.sched_getaffinity(0)),
        max_engines=options.max_engines or memory_fit(mem_available_gib()),
        namespace=options.namespace,
        dtype_override=dtype_override(),
    ).plan()
    plan.deviations = release.deviations  # what the chart itself did differently (its NOTES), said first
    return plan


def describe(plan: StackPlan) -> str:
    """What runs and what was changed to run it here, one line per change (replicas grouped)."""
    grouped: dict[tuple[str, str, str], list[str]] = {}
    for sub in plan.substitutions:
        grouped.setdefault((sub.rendered, sub.local, sub.why), []).append(sub.subject)
    lines = []
    if plan.deviations:
        lines.append("Deviations of the chart (as its NOTES lists them; strict: true refuses each):")
        lines += [f"  {line}" for line in plan.deviations]
    lines.append("Substituted (what this machine cannot have):")
    for (rendered, local, why), subjects in grouped.items():
        lines.append(f"  {', '.join(subjects)}: {rendered} -> {local} ({why})")
    if plan.not_run:
        lines.append("Kubernetes only, not run here:")
        lines += [f"  {item}" for item in plan.not_run]
    return "\n".join(lines)


def client_key(plan: StackPlan) -> str | None:
    """The first client API key the router will accept, when it checks keys (file or environment)."""
    router = plan.router
    if router is None:
        return None
    if "--api-keys-file" in router.argv:
        path = Path(router.argv[router.argv.index("--api-keys-file") + 1])
        for line in router.files.get(path, "").splitlines():
            if line.strip() and not line.startswith("#"):
                return line.strip()
    keys = router.env.get("VLLM_STACK_API_KEYS", "")
    return keys.replace(",", " ").split()[0] if keys.strip() else None


def _get(url: str, key: str | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, b""
    except OSError:
        return 0, b""


def _wait(what: str, ready: Callable[[], bool], process: subprocess.Popen, log: Path, timeout: float) -> None:
    try:
        wait_until(ready, timeout, process, what)
    except RuntimeError as error:
        raise StartError(f"{error}; log {log}:\n{_tail(log)}") from None


def _tail(log: Path, lines: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


def _pinned(command: list[str], cpu: int | None) -> list[str]:
    return ["taskset", "-c", str(cpu), *command] if cpu is not None else command


class RunningStack:
    """The processes of one plan; ``stop()`` ends all of them (the reverse of the start order)."""

    def __init__(self, plan: StackPlan, workdir: Path, log_dir: Path, model_dir: Path) -> None:
        self.plan = plan
        self.workdir = workdir
        self.log_dir = log_dir
        self.model_dir = model_dir
        self.engines = EngineGroup()
        self.others: list[tuple[str, subprocess.Popen, Path]] = []  # (name, process, log)
        self.prometheus_url: str | None = None

    def start(self, options: UpOptions, say: Callable[[str], None]) -> None:
        for process in self.plan.processes:
            for folder in process.folders:
                folder.mkdir(parents=True, exist_ok=True)
            for path, text in process.files.items():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            for folder in process.adapters:  # a seed per adapter: each changes the output its own way
                build_lora(self.model_dir, folder, seed=zlib.crc32(folder.name.encode()))
        self._start_lmcache(say)
        self._start_engines(options.ready_timeout, say)
        self._start_router(say)
        if options.prometheus:
            self._start_prometheus(options, say)

    def _start_lmcache(self, say: Callable[[str], None]) -> None:
        servers = self.plan.of("cache-server") + self.plan.of("lmcache-controller")
        if not servers:
            return
        site = unpack_lmcache(self.workdir / "lmcache")
        for server in servers:
            log = self.log_dir / f"{server.name}.log"
            command = _pinned(lmcache_command(server.argv[0], server.argv[1:]), server.cpu)
            process = spawn_logged(command, log, lmcache_env(site, server.env))
            self.others.append((server.name, process, log))
            _wait(server.name, lambda port=server.port: tcp_open(port), process, log, 120)
            say(f"    {server.name}: {server.argv[0]} on 127.0.0.1:{server.port}")

    def _start_engines(self, timeout: float, say: Callable[[str], None]) -> None:
        count = len(self.plan.engines)
        say(f"==> starting {count} vLLM engine{'s' if count > 1 else ''} (CPU build); logs in {self.log_dir}")
        for process in self.plan.engines:
            spec = EngineSpec(
                model_dir=self.model_dir,
                served_model_name=process.model or "",
                args=process.argv,
                env=process.env,
            )
            self.engines.add(
                launch(spec, name=process.name, cpu=process.cpu, log_dir=self.log_dir, port=process.port)
            )
        try:
            wait_ready(self.engines.engines, timeout)
        except EngineStartError as error:
            raise StartError(str(error)) from None
        for engine in self.engines:
            say(f"    {engine.name}: {engine.url} (model {engine.served_model_name}, core {engine.cpu})")

    def _start_router(self, say: Callable[[str], None]) -> None:
        router = self.plan.router
        if router is None:
            return
        log = self.log_dir / f"{router.name}.log"
        command = [sys.executable, "-m", "vllm_stack.cli", "router", *router.argv]
        process = spawn_logged(command, log, {**os.environ, **router.env}, cwd=repo_root())
        self.others.append((router.name, process, log))
        key = client_key(self.plan)
        models = set(self.plan.models)

        def serves_every_model() -> bool:
            status, body = _get(f"{router.url}/v1/models", key)
            return status == 200 and models <= {m["id"] for m in json.loads(body).get("data", [])}

        _wait(f"router {router.name}", serves_every_model, process, log, 120)
        say(f"    {router.name}: {router.url} (log {log})")

    def _start_prometheus(self, options: UpOptions, say: Callable[[str], None]) -> None:
        rules = self.workdir / "prometheus-rules.yaml"
        chart_rules = repo_root() / "helm" / "files" / "prometheus-rules.yaml"
        rules.write_text(self.plan.rules or chart_rules.read_text())
        namespace = {"namespace": options.namespace}
        targets = [
            Target(ENGINE_JOB, f"127.0.0.1:{e.port}", {**namespace, "pod": e.address}) for e in self.engines
        ]
        if self.plan.router is not None:
            address = f"127.0.0.1:{self.plan.router.port}"
            targets.append(Target(ROUTER_JOB, address, {**namespace, "pod": self.plan.router.name}))
        process = start_prometheus(targets, [rules], self.workdir / "prometheus", options.prometheus_port)
        self.others.append(("prometheus", process, self.workdir / "prometheus" / "prometheus.log"))
        self.prometheus_url = f"http://127.0.0.1:{options.prometheus_port}"
        say(f"    prometheus: {self.prometheus_url} (rules {rules})")

    def exited(self) -> str | None:
        """The name of a part that has exited, if any did."""
        for engine in self.engines:
            if not engine.is_running():
                return f"engine {engine.name} (code {engine.process.returncode}, log {engine.log_path})"
        for name, process, log in self.others:
            if process.poll() is not None:
                return f"{name} (code {process.returncode}, log {log})"
        return None

    def stop(self) -> None:
        for _name, process, _log in reversed(self.others):
            stop_group(process)
        self.engines.stop()


@contextlib.contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    """SIGINT (Ctrl-C) and SIGTERM stop the stack at any moment, also while it starts. SIGINT is set
    explicitly: a shell starts background jobs with SIGINT ignored, and Python keeps it ignored."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def summary(plan: StackPlan, stack: RunningStack, started: float) -> str:
    router = plan.router
    base = f"{router.url}/v1" if router else plan.engines[0].url + "/v1"
    key = client_key(plan)
    auth = f" -H 'Authorization: Bearer {key}'" if key else ""
    lines = [
        f"\nvllm-stack is up after {time.monotonic() - started:.0f} s.",
        f"  OpenAI base URL: {base}",
        *(f"  model:           {model}" for model in plan.models),
    ]
    if key:
        lines.append(f"  API key:         {key}")
    if stack.prometheus_url:
        lines.append(f"  Prometheus:      {stack.prometheus_url}")
    lines += [
        f"  logs:            {stack.log_dir} (what runs where: stack.json)",
        "",
        f"  curl {base}/chat/completions -H 'Content-Type: application/json'{auth} \\",
        f'    -d \'{{"model": "{plan.models[0] if plan.models else "MODEL"}", "messages": [{{"role": "user", "content": "Hello!"}}],'
        ' "max_tokens": 16}\'',
        "",
        READY_LINE,
    ]
    return "\n".join(lines)


def stack_file(plan: StackPlan, stack: RunningStack) -> dict:
    """What runs where, for scripts (``<log dir>/stack.json``): the printed summary as data."""
    router = plan.router
    return {
        "base_url": f"{router.url}/v1" if router else None,
        "models": plan.models,
        "api_key": client_key(plan),
        "prometheus": stack.prometheus_url,
        "processes": [
            {
                "name": p.name,
                "component": p.component,
                "url": p.url if p.port else None,
                "model": p.model,
                "role": p.role,
                "argv": p.argv,
                "log": str(stack.log_dir / f"{p.name}.log"),
            }
            for p in plan.processes
        ],
        "substitutions": [s.line() for s in plan.substitutions],
        "secrets": plan.generated_secrets,  # the keys generated for Secrets the chart does not render
    }


def still_listening(stack: dict) -> list[str]:
    """The parts of a stopped stack (its ``stack.json``) whose port still accepts connections."""
    return [p["name"] for p in stack["processes"] if p["url"] and tcp_open(int(p["url"].rsplit(":", 1)[1]))]


def up(options: UpOptions) -> int:
    """``vllm-stack up``: exit 1 with Helm's message if the chart refuses the values, else run until
    Ctrl-C / SIGTERM (0) or until a part of the stack exits (1)."""
    started = time.monotonic()

    def say(text: str) -> None:
        print(text, flush=True)

    log_dir = options.log_dir or Path(tempfile.mkdtemp(prefix="vllm-stack-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    workdir = log_dir / "pods"
    model_dir = build_model("tiny", cache_dir() / "models" / "tiny")
    try:
        plan = make_plan(options, workdir, model_dir)
    except RenderError as error:
        print(f"error: the chart refuses these values:\n{error}", file=sys.stderr)
        return 1
    except PlanError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    say(describe(plan))
    if options.dry_run:
        for process in plan.processes:
            say(f"$ [{process.name}] {' '.join(process.argv)}")
        if options.log_dir is None:
            shutil.rmtree(log_dir, ignore_errors=True)  # nothing was written there but the plan's folders
        return 0
    stack = RunningStack(plan, workdir, log_dir, model_dir)
    with _signals_as_interrupt():
        try:
            stack.start(options, say)
            written = log_dir / "stack.json.tmp"  # renamed: a script never reads half a file
            written.write_text(json.dumps(stack_file(plan, stack), indent=2))
            written.replace(log_dir / "stack.json")
            say(summary(plan, stack, started))
            while (gone := stack.exited()) is None:
                time.sleep(1.0)
            print(f"error: {gone} exited; stopping the stack", file=sys.stderr)
            return 1
        except StartError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            say("\n==> stopping")
            stack.stop()
