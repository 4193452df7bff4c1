"""Router benchmark: direct to a stub engine versus through the router, side by side in one run.

The measured process (router, one of the two floors or the reference router) runs pinned to core 0
(``taskset``); the stub engine and this load generator share core 1. Rows:
- direct: the load sent straight to the stub;
- uvicorn floor (no upstream): ``floor_app.py``, a raw ASGI app on uvicorn answering the stream from
  memory: what the HTTP server alone costs a router built on uvicorn;
- python relay floor: ``floor_relay.py``, the smallest Python reverse proxy for this request on
  asyncio protocols: what any Python router on this event loop must at least spend;
- router (<parser>): the router, once per JSON parser in ``--configs``;
- vllm-project/router (Rust, reference): the Rust router from PyPI (``vllm-router==0.1.17``, installed
  on demand into ``.cache/bench/vllm-router``; skipped with ``--no-reference`` or, with the reason in
  the report, when it cannot be installed), in front of the same stub, measured the same way.
  production-stack's Python router is not measured: it is not on PyPI (every published
  ``vllm-router`` there is the Rust router).
Figures per row:
- CPU microseconds per request of the measured process over the c=16 run, from ``/proc/<pid>/stat``,
  in all and split into user (utime) and system (stime) time;
- added median and p99 latency at concurrency 1 and 16 (row minus direct);
- requests/s at concurrency 16 with the measured process on one core.
Request: a streamed chat completion of 8 tokens. Stub: ``--stub fast`` (``fast_stub.py``, default, so
the router is the bottleneck) or ``--stub asgi`` (``tests/fakes/stub_engine.py`` on uvicorn).

Second scenario, "tokens N ms apart" (``--token-gap-ms N``, default 2; 0 skips it): the fast stub
sends its 8 events back to back, so a proxy reads several together and its per-token cost is
understated; here a stub of its own (``fast_stub.py --token-gap-ms N``) spaces them N ms apart as an
engine does, and the python relay floor and the router (msgspec) are measured behind it at c=1 and
c=16: CPU per request (exact, from schedstat) and reads / writes per request at both, latencies.
Fewer requests (each lasts at least 8 x N ms): 200 at c=1 and 1,500 at c=16 (``--quick``: 100, 800).

Also recorded: a microbenchmark of the routing-field parsing and the router's handling cost with the
network taken out (``handler_cost.py``).
Results: benchmarks/results/router.json and .md (``--out``).

Usage: ``make bench`` or ``.venv/bin/python benchmarks/router/run.py [--quick] [--repeat N]
[--token-gap-ms N] [--no-reference] [--out PATH]``
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "router"))
from loadgen import build_request, run_load  # noqa: E402

PY = sys.executable
BODY = json.dumps(
    {
        "model": "stub-model",
        "messages": [{"role": "user", "content": "Hello! Please write a short poem about routers."}],
        "max_tokens": 8,
        "stream": True,
    }
).encode()
CLK_TCK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen[bytes], port: int, path: str | None, timeout: float = 30.0) -> None:
    """Wait until ``proc`` answers 200 on ``path`` (or, without a path, accepts connections on ``port``).

    Fails with the tail of the process's log if it exits or is not ready in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{log_tail(proc)}")
        try:
            if path is None:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    return
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{proc.args} not ready on port {port} in {timeout:.0f} s:\n{log_tail(proc)}")


