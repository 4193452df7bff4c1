"""Router benchmark: direct to a stub engine versus through the router, side by side in one run.

The router runs pinned to core 0 (``taskset``); the stub engine and this load generator share core 1.
Figures per configuration (upstream client x JSON parser):
- router CPU microseconds per request, from ``/proc/<pid>/stat`` utime+stime over the c=16 run;
- added median and p99 latency at concurrency 1 and 16 (router minus direct);
- requests/s at concurrency 16 with the router on one core.
Request: a streamed chat completion of 8 tokens. Results: benchmarks/results/router.json and .md.

Usage: ``make bench`` or ``.venv/bin/python benchmarks/router/run.py [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(url)


def wait_http_post(port: int, timeout: float = 30.0) -> None:
    """Wait until something accepts connections on ``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(port)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def measure(port: int, n1: int, n16: int, pid: int | None, repeat: int) -> dict[str, float]:
    """Warm up, then ``repeat`` rounds of c=1 and c=16; each figure is the median over the rounds."""
    req = build_request("127.0.0.1", port, "/v1/chat/completions", BODY)

    async def one_round() -> dict[str, float]:
        lat1, _, e1 = await run_load("127.0.0.1", port, req, 1, n1)
        cpu0 = cpu_seconds(pid) if pid else 0.0
        lat16, wall16, e16 = await run_load("127.0.0.1", port, req, 16, n16)
        cpu1 = cpu_seconds(pid) if pid else 0.0
        out = {
            "c1_p50_ms": statistics.median(lat1) * 1e3,
            "c1_p99_ms": pct(lat1, 0.99) * 1e3,
            "c16_p50_ms": statistics.median(lat16) * 1e3,
            "c16_p99_ms": pct(lat16, 0.99) * 1e3,
            "c16_rps": n16 / wall16,
            "errors": e1 + e16,
        }
        if pid:
            out["cpu_us_per_request"] = (cpu1 - cpu0) / n16 * 1e6
            out["cpu_utilisation_c16"] = (cpu1 - cpu0) / wall16
        return out

    async def go() -> dict[str, float]:
        await run_load("127.0.0.1", port, req, 16, 1000)  # warm-up
        rounds = [await one_round() for _ in range(repeat)]
        return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}

    return asyncio.run(go())


