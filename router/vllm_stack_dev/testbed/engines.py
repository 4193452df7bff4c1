"""Start and stop real vLLM engines (the CPU build) as local processes.

Used by the tests, the benchmarks and `make run`. Each engine is the real OpenAI server
(`python -m vllm.entrypoints.openai.api_server`) from the separate engine environment, started in its
own process group so that stopping it also stops vLLM's engine-core child. Engines are stopped when the
group is stopped, when the interpreter exits, and (through PR_SET_PDEATHSIG) when the parent process dies
abruptly, so no engine outlives the test session that started it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import ssl
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_stack_dev.paths import engine_python

DEFAULT_READY_TIMEOUT = 300.0
_PR_SET_PDEATHSIG = 1


class EngineStartError(RuntimeError):
    """An engine exited or did not become ready in time; the message carries its log tail."""


def log_tail(path: Path, lines: int = 60) -> str:
    """The last ``lines`` of a process's log, for an error message ("(no log)" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def free_port() -> int:
    """Ask the kernel for a free TCP port on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def port_for_later() -> int:
    """A free loopback port for a process a test starts later (a router's ``--port``, a tutorial's fixed
    port), taken below the kernel's ephemeral range: a port from ``free_port`` is free only now, and
    any ``bind(0)`` until the process binds it (an engine's own sockets, torch's TCP store) may take it."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    candidates = list(range(max(1024, low - 12000), low))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return free_port()


def nixl_loopback_env(side_channel_port: int | None = None) -> dict[str, str]:
    """The environment of a NixlConnector engine whose peers run on the same host without a GPU.

    Each engine gets its own side channel (the ZMQ port on which a decode engine asks a prefill engine
    for its KV blocks), on loopback. UCX moves the blocks over loopback TCP only: by default it also
    tries every network interface and the shared-memory transports, which depend on the host's NICs
    and kernel settings, and none of them is needed between two local processes.
    """
    return {
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port or port_for_later()),
        "UCX_TLS": "tcp,self",
        "UCX_NET_DEVICES": "lo",
    }