STUBS = {
    "fast": ("benchmarks/router/fast_stub.py", "fast_stub.py: asyncio protocols + httptools on uvloop"),
    "asgi": ("tests/fakes/stub_engine.py", "tests/fakes/stub_engine.py: ASGI app on uvicorn"),
}


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of ``pid`` (fields 14 and 15 of ``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def io_calls(pid: int) -> tuple[int, int]:
    """Read-family and write-family system calls of ``pid`` so far (syscr, syscw of ``/proc/<pid>/io``)."""
    fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    return int(fields["syscr"]), int(fields["syscw"])


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def task_cpu_ns(pid: int) -> int:
    """CPU nanoseconds of all of ``pid``'s threads (first field of each ``/proc/<pid>/task/*/schedstat``).

    Exact, unlike the clock ticks of ``/proc/<pid>/stat``, so short runs (a few hundred requests)
    can be measured per request; it has no user/system split."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            pass
    return total


def measure(
    port: int,
    n1: int,
    n16: int,
    pid: int | None,
    stub_pid: int,
    repeat: int,
    warmup: int = 1000,
    cpu_c1: bool = False,
) -> dict[str, float]:
    """Warm up, then ``repeat`` rounds of c=1 and c=16; each figure is the median over the rounds.

    ``pid`` is the measured process (None for the direct row); the stub's CPU is recorded as well.
    With ``cpu_c1`` (and a ``pid``), the measured process's CPU and system calls are recorded over the
    c=1 run too, and both runs' CPU totals also from schedstat (``c1_`` / ``c16_cpu_us_exact``)."""
    req = build_request("127.0.0.1", port, "/v1/chat/completions", BODY)
    detail = cpu_c1 and pid is not None

    async def one_round() -> dict[str, float]:
        if detail:
            ns0, (r0, w0) = task_cpu_ns(pid), io_calls(pid)  # type: ignore[arg-type]
        lat1, _, e1 = await run_load("127.0.0.1", port, req, 1, n1)
        if detail:
            ns1, (r1, w1) = task_cpu_ns(pid), io_calls(pid)  # type: ignore[arg-type]
        user0, sys0 = cpu_times(pid) if pid else (0.0, 0.0)
        reads0, writes0 = io_calls(pid) if pid else (0, 0)
        stub0 = sum(cpu_times(stub_pid))
        ns_c16 = task_cpu_ns(pid) if detail else 0  # type: ignore[arg-type]
        lat16, wall16, e16 = await run_load("127.0.0.1", port, req, 16, n16)
        user1, sys1 = cpu_times(pid) if pid else (0.0, 0.0)
        reads1, writes1 = io_calls(pid) if pid else (0, 0)
        stub1 = sum(cpu_times(stub_pid))
        out = {
            "c1_p50_ms": statistics.median(lat1) * 1e3,
            "c1_p99_ms": pct(lat1, 0.99) * 1e3,
            "c16_p50_ms": statistics.median(lat16) * 1e3,
            "c16_p99_ms": pct(lat16, 0.99) * 1e3,
            "c16_rps": n16 / wall16,
            "errors": e1 + e16,
            "stub_cpu_us_per_request": (stub1 - stub0) / n16 * 1e6,
        }
        if pid:
            user, system = user1 - user0, sys1 - sys0
            out["cpu_us_per_request"] = (user + system) / n16 * 1e6
            out["user_us_per_request"] = user / n16 * 1e6
            out["sys_us_per_request"] = system / n16 * 1e6
            out["cpu_utilisation_c16"] = (user + system) / wall16
            out["reads_per_request"] = (reads1 - reads0) / n16
            out["writes_per_request"] = (writes1 - writes0) / n16
        if detail:
            out["c1_cpu_us_exact"] = (ns1 - ns0) / n1 / 1e3
            out["c1_reads_per_request"] = (r1 - r0) / n1
            out["c1_writes_per_request"] = (w1 - w0) / n1
            out["c16_cpu_us_exact"] = (task_cpu_ns(pid) - ns_c16) / n16 / 1e3  # type: ignore[arg-type]
        return out

    async def go() -> dict[str, float]:
        await run_load("127.0.0.1", port, req, 16, warmup)  # warm-up
        rounds = [await one_round() for _ in range(repeat)]
        return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}

    return asyncio.run(go())