def in_process_costs() -> dict[str, float]:
    """The router's own handling per request with the network taken out (see handler_cost.py)."""
    out = {}
    for parser in ("msgspec", "orjson"):
        proc = subprocess.run(
            [
                "taskset",
                "-c",
                "0",
                PY,
                "-c",
                f"import handler_cost, run; print(handler_cost.handler_cost(run.BODY, {parser!r}))",
            ],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
        out[parser] = float(proc.stdout.strip().splitlines()[-1])
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


def start(cmd: list[str], core: int, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["taskset", "-c", str(core), *cmd],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer requests (smoke run)")
    ap.add_argument("--configs", default="raw:msgspec,raw:orjson,aiohttp:msgspec,httpx:msgspec")
    ap.add_argument("--repeat", type=int, default=3, help="rounds per configuration (medians reported)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router"))
    args = ap.parse_args()
    n1, n16 = (300, 2000) if args.quick else (1000, 6000)
    os.sched_setaffinity(0, {1})
    load_at_start = list(os.getloadavg())

    procs: list[subprocess.Popen[bytes]] = []
    try:
        stub_port = free_port()
        procs.append(start([PY, "tests/fakes/stub_engine.py", "--port", str(stub_port), "--tokens", "8"], 1))
        wait_http(f"http://127.0.0.1:{stub_port}/health")
        results: dict[str, dict[str, float]] = {"direct": measure(stub_port, n1, n16, None, args.repeat)}
        print("direct", results["direct"], flush=True)
        floor_port = free_port()
        floor = start([PY, "benchmarks/router/floor_app.py", str(floor_port)], 0)
        procs.append(floor)
        wait_http_post(floor_port)
        results["uvicorn floor (no upstream)"] = measure(floor_port, n1, n16, floor.pid, args.repeat)
        print("floor", results["uvicorn floor (no upstream)"], flush=True)
        floor.terminate()
        floor.wait(10)
        procs.remove(floor)
        for spec in args.configs.split(","):
            client, parser = spec.split(":")
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
                    "--upstream-client",
                    client,
                    "--json-parser",
                    parser,
                    "--log-level",
                    "warning",
                ],
                0,
                {"PYTHONPATH": str(ROOT / "router")},
            )
            procs.append(router)
            wait_http(f"http://127.0.0.1:{port}/ready")
            res = measure(port, n1, n16, router.pid, args.repeat)
            res["added_c1_p50_ms"] = res["c1_p50_ms"] - results["direct"]["c1_p50_ms"]
            res["added_c1_p99_ms"] = res["c1_p99_ms"] - results["direct"]["c1_p99_ms"]
            res["added_c16_p50_ms"] = res["c16_p50_ms"] - results["direct"]["c16_p50_ms"]
            res["added_c16_p99_ms"] = res["c16_p99_ms"] - results["direct"]["c16_p99_ms"]
            res["c16_p99_over_p50"] = res["c16_p99_ms"] / res["c16_p50_ms"]
            results[f"router[{client},{parser}]"] = res
            print(spec, res, flush=True)
            router.terminate()
            router.wait(10)
            procs.remove(router)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)

    report = {
        "request": "POST /v1/chat/completions, stream=true, 8 tokens (stub engine)",
        "setup": "router pinned to core 0; stub engine + load generator on core 1",
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
        "results": results,
        "json_parser_us_per_parse": parser_microbench(),
        "router_handler_us_in_process": in_process_costs(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    md = render_markdown(report)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0


FACTS_REFERENCE = {
    "production-stack router": {"cpu_us_per_request": "380-415", "added_c1_p50_ms": 0.41},
    "vllm-project/router (Rust)": {"cpu_us_per_request": "105-110", "added_c1_p50_ms": 0.17},
}


def render_markdown(report: dict) -> str:
    rows = [
        "| target | router CPU us/req (c=16) | c=1 p50 ms | added c=1 p50 ms | c=16 p50 ms | c=16 p99 ms | "
        "added c=16 p50 / p99 ms | p99/p50 c=16 | req/s c=16 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        rows.append(
            f"| {name} | {r.get('cpu_us_per_request', float('nan')):.0f} | {r['c1_p50_ms']:.3f} | "
            f"{r.get('added_c1_p50_ms', 0):.3f} | {r['c16_p50_ms']:.2f} | {r['c16_p99_ms']:.2f} | "
            f"{r.get('added_c16_p50_ms', 0):.2f} / {r.get('added_c16_p99_ms', 0):.2f} | "
            f"{r['c16_p99_ms'] / r['c16_p50_ms']:.2f} | {r['c16_rps']:.0f} |"
        )
    parsers = report["json_parser_us_per_parse"]
    cols = list(next(iter(parsers.values())))
    prow = ["| parser | " + " | ".join(f"{c} us" for c in cols) + " |", "|---|" + "---|" * len(cols)]
    prow += [f"| {name} | " + " | ".join(f"{v[c]:.2f}" for c in cols) + " |" for name, v in parsers.items()]
    return (
        "# Router benchmark\n\n"
        f"{report['request']}; {report['setup']}; {report['requests']['c1']} requests at c=1, "
        f"{report['requests']['c16']} at c=16, medians of {report['repeat']} rounds. "
        f"Machine load average (1/5/15 min) at start {report['host']['loadavg_at_start']}, "
        f"at end {report['host']['loadavg_at_end']} on {report['host']['cpus']} cores: other work shares "
        "both cores, so latencies here include waiting for the CPU.\n\n" + "\n".join(rows) + "\n\n"
        "Routing-field parsing alone (microbenchmark):\n\n" + "\n".join(prow) + "\n\n"
        "The router's own handling with the network taken out (in-process, in-memory upstream, "
        "handler_cost.py): "
        + ", ".join(f"{k} {v:.0f} us/request" for k, v in report["router_handler_us_in_process"].items())
        + ".\n\n"
        "The uvicorn floor row is a raw ASGI app on the same server answering the same stream from memory: "
        "the part of the router's cost that is the ASGI server itself.\n\n"
        "Targets: <= 150 us/request, <= 0.2 ms added median at c=1, p99 < 2 x p50 at c=16. "
        "Reference (FACTS.md): production-stack 380-415 us/req, +0.41 ms; Rust vllm-router 105-110 us/req, +0.17 ms.\n"
    )


if __name__ == "__main__":
    sys.exit(main())
