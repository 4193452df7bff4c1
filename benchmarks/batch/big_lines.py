"""The router's event loop while a batch of large lines runs: ``/health`` latency and the router's memory.

Why: a batch line used to be read, parsed and re-encoded on the event loop each time it was picked, so one
large line stalled every other request of the router (``/health`` 5 s at 60 MB) and its memory grew with
it. Now a line is read and its body taken (raw, never re-encoded) on a worker thread, and only the request
path's own work (the routing fields, the JSON depth check) runs on the loop, as for any client request of
that size; a line larger than ``max_body_bytes`` fails validation.

Set-up: our router in its own process (``vllm-stack router`` with ``--batch-api``, ``roundrobin``, a fresh
batch directory, the default body limits: 32 MiB a request, 256 MiB held by all bodies together) over the
throughput stub engine (``benchmarks/router/fast_stub.py``, its own process: it answers at once, so the
router's own work is what is measured). A batch of ``--lines`` (150) chat lines of ``--line-mib`` (1 MiB)
each (a long user message) is uploaded (``POST /v1/files``), created and run to its end. From the
upload's start to the batch's end a probe sends ``GET /health`` every 20 ms on a connection of its own
and records each answer's latency, and the router's RSS is read from ``/proc`` every 100 ms.

Contenders: this checkout's router, and with ``--baseline DIR`` another checkout's (``git worktree add
/tmp/base REV``, then ``--baseline /tmp/base``), each on a fresh router and batch directory, in an order
rotated every round (``--rounds``, default 3); the table gives medians with the min-max over rounds.

Usage: ``python benchmarks/batch/big_lines.py [--lines 150] [--line-mib 1] [--baseline DIR] [--rounds 3]
[--out PATH]``. Prints a table and writes ``benchmarks/results/batch_big_lines.{md,json}`` (or
``PATH.{md,json}``).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.synchronize
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "router", ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import engine_bench  # noqa: E402  benchmarks/engine_bench.py
import httpx  # noqa: E402
import orjson  # noqa: E402
from vllm_stack_dev.testbed import engines as tb  # noqa: E402
from vllm_stack_dev.waiting import wait_http_ok  # noqa: E402

MODEL = "stub-model"
PROBE_EVERY = 0.02  # seconds between two /health probes
RSS_EVERY = 0.1  # seconds between two RSS samples
MIB = 1024 * 1024
BODY_BUDGET = 256 * MIB  # the router's default max_buffered_body_bytes


def batch_file(lines: int, line_bytes: int) -> bytes:
    out = []
    for n in range(lines):
        body = {"model": MODEL, "messages": [{"role": "user", "content": ""}], "max_tokens": 4}
        skeleton = orjson.dumps(
            {"custom_id": f"l{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
        pad = max(line_bytes - len(skeleton), 0)
        unit = b"%d " % n
        out.append(skeleton.replace(b'"content":""', b'"content":"' + unit * (pad // len(unit)) + b'"'))
    return b"\n".join(out) + b"\n"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def probe_health(url: str, stop: multiprocessing.synchronize.Event, out: multiprocessing.Queue) -> None:
    """(in a process of its own, so the upload's work in this one cannot delay a probe) ``GET /health``
    every :data:`PROBE_EVERY` seconds on one keep-alive connection until ``stop``; the latencies to ``out``."""
    latencies = []
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            started = time.perf_counter()
            client.get("/health").raise_for_status()
            latencies.append(time.perf_counter() - started)
            time.sleep(PROBE_EVERY)
    out.put(latencies)


async def sample_rss(pid: int, stop: asyncio.Event, samples: list[int]) -> None:
    while not stop.is_set():
        samples.append(rss_bytes(pid))
        await asyncio.sleep(RSS_EVERY)


async def run_batch(url: str, content: bytes) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        batch_id = await engine_bench.create_batch(client, content)
        while True:
            batch = (await client.get(f"/v1/batches/{batch_id}")).json()
            if batch["status"] in ("completed", "failed", "cancelled", "expired"):
                batch["seconds"] = time.perf_counter() - started
                return batch
            await asyncio.sleep(0.2)


async def measure(args: argparse.Namespace, router_path: str, log_dir: Path) -> dict:
    stub_port = tb.free_port()
    stub = tb.spawn_logged(
        [
            sys.executable,
            str(ROOT / "benchmarks/router/fast_stub.py"),
            "--port",
            str(stub_port),
            "--model",
            MODEL,
        ],
        log_dir / "stub.log",
        dict(os.environ),
    )
    router: subprocess.Popen[bytes] | None = None
    try:
        wait_http_ok(f"http://127.0.0.1:{stub_port}/health", 30, stub)
        env = dict(os.environ)
        if router_path:
            env["PYTHONPATH"] = f"{router_path}:{env.get('PYTHONPATH', '')}"
        config = {
            "static_backends": f"http://127.0.0.1:{stub_port}",
            "routing_logic": "roundrobin",
            "batch_api": True,
            "batch_dir": str(log_dir / "batch"),
            "engine_scrape_interval": 0.5,
            "health_check_interval": 0.5,
        }
        router, url = engine_bench.start_router(config, log_dir, "router", env)
        await asyncio.sleep(1.0)  # a scrape or two: the engine's figures known, so lines have room
        baseline_rss = rss_bytes(router.pid)
        content = batch_file(args.lines, int(args.line_mib * MIB))
        stop = asyncio.Event()
        rss: list[int] = []
        probe_stop = multiprocessing.Event()
        probe_out: multiprocessing.Queue = multiprocessing.Queue()
        prober = multiprocessing.Process(target=probe_health, args=(url, probe_stop, probe_out), daemon=True)
        prober.start()
        sampler = asyncio.create_task(sample_rss(router.pid, stop, rss))
        try:
            batch = await run_batch(url, content)
        finally:
            stop.set()
            probe_stop.set()
            await sampler
        latencies: list[float] = probe_out.get(timeout=60)
        prober.join(10)
    finally:
        engine_bench.stop_testbed(router, [])
        tb.stop_process(stub)
    ordered = sorted(latencies)
    return {
        "status": batch["status"],
        "completed": batch["request_counts"]["completed"],
        "batch_seconds": batch["seconds"],
        "health_probes": len(latencies),
        "health_p50_ms": statistics.median(ordered) * 1e3,
        "health_p99_ms": ordered[int(len(ordered) * 0.99) - 1] * 1e3,
        "health_max_ms": ordered[-1] * 1e3,
        "rss_baseline_mib": baseline_rss / MIB,
        "rss_peak_mib": max(rss) / MIB,
        "rss_growth_mib": (max(rss) - baseline_rss) / MIB,
    }


def summarize(runs: list[dict]) -> dict:
    """Medians and min-max over the rounds of one contender."""
    figures = {}
    for key in (
        "batch_seconds",
        "health_p50_ms",
        "health_p99_ms",
        "health_max_ms",
        "rss_peak_mib",
        "rss_growth_mib",
    ):
        values = [r[key] for r in runs]
        figures[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    figures["completed"] = [r["completed"] for r in runs]
    figures["status"] = sorted({r["status"] for r in runs})
    return figures


COLUMNS = ("router", "batch", "seconds", "/health p50 ms", "p99 ms", "max ms", "RSS peak MiB", "growth MiB")


def _cell(figure: dict, digits: int = 1) -> str:
    return f"{figure['median']:.{digits}f} ({figure['min']:.{digits}f}-{figure['max']:.{digits}f})"


def _rows(report: dict) -> list[list[str]]:
    rows = []
    for name, f in report["contenders"].items():
        done = f"{'/'.join(f['status'])} {min(f['completed'])}/{report['lines']}"
        rows.append(
            [
                name,
                done,
                _cell(f["batch_seconds"]),
                _cell(f["health_p50_ms"], 2),
                _cell(f["health_p99_ms"]),
                _cell(f["health_max_ms"]),
                _cell(f["rss_peak_mib"]),
                _cell(f["rss_growth_mib"]),
            ]
        )
    return rows


def render(report: dict) -> str:
    lines = [
        f"# A batch of {report['lines']} lines of {report['line_mib']} MiB: the router's /health and memory",
        "",
        f"{report['machine']}, {report['date']}; throughput stub engine; the router's default body budget "
        f"({report['body_budget_mib']} MiB); {report['rounds']} rotated rounds, medians (min-max). Goals: "
        "/health p99 within 100 ms, RSS growth within the budget plus 100 MB.",
        "",
        *engine_bench.markdown_table(COLUMNS, _rows(report)),
        "",
    ]
    return "\n".join(lines)


def print_table(report: dict) -> None:
    engine_bench.print_console_table(
        "batch of large lines",
        COLUMNS,
        _rows(report),
        left_columns=2,
        width=150,
        notes=[],
        fallback_markdown=render(report),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lines", type=int, default=150)
    parser.add_argument("--line-mib", type=float, default=1.0)
    parser.add_argument("--baseline", default="", help="another checkout (its router/ is run) to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/batch_big_lines"))
    args = parser.parse_args()
    contenders = {"this checkout": ""}
    if args.baseline:
        contenders[f"baseline {_revision(Path(args.baseline))}"] = str(Path(args.baseline) / "router")
    runs: dict[str, list[dict]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(args.rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            with tempfile.TemporaryDirectory(prefix="big-lines-") as tmp:
                runs[name].append(asyncio.run(measure(args, contenders[name], Path(tmp))))
            print(f"round {round_ + 1} {name}: {runs[name][-1]}")
    report = {
        "lines": args.lines,
        "line_mib": args.line_mib,
        "rounds": args.rounds,
        "body_budget_mib": BODY_BUDGET // MIB,
        "machine": engine_bench.machine_summary(),
        "date": time.strftime("%Y-%m-%d"),
        "revision": _revision(ROOT),
        "contenders": {name: summarize(r) for name, r in runs.items()},
        "runs": runs,
    }
    engine_bench.write_report(args.out, report, render, print_table)


def _revision(checkout: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "?"


if __name__ == "__main__":
    main()