def in_process_costs() -> dict[str, dict[str, float]]:
    """The router's own handling per request with the network taken out (see handler_cost.py).

    Per JSON parser: microseconds per request with the engine's answer in one read and in one read
    per token (``handler_cost.MODES``), each in a fresh interpreter pinned to core 0."""
    out = {}
    for parser in ("msgspec", "orjson"):
        proc = subprocess.run(
            [
                "taskset",
                "-c",
                "0",
                PY,
                "-c",
                "import json, handler_cost, run; "
                f"print(json.dumps(handler_cost.handler_costs(run.BODY, {parser!r})))",
            ],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
        out[parser] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def parser_microbench() -> dict[str, dict[str, float]]:
    """Microseconds per routing-field parse, msgspec vs orjson, on a small and an 8 KiB chat body."""
    import timeit

    from vllm_stack.api.parsing import MsgspecParser, OrjsonParser

    big = json.dumps(
        {
            "model": "stub-model",
            "messages": [{"role": "system", "content": "You are helpful. " * 100}]
            + [{"role": "user", "content": f"question {i} " * 20} for i in range(20)],
            "max_tokens": 8,
            "stream": True,
        }
    ).encode()
    out: dict[str, dict[str, float]] = {}
    for parser in (MsgspecParser(), OrjsonParser()):
        row = {}
        for label, body in (("small_body", BODY), (f"{len(big) // 1024}KiB_body", big)):
            n = 20000
            row[label] = min(timeit.repeat(lambda b=body, p=parser: p.parse(b), number=n, repeat=3)) / n * 1e6
        out[parser.name] = row
    return out


_logs: dict[int, Path] = {}


@functools.cache
def log_dir() -> Path:
    """Where the started processes' output goes; made on first use, removed after a successful run."""
    return Path(tempfile.mkdtemp(prefix="router-bench-"))


def start(cmd: list[str], core: int, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` pinned to ``core``; its output goes to a log under log_dir() (shown if it fails)."""
    log = log_dir() / f"process-{len(_logs)}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["taskset", "-c", str(core), *cmd],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    _logs[proc.pid] = log
    return proc


def log_tail(proc: subprocess.Popen[bytes], lines: int = 20) -> str:
    return "\n".join(_logs[proc.pid].read_text(errors="replace").splitlines()[-lines:])


def stop(proc: subprocess.Popen[bytes], procs: list[subprocess.Popen[bytes]]) -> None:
    proc.terminate()
    proc.wait(10)
    procs.remove(proc)


def added(res: dict[str, float], direct: dict[str, float]) -> None:
    """What a proxying row adds to the direct figures."""
    for key in ("c1_p50_ms", "c1_p99_ms", "c16_p50_ms", "c16_p99_ms"):
        res[f"added_{key}"] = res[key] - direct[key]
    res["c16_p99_over_p50"] = res["c16_p99_ms"] / res["c16_p50_ms"]


def start_relay(stub_port: int, procs: list[subprocess.Popen[bytes]]) -> tuple[subprocess.Popen[bytes], int]:
    """floor_relay.py on core 0 in front of the stub; (process, port) once it answers."""
    port = free_port()
    relay = start([PY, "benchmarks/router/floor_relay.py", str(port), str(stub_port)], 0)
    procs.append(relay)
    wait_ready(relay, port, "/health")
    return relay, port


def start_router(
    stub_port: int, parser: str, procs: list[subprocess.Popen[bytes]]
) -> tuple[subprocess.Popen[bytes], int]:
    """The router on core 0 in front of the stub, with JSON parser ``parser``; (process, port) once ready."""
    port = free_port()
    router = start(
        [
            PY,
            "-m",
            "vllm_stack.router_cli",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--static-backends",
            f"http://127.0.0.1:{stub_port}",
            "--routing-logic",
            "roundrobin",
            "--json-parser",
            parser,
            "--log-level",
            "warning",
        ],
        0,
        {"PYTHONPATH": str(ROOT / "router")},
    )
    procs.append(router)
    wait_ready(router, port, "/ready")
    return router, port


REFERENCE_PACKAGE = "vllm-router==0.1.17"
REFERENCE_VENV = ROOT / ".cache" / "bench" / "vllm-router"
RUST_REFERENCE = "vllm-project/router (Rust, reference)"
NOT_ON_PYPI = (
    "not on PyPI: production-stack's router is named vllm-router in its repository, but every "
    "vllm-router published on PyPI (0.1.9 to 0.1.17) is the Rust vllm-project/router"
)


def install_reference() -> Path:
    """The Rust router's ``vllm-router`` entry point, installed on first use into REFERENCE_VENV.

    A venv of its own made with uv, the version pinned (REFERENCE_PACKAGE); an install already there
    is reused without asking the index. Raises CalledProcessError (uv's message) if it cannot install."""
    uv = ROOT / ".venv" / "bin" / "uv"
    name, version = REFERENCE_PACKAGE.split("==")
    exe = REFERENCE_VENV / "bin" / "vllm-router"
    installed = list(
        REFERENCE_VENV.glob(f"lib/python*/site-packages/{name.replace('-', '_')}-{version}.dist-info")
    )
    if exe.exists() and installed:
        return exe
    if not (REFERENCE_VENV / "bin" / "python").exists():
        subprocess.run(
            [str(uv), "venv", "-q", "--python", PY, str(REFERENCE_VENV)],
            capture_output=True,
            text=True,
            check=True,
        )
    subprocess.run(
        [
            str(uv),
            "pip",
            "install",
            "-q",
            "--python",
            str(REFERENCE_VENV / "bin" / "python"),
            REFERENCE_PACKAGE,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return exe


def start_rust_reference(
    stub_port: int, procs: list[subprocess.Popen[bytes]]
) -> tuple[subprocess.Popen[bytes], int]:
    """The Rust vllm-project/router on core 0 in front of the stub, round robin; (process, port) once ready.

    Its launcher is a Python script that hands over to the Rust server (tokio threads in the same
    process, so /proc/<pid>/stat counts them all). It checks the worker's /health before it serves;
    /readiness answers 200 once the worker is healthy. Its Prometheus exporter (on by default) gets a
    free port of its own."""
    exe = install_reference()
    port = free_port()
    router = start(
        [
            str(exe),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            f"http://127.0.0.1:{stub_port}",
            "--policy",
            "round_robin",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warning",
        ],
        0,
    )
    procs.append(router)
    wait_ready(router, port, "/readiness", timeout=60.0)
    return router, port


def end_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Stop what is still running; a process that died during the run has its log tail shown."""
    for p in procs:
        if p.poll() is not None:  # died during the run
            print(f"{p.args} exited with {p.returncode}:\n{log_tail(p)}", file=sys.stderr)
        p.terminate()
        p.wait(10)


def spaced_scenario(gap_ms: float, n1: int, n16: int, repeat: int) -> dict:
    """The relay floor and the router (msgspec) behind the fast stub with its token events ``gap_ms`` apart.

    Its own stub process (whatever ``--stub`` the main scenario used); CPU and system calls per request at both concurrencies, CPU totals from
    schedstat (exact on a few hundred requests), the user/system split at c=16 from /proc/<pid>/stat."""
    procs: list[subprocess.Popen[bytes]] = []
    results: dict[str, dict[str, float]] = {}
    try:
        stub_port = free_port()
        cmd = [
            PY,
            STUBS["fast"][0],
            "--port",
            str(stub_port),
            "--tokens",
            "8",
            "--token-gap-ms",
            f"{gap_ms:g}",
        ]
        stub_proc = start(cmd, 1)
        procs.append(stub_proc)
        wait_ready(stub_proc, stub_port, "/health")
        warmup = 320  # 20 streams per connection: a few tenths of a second
        relay, relay_port = start_relay(stub_port, procs)
        results["python relay floor"] = measure(
            relay_port, n1, n16, relay.pid, stub_proc.pid, repeat, warmup=warmup, cpu_c1=True
        )
        print(f"tokens {gap_ms:g} ms apart: relay floor", results["python relay floor"], flush=True)
        stop(relay, procs)
        router, router_port = start_router(stub_port, "msgspec", procs)
        results["router (msgspec)"] = measure(
            router_port, n1, n16, router.pid, stub_proc.pid, repeat, warmup=warmup, cpu_c1=True
        )
        print(f"tokens {gap_ms:g} ms apart: router (msgspec)", results["router (msgspec)"], flush=True)
        stop(router, procs)
    finally:
        end_all(procs)
    return {"token_gap_ms": gap_ms, "requests": {"c1": n1, "c16": n16}, "results": results}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    ap.add_argument("--stub", choices=tuple(STUBS), default="fast", help="stub engine (default fast)")
    ap.add_argument("--configs", default="msgspec,orjson", help="router JSON parsers, comma-separated")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per configuration (medians reported)")
    ap.add_argument(
        "--token-gap-ms",
        type=float,
        default=2.0,
        help="second scenario: the fast stub's token events this many ms apart (relay floor and router "
        "msgspec only; 0: skipped; whole ms, uvloop's timer resolution)",
    )
    ap.add_argument(
        "--no-reference",
        action="store_true",
        help=f"skip the Rust vllm-project/router reference row ({REFERENCE_PACKAGE}, installed on first use)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router"))
    args = ap.parse_args()
    if args.token_gap_ms < 0:
        ap.error("--token-gap-ms must be 0 or more")
    n1, n16 = (300, 2000) if args.quick else (1000, 6000)
    spaced_n1, spaced_n16 = (100, 800) if args.quick else (200, 1500)
    os.sched_setaffinity(0, {1})
    load_at_start = list(os.getloadavg())

    references: dict[str, dict[str, str]] = {
        RUST_REFERENCE: {"package": REFERENCE_PACKAGE},
        "production-stack router (reference)": {"package": "-", "skipped": NOT_ON_PYPI},
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        stub_port = free_port()
        stub = start([PY, STUBS[args.stub][0], "--port", str(stub_port), "--tokens", "8"], 1)
        procs.append(stub)
        wait_ready(stub, stub_port, "/health")
        direct = measure(stub_port, n1, n16, None, stub.pid, args.repeat)
        results: dict[str, dict[str, float]] = {"direct": direct}
        print("direct", direct, flush=True)

        floor_port = free_port()
        floor = start([PY, "benchmarks/router/floor_app.py", str(floor_port)], 0)
        procs.append(floor)
        wait_ready(floor, floor_port, None)
        results["uvicorn floor (no upstream)"] = measure(
            floor_port, n1, n16, floor.pid, stub.pid, args.repeat
        )
        print("uvicorn floor", results["uvicorn floor (no upstream)"], flush=True)
        stop(floor, procs)

        relay, relay_port = start_relay(stub_port, procs)
        res = measure(relay_port, n1, n16, relay.pid, stub.pid, args.repeat)
        added(res, direct)
        results["python relay floor"] = res
        print("relay floor", res, flush=True)
        stop(relay, procs)

        for parser in args.configs.split(","):
            router, port = start_router(stub_port, parser, procs)
            res = measure(port, n1, n16, router.pid, stub.pid, args.repeat)
            added(res, direct)
            results[f"router ({parser})"] = res
            print(parser, res, flush=True)
            stop(router, procs)

        if args.no_reference:
            references[RUST_REFERENCE]["skipped"] = "--no-reference"
        else:

            def rust_reference() -> dict[str, float]:
                ref, ref_port = start_rust_reference(stub_port, procs)
                res = measure(ref_port, n1, n16, ref.pid, stub.pid, args.repeat)
                stop(ref, procs)
                return res

            res = optional(rust_reference)
            if "error" in res:
                references[RUST_REFERENCE]["skipped"] = str(res["error"])
            else:
                added(res, direct)
                results[RUST_REFERENCE] = res
                print("rust reference", res, flush=True)
    finally:
        end_all(procs)

    spaced: dict | None = None
    if args.token_gap_ms > 0:

        def tokens_spaced() -> dict:
            return spaced_scenario(args.token_gap_ms, spaced_n1, spaced_n16, args.repeat)

        spaced = optional(tokens_spaced)
    shutil.rmtree(log_dir())

    report = {
        "request": "POST /v1/chat/completions, stream=true, 8 tokens (stub engine)",
        "setup": "measured process (router, floor or reference router) pinned to core 0; "
        "stub engine + load generator on core 1",
        "stub": {"name": args.stub, "description": STUBS[args.stub][1]},
        "host": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_at_start": load_at_start,
            "loadavg_at_end": list(os.getloadavg()),
        },
        "requests": {"c1": n1, "c16": n16},
        "repeat": args.repeat,
        "targets": {"cpu_us_per_request": 150, "added_c1_p50_ms": 0.2, "c16_p99_over_p50": 2.0},
        "reference": FACTS_REFERENCE,
        "reference_routers": references,
        "results": results,
        "tokens_spaced": spaced,
        "json_parser_us_per_parse": optional(parser_microbench),
        "router_handler_us_in_process": optional(in_process_costs),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    md = render_markdown(report)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 1 if spaced is not None and "error" in spaced else 0


def optional(fn: Callable[[], T]) -> T | dict[str, str]:
    """The side measurements use router internals that may change; a failure is reported, not fatal."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the report instead
        detail = str(exc)
        if isinstance(exc, subprocess.CalledProcessError) and exc.stderr:
            detail = exc.stderr.strip().splitlines()[-1]
        print(f"{fn.__name__} failed: {detail}", file=sys.stderr, flush=True)
        return {"error": f"{type(exc).__name__}: {detail}"}


FACTS_REFERENCE = {
    "production-stack router": {"cpu_us_per_request": "380-415", "added_c1_p50_ms": 0.41},
    "vllm-project/router (Rust)": {"cpu_us_per_request": "105-110", "added_c1_p50_ms": 0.17},
}


def _num(r: dict[str, float], key: str, fmt: str) -> str:
    return format(r[key], fmt) if key in r else "-"


def render_markdown(report: dict) -> str:
    rows = [
        "| target | CPU us/req (c=16) | user us/req | sys us/req | reads / writes per req | c=1 p50 ms | "
        "added c=1 p50 ms | c=16 p50 ms | c=16 p99 ms | added c=16 p50 / p99 ms | p99/p50 c=16 | req/s c=16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        calls = (
            f"{'-' if name == RUST_REFERENCE else format(r['reads_per_request'], '.1f')} / "
            f"{r['writes_per_request']:.1f}"
            if "reads_per_request" in r
            else "-"
        )
        added16 = (
            f"{r['added_c16_p50_ms']:.2f} / {r['added_c16_p99_ms']:.2f}" if "added_c16_p50_ms" in r else "-"
        )
        rows.append(
            f"| {name} | {_num(r, 'cpu_us_per_request', '.0f')} | {_num(r, 'user_us_per_request', '.0f')} | "
            f"{_num(r, 'sys_us_per_request', '.0f')} | {calls} | {r['c1_p50_ms']:.3f} | "
            f"{_num(r, 'added_c1_p50_ms', '+.3f')} | {r['c16_p50_ms']:.2f} | {r['c16_p99_ms']:.2f} | "
            f"{added16} | {r['c16_p99_ms'] / r['c16_p50_ms']:.2f} | {r['c16_rps']:.0f} |"
        )
    parsers = report["json_parser_us_per_parse"]
    if "error" in parsers:
        parser_text = f"not measured ({parsers['error']})"
    else:
        cols = list(next(iter(parsers.values())))
        prow = ["| parser | " + " | ".join(f"{c} us" for c in cols) + " |", "|---|" + "---|" * len(cols)]
        prow += [
            f"| {name} | " + " | ".join(f"{v[c]:.2f}" for c in cols) + " |" for name, v in parsers.items()
        ]
        parser_text = "\n\n" + "\n".join(prow)
    handler = report["router_handler_us_in_process"]
    if "error" in handler:
        handler_text = f"not measured ({handler['error']})"
    else:
        handler_text = "; ".join(
            f"{k} {v['one_read']:.0f} us/request with the engine's answer in one read, "
            f"{v['per_token_reads']:.0f} with one read per token"
            for k, v in handler.items()
        )
    stub_us = report["results"]["direct"]["stub_cpu_us_per_request"]
    return (
        "# Router benchmark\n\n"
        f"{report['request']}; {report['setup']}; {report['requests']['c1']} requests at c=1, "
        f"{report['requests']['c16']} at c=16, medians of {report['repeat']} rounds. "
        f"Stub engine: {report['stub']['name']} ({report['stub']['description']}), "
        f"{stub_us:.0f} us CPU per request in the direct run. "
        f"Machine load average (1/5/15 min) at start {report['host']['loadavg_at_start']}, "
        f"at end {report['host']['loadavg_at_end']} on {report['host']['cpus']} cores: other work shares "
        "both cores, so latencies here include waiting for the CPU.\n\n" + "\n".join(rows) + "\n\n"
        "CPU columns: the measured process's utime + stime from /proc/<pid>/stat over the c=16 run, per "
        "request, and the two parts (user: Python and C code; sys: the kernel, mostly socket system calls; "
        "the split is the kernel's tick-sampled estimate, so read it as a rough share). Reads / writes: "
        "the measured process's read- and write-family system calls per request (/proc/<pid>/io), which "
        "depend on how the stub's per-token writes reach it: events that arrive together are read "
        "together, so a stub that sends its tokens back to back gives fewer than a real engine would. "
        "The uvicorn floor row is a raw ASGI app on the same server answering the same stream from memory "
        "(no upstream): the part of a uvicorn-based router's cost that is the server itself. "
        "The python relay floor row is the smallest Python reverse proxy for this request on asyncio "
        "protocols (floor_relay.py: httptools parsing, pooled keep-alive upstream connections, chunk "
        "framing re-emitted, nothing else): what any Python router on this event loop must at least "
        "spend.\n\n"
        + render_spaced(report.get("tokens_spaced"), report["repeat"])
        + f"Routing-field parsing alone (microbenchmark): {parser_text}\n\n"
        "The router's own handling with the network taken out (handler_cost.py: the router's HTTP "
        "connection, hot-path handler and relay driven in-process, fake transports, the stub's answer "
        f"fed to a pooled upstream connection): {handler_text}.\n\n"
        "Targets: <= 150 us/request, <= 0.2 ms added median at c=1, p99 < 2 x p50 at c=16. "
        "Reference (FACTS.md, measured on a different stub): production-stack 380-415 us/req, +0.41 ms; "
        "Rust vllm-router 105-110 us/req, +0.17 ms. " + render_references(report) + "\n"
    )


def render_references(report: dict) -> str:
    """What the reference rows are, and why any of them is missing (first line of the reason)."""
    parts = []
    for name, ref in report.get("reference_routers", {}).items():
        if "skipped" in ref:
            reason = (ref["skipped"].strip().splitlines() or ["?"])[0]
            parts.append(f"{name}: not measured ({reason}).")
            continue
        text = (
            f"{name}: {ref['package']} from PyPI, in front of the same stub, pinned to core 0 like the "
            "router rows (CPU of all its threads; its reads are not shown: it reads sockets with recv(2), "
            "which /proc/<pid>/io does not count, while its writev(2) calls are counted)"
        )
        errors = report["results"].get(name, {}).get("errors", 0)
        parts.append(text + (f"; {errors:.0f} requests failed." if errors else ", no request failed."))
    if not parts:
        return ""
    return (
        "The reference rows in the table above were measured in this run, on this stub, so they compare "
        "with the router rows directly (FACTS.md's figures do not, figure for figure). " + " ".join(parts)
    )


def render_spaced(spaced: dict | None, repeat: int) -> str:
    """The "tokens N ms apart" section: its own table, or why it is missing."""
    if spaced is None:
        return ""
    if "error" in spaced:
        return f"## Tokens spaced apart\n\nNot measured ({spaced['error']}).\n\n"
    gap = spaced["token_gap_ms"]
    rows = [
        "| target | CPU us/req c=16 | user / sys us/req c=16 | reads / writes per req c=16 | "
        "CPU us/req c=1 | reads / writes per req c=1 | c=1 p50 ms | c=16 p50 ms | c=16 p99 ms | "
        "p99/p50 c=16 | req/s c=16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in spaced["results"].items():
        rows.append(
            f"| {name} | {r['c16_cpu_us_exact']:.0f} | {r['user_us_per_request']:.0f} / "
            f"{r['sys_us_per_request']:.0f} | {r['reads_per_request']:.1f} / {r['writes_per_request']:.1f} | "
            f"{r['c1_cpu_us_exact']:.0f} | {r['c1_reads_per_request']:.1f} / {r['c1_writes_per_request']:.1f} | "
            f"{r['c1_p50_ms']:.2f} | {r['c16_p50_ms']:.2f} | {r['c16_p99_ms']:.2f} | "
            f"{r['c16_p99_ms'] / r['c16_p50_ms']:.2f} | {r['c16_rps']:.0f} |"
        )
    results = spaced["results"]
    gap_text = ""
    if "python relay floor" in results and "router (msgspec)" in results:
        floor, router = results["python relay floor"], results["router (msgspec)"]
        gap_text = (
            f" The router spends {router['c16_cpu_us_exact'] - floor['c16_cpu_us_exact']:+.0f} us per request "
            f"over the relay floor at c=16 and {router['c1_cpu_us_exact'] - floor['c1_cpu_us_exact']:+.0f} us "
            "at c=1."
        )
    return (
        f"## Tokens {gap:g} ms apart\n\n"
        f"The same request behind fast_stub.py --token-gap-ms {gap:g}: the head at once, then each token's "
        f"event {gap:g} ms after the previous write (uvloop timers: whole milliseconds, at least that long), "
        "as an engine generating tokens sends them, so a proxy reads and writes about once per token "
        f"instead of reading events together. {spaced['requests']['c1']} requests at c=1, "
        f"{spaced['requests']['c16']} at c=16, medians of {repeat} rounds; its own stub process. CPU: all "
        "threads' run time from /proc/<pid>/task/*/schedstat over each run (exact), the user/system split "
        "from /proc/<pid>/stat (rough share); reads / writes as above. Latencies are mostly the stub's "
        f"gaps (8 x {gap:g} ms at least).{gap_text}\n\n" + "\n".join(rows) + "\n\n"
    )


if __name__ == "__main__":
    sys.exit(main())