def stop_process(process: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM `process`, then SIGKILL it if it has not exited after `timeout` seconds."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def stop_group(process: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM the process group ``process`` leads (spawn_logged starts one), wait up to ``timeout``
    seconds, then SIGKILL the group: a child (vLLM's engine core) may linger after its leader exits."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if the launching process dies (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn_logged(
    command: Sequence[str], log_path: Path, env: dict[str, str] | None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``command`` in its own process group (so stopping it stops its children), output and the
    command line itself to ``log_path``, ended when this process dies (PR_SET_PDEATHSIG)."""
    with log_path.open("wb") as log:
        log.write(("$ " + " ".join(command) + "\n").encode())
        log.flush()
        return subprocess.Popen(
            list(command),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )


def default_kv_cache_mib() -> int:
    """The KV cache an engine gets unless its spec says: ``VLLM_STACK_ENGINE_KV_CACHE_MIB``, else 1024.

    Why a setting: the PyPI torch (its CUDA build, used where no CPU wheel is at hand) costs each of an
    engine's three processes about 220 MB more anonymous memory than the CPU wheel, and the test
    session keeps seven engines and more alive at once on 24 GiB with no swap; the kernel's OOM killer
    then took an idle engine's worker (CI, 2026-12-04). The test session asks for 256 MiB (half a
    million tokens of the tiny model, far more than any test holds); ``make run`` keeps 1 GiB.
    """
    return int(os.environ.get("VLLM_STACK_ENGINE_KV_CACHE_MIB", "1024"))


@dataclass
class EngineSpec:
    """What to start: one model, served under one name, with the test bed's defaults.

    `args` replaces the generated server arguments entirely when given (used to start the exact
    arguments a Helm chart renders); `extra_args` are appended to the generated ones.
    """

    model_dir: Path | str
    served_model_name: str = "tiny-llama"
    kv_cache_mib: int = field(default_factory=default_kv_cache_mib)
    enable_lora: bool = True
    max_loras: int = 4
    max_lora_rank: int = 8
    kv_events: bool = True
    kv_replay: bool = False  # also a replay endpoint for missed KV-event batches
    runner: str | None = None  # e.g. "pooling" (with convert="embed") for an embedding engine
    convert: str | None = None
    max_model_len: int | None = 2048
    # No torch.compile: it gains the tiny model nothing on CPU (64 tokens in 0.82 s eager, 0.85 s compiled)
    # and costs about 85 s of CPU at each start of a configuration it has not compiled before (here:
    # engines without LoRA; with LoRA vLLM does not compile on CPU), five at once on a fresh machine.
    enforce_eager: bool = True
    extra_args: Sequence[str] = ()
    args: Sequence[str] | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Engine:
    """A running engine: where it listens and how to reach its log."""

    name: str
    port: int
    kv_events_port: int | None
    served_model_name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    cpu: int | None
    kv_replay_port: int | None = None
    host: str = "127.0.0.1"  # a loopback address: 127.0.0.1, or a test cluster Pod's own IP
    ca_file: str | None = None  # it serves https (--ssl-certfile), its certificate signed by this CA

    @property
    def url(self) -> str:
        return f"{'https' if self.ca_file else 'http'}://{self.host}:{self.port}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def is_running(self) -> bool:
        return self.process.poll() is None

    def is_ready(self) -> bool:
        """Whether it answers ``/health`` now (it needs no API key)."""
        return _probe(f"{self.url}/health", ca_file=self.ca_file)

    def metrics(self, timeout: float = 5.0) -> str:
        """The engine's Prometheus exposition text."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=timeout) as response:
            return response.read().decode()

    def metric_value(self, name: str) -> float:
        """Sum of every sample of `name` (e.g. `vllm:num_requests_running`) in the engine's metrics."""
        return metric_sum(self.metrics(), name)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the engine's process group, then SIGKILL what is left after `timeout` seconds."""
        stop_group(self.process, timeout)

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the engine's whole process group (SIGSTOP/SIGCONT: a hang and its end)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL the engine at once (failure-injection tests)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


def metric_sum(metrics: str, name: str) -> float:
    """Sum of every sample of `name` in Prometheus exposition text (one scrape read several times)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ":
            total += float(line.rsplit(" ", 1)[1])
    return total


def cpu_has_amx(cpuinfo: str | None = None) -> bool:
    """Whether this CPU advertises AMX tiles (``amx_tile`` in /proc/cpuinfo's flags)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    return any(line.startswith("flags") and " amx_tile" in line for line in cpuinfo.splitlines())


def dtype_override() -> list[str]:
    """``--dtype float32`` on CPUs with AMX, unless ``VLLM_STACK_ENGINE_DTYPE`` names a dtype.

    Why: for bfloat16 models vLLM 0.32's CPU attention picks its AMX kernels whenever the CPU
    advertises AMX, without asking Linux for the AMX permission first, and the engine's worker dies
    with SIGILL on its first request (measured on this project's machines, which advertise
    ``amx_tile``); with the permission granted by hand, warm-up stalled for over a minute. float32
    has no AMX path. Elsewhere the model's own dtype (bfloat16) stays.
    """
    forced = os.environ.get("VLLM_STACK_ENGINE_DTYPE")
    if forced:
        return ["--dtype", forced]
    return ["--dtype", "float32"] if cpu_has_amx() else []


def kv_events_bind_host(host: str) -> str:
    """How vLLM's KV-event publisher is told to *bind* ``host`` alone: an IPv4 address as IPv4-mapped IPv6
    (``[::ffff:127.16.0.1]``). vLLM 0.32 binds an endpoint only when it holds ``*`` or ``::``
    (``ZmqEventPublisher._is_bind_endpoint``) and connects to any other, so ``tcp://127.16.0.1:5557``
    would make the engine a client; libzmq binds the mapped form to the IPv4 address itself (its last
    endpoint reads ``tcp://127.16.0.1:5557``), and subscribers dial either form."""
    return host if ":" in host else f"[::ffff:{host}]"


def server_args(
    spec: EngineSpec,
    port: int,
    kv_events_port: int | None,
    kv_replay_port: int | None = None,
    host: str = "127.0.0.1",
    kv_events_at_host: bool = False,
) -> list[str]:
    """The api_server arguments the test bed uses for `spec` (unless `spec.args` overrides them).

    ``kv_events_at_host``: the KV-event publisher binds ``host`` itself, not every interface, and names
    its topic as llm-d's subscriber parses it (``kv@<pod>@<model>``, the model being the served name its
    block keys are computed under), so that engines at different loopback addresses can share one
    port, the one llm-d's router dials at each Pod's IP (``tcp://<PodIP>:<socketPort>``)."""
    if spec.args is not None:  # the dtype substitution goes last, so it wins over a rendered one
        loopback = ["--host", host, "--port", str(port)]
        return [*spec.args, *loopback, *kv_cache_args(spec), *dtype_override()]
    args = [
        "--model", str(spec.model_dir),
        "--served-model-name", spec.served_model_name,
        "--host", host,
        "--port", str(port),
        "--load-format", "dummy",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
        "--seed", "0",
    ]  # fmt: skip
    if spec.max_model_len:
        args += ["--max-model-len", str(spec.max_model_len)]
    if spec.enforce_eager:
        args.append("--enforce-eager")
    if spec.runner:
        args += ["--runner", spec.runner]
    if spec.convert:
        args += ["--convert", spec.convert]
    if spec.enable_lora and not spec.runner:
        args += [
            "--enable-lora",
            "--max-loras",
            str(spec.max_loras),
            "--max-lora-rank",
            str(spec.max_lora_rank),
        ]
    if kv_events_port is not None:
        bind = kv_events_bind_host(host) if kv_events_at_host else "*"
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://{bind}:{kv_events_port}",
        }
        if kv_replay_port is not None:
            config["replay_endpoint"] = f"tcp://{bind}:{kv_replay_port}"
        if kv_events_at_host:
            config["topic"] = f"kv@{host}@{spec.served_model_name}"
        args += ["--kv-events-config", json.dumps(config)]
    return [*args, *kv_cache_args(spec), *spec.extra_args, *dtype_override()]


def kv_cache_args(spec: EngineSpec) -> list[str]:
    """``--kv-cache-memory-bytes`` for the spec's size, unless its own arguments already set one.

    The flag, not ``VLLM_CPU_KVCACHE_SPACE``: that variable counts whole GiB only (vLLM 0.32's CPU
    platform reads it with ``int()``), and when set it overrides the flag; :func:`engine_env` leaves
    it out unless the spec's own environment names it (a rendered chart that sets it wins)."""
    if spec.args is not None and any(str(a).startswith("--kv-cache-memory-bytes") for a in spec.args):
        return []
    return ["--kv-cache-memory-bytes", str(spec.kv_cache_mib * 1024 * 1024)]


def engine_env(spec: EngineSpec, cpu: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
        PYTHONHASHSEED="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        LMCACHE_TRACK_USAGE="false",
        PYTHONUNBUFFERED="1",
    )
    if cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
    # The engine runs in its own environment; the caller's virtualenv must not leak into it.
    for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(key, None)
    env.update(spec.env)
    return env


def _probe(url: str, timeout: float = 2.0, ca_file: str | None = None) -> bool:
    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class EngineGroup:
    """Engines started together and stopped together (also at interpreter exit)."""

    def __init__(self, engines: Iterable[Engine] = ()) -> None:
        self.engines: list[Engine] = list(engines)
        self._lock = threading.Lock()
        atexit.register(self.stop)

    def __iter__(self):
        return iter(self.engines)

    def __len__(self) -> int:
        return len(self.engines)

    def __getitem__(self, index: int) -> Engine:
        return self.engines[index]

    def __enter__(self) -> EngineGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    def add(self, engine: Engine) -> None:
        with self._lock:
            self.engines.append(engine)

    def stop(self) -> None:
        """Stop every engine in parallel (each may take seconds to shut down)."""
        threads = [threading.Thread(target=engine.stop) for engine in self.engines]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


def launch(
    spec: EngineSpec,
    *,
    name: str,
    cpu: int | None,
    log_dir: Path,
    port: int | None = None,
    host: str = "127.0.0.1",
    ca_file: str | None = None,
    kv_events_port: int | None = None,
) -> Engine:
    """Start one engine process (does not wait for readiness); ``port``: e.g. the port of an engine
    that was stopped, to restart it at the same address; ``host``: a loopback address to listen on
    (a test cluster Pod's IP; the ports picked here are free on 127.0.0.1, so give ``port`` with it);
    ``ca_file``: the engine serves https (``--ssl-certfile`` among ``spec.extra_args``) with a
    certificate this CA signed, which its readiness probe verifies.
    ``kv_events_port``: publish KV events on that port of ``host`` (see :func:`server_args`), the same
    port for every Pod as llm-d's router expects, instead of a free port on every interface."""
    port = free_port() if port is None else port
    publishes = spec.kv_events and spec.args is None and not spec.runner
    kv_port = (kv_events_port or free_port()) if publishes else None
    replay_port = free_port() if kv_port is not None and spec.kv_replay else None
    command = [
        str(engine_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        *server_args(spec, port, kv_port, replay_port, host, kv_events_at_host=kv_events_port is not None),
    ]
    if cpu is not None:
        command = ["taskset", "-c", str(cpu), *command]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    process = spawn_logged(command, log_path, engine_env(spec, cpu))
    return Engine(
        name, port, kv_port, spec.served_model_name, process, log_path, cpu, replay_port, host, ca_file
    )


def wait_ready(engines: Sequence[Engine], timeout: float = DEFAULT_READY_TIMEOUT) -> None:
    """Block until every engine answers `/health`; raise EngineStartError with the log tail otherwise.

    vLLM's server listens only once the engine is initialised, and `/health` needs no API key, so this
    also works for engines started with `VLLM_API_KEY`.
    """
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        for engine in list(pending):
            if not engine.is_running():
                raise EngineStartError(
                    f"engine {engine.name} exited with code {engine.process.returncode} while starting; "
                    f"log {engine.log_path}:\n{engine.log_tail()}"
                )
            if engine.is_ready():
                pending.remove(engine)
        if pending and time.monotonic() > deadline:
            engine = pending[0]
            raise EngineStartError(
                f"engine {engine.name} not ready after {timeout:.0f} s; log {engine.log_path}:\n{engine.log_tail()}"
            )
        if pending:
            time.sleep(0.5)


def default_cpus(count: int) -> list[int | None]:
    """Spread engines over the cores this process may use (one core each, round-robin)."""
    cores = sorted(os.sched_getaffinity(0))
    return [cores[i % len(cores)] for i in range(count)]


def start_engines(
    count: int,
    model_dir: Path | str | None = None,
    served_model_name: str = "tiny-llama",
    *,
    spec: EngineSpec | None = None,
    log_dir: Path | str | None = None,
    ready_timeout: float = DEFAULT_READY_TIMEOUT,
    cpus: Sequence[int | None] | None = None,
    name_prefix: str = "engine",
    **spec_fields: object,
) -> EngineGroup:
    """Start `count` engines in parallel and wait until all serve; stop them all if any fails.

    Either pass `spec`, or `model_dir` plus any EngineSpec field as a keyword (e.g. `kv_cache_mib=1024`,
    `extra_args=[...]`, `runner="pooling"`).
    """
    if spec is None:
        if model_dir is None:
            raise ValueError("start_engines needs model_dir or spec")
        spec = EngineSpec(model_dir=model_dir, served_model_name=served_model_name, **spec_fields)  # type: ignore[arg-type]
    log_path = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="vllm-stack-engines-"))
    cpu_list = list(cpus) if cpus is not None else default_cpus(count)
    group = EngineGroup()
    try:
        for index in range(count):
            group.add(launch(spec, name=f"{name_prefix}-{index}", cpu=cpu_list[index], log_dir=log_path))
        wait_ready(group.engines, ready_timeout)
    except BaseException:
        group.stop()
        raise
    return group
