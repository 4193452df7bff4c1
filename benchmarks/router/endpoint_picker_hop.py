"""What asking an endpoint picker costs per request: the router alone against the router in gateway mode
asking our picker (`vllm-stack epp`) over ext_proc v3, side by side, in front of one stub engine.

Rows (each a separate set of processes, same stub, same request, the order rotated every repeat):
- router: `vllm-stack router --routing-logic roundrobin` in front of the stub;
- gateway -> our EPP: `vllm-stack router --endpoint-picker grpc://...` in front of the same stub, asking
  `vllm-stack epp --routing-logic roundrobin` (which reads the same stub's metrics) for every request.
Figures: median and p99 latency at concurrency 1 and 16 (the hop's added latency is the difference),
requests/s at c=16, and CPU microseconds per request of each process (``/proc/<pid>/stat`` over the
measured requests; the picker's CPU is its whole cost of answering: the gRPC stream, parsing, the
director's stages, the response messages). The gateway and the picker share core 0 in that row (a
gateway and its picker would each have their own cores in a cluster; here the sum is what is compared),
the stub and this load generator core 1.

The upstream EPP (Go) is not in this table: it needs an InferencePool on an API server (the cluster
tier runs it); its hop cost is the same gRPC round trip plus its own processing.

Usage: ``.venv/bin/python benchmarks/router/endpoint_picker_hop.py [--repeat 3] [--requests 2000]``;
results: benchmarks/results/endpoint_picker_hop.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import build_request, run_load  # noqa: E402
from run import BODY, PY, ROOT, cpu_times, end_all, free_port, pct, start, wait_ready  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _router(port: int, stub_port: int, *extra: str, prog: str = "router") -> list[str]:
    module = "vllm_stack.cli"
    return [
        PY, "-m", module, prog, "--host", "127.0.0.1", "--port", str(port),
        "--static-backends", f"http://127.0.0.1:{stub_port}", "--routing-logic", "roundrobin",
        "--log-level", "warning", *extra,
    ]  # fmt: skip


def start_row(name: str, stub_port: int, procs: list) -> tuple[int, list[tuple[str, int]]]:
    """Start a row's processes; (the port the load goes to, [(process role, pid)])."""
    env = {"PYTHONPATH": str(ROOT / "router")}
    port = free_port()
    if name == "router":
        proc = start(_router(port, stub_port), 0, env)
        procs.append(proc)
        wait_ready(proc, port, "/ready")
        return port, [("router", proc.pid)]
    grpc_port, epp_http = free_port(), free_port()
    epp = start(_router(epp_http, stub_port, "--ext-proc-port", str(grpc_port), prog="epp"), 0, env)
    procs.append(epp)
    wait_ready(epp, epp_http, "/ready")
    gateway = start(_router(port, stub_port, "--endpoint-picker", f"grpc://127.0.0.1:{grpc_port}"), 0, env)
    procs.append(gateway)
    wait_ready(gateway, port, "/ready")
    return port, [("gateway", gateway.pid), ("epp", epp.pid)]


def measure_row(port: int, pids: list[tuple[str, int]], requests: int) -> dict[str, float]:
    request = build_request("127.0.0.1", port, "/v1/chat/completions", BODY)

    async def go() -> dict[str, float]:
        await run_load("127.0.0.1", port, request, 16, 300)  # warm-up
        lat1, _, e1 = await run_load("127.0.0.1", port, request, 1, requests // 4)
        before = {role: sum(cpu_times(pid)) for role, pid in pids}
        lat16, wall16, e16 = await run_load("127.0.0.1", port, request, 16, requests)
        after = {role: sum(cpu_times(pid)) for role, pid in pids}
        out = {
            "c1_p50_ms": statistics.median(lat1) * 1e3,
            "c1_p99_ms": pct(lat1, 0.99) * 1e3,
            "c16_p50_ms": statistics.median(lat16) * 1e3,
            "c16_p99_ms": pct(lat16, 0.99) * 1e3,
            "c16_rps": requests / wall16,
            "errors": e1 + e16,
        }
        for role in before:
            out[f"{role}_cpu_us"] = (after[role] - before[role]) / requests * 1e6
        out["cpu_us_total"] = sum(out[f"{role}_cpu_us"] for role in before)
        return out

    return asyncio.run(go())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    rows = ["router", "gateway -> our EPP"]
    results: dict[str, list[dict[str, float]]] = {row: [] for row in rows}
    procs: list = []
    try:
        stub_port = free_port()
        stub = start([PY, "benchmarks/router/fast_stub.py", "--port", str(stub_port)], 1)
        procs.append(stub)
        wait_ready(stub, stub_port, None)
        for repeat in range(args.repeat):
            for row in rows[repeat % len(rows) :] + rows[: repeat % len(rows)]:
                row_procs: list = []
                port, pids = start_row(row, stub_port, row_procs)
                try:
                    results[row].append(measure_row(port, pids, args.requests))
                finally:
                    end_all(row_procs)
                print(f"repeat {repeat + 1}: {row}: {results[row][-1]}", flush=True)
    finally:
        end_all(procs)
    summary = {
        row: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for row, runs in results.items()
    }
    spread = {
        row: {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in runs[0]}
        for row, runs in results.items()
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "endpoint_picker_hop.json").write_text(
        json.dumps({"runs": results, "median": summary}, indent=1)
    )
    base = summary["router"]
    hop = summary["gateway -> our EPP"]
    lines = [
        "# The endpoint picker hop: router alone vs gateway mode asking our EPP",
        "",
        f"Stub: fast_stub.py; streamed chat completion of 8 tokens; {args.requests} requests at c=16, "
        f"{args.requests // 4} at c=1; {args.repeat} repeats, order rotated; medians (min-max).",
        "",
        "| row | c=1 p50 ms | c=1 p99 ms | c=16 p50 ms | c=16 p99 ms | req/s c=16 | CPU us/request |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        s, sp = summary[row], spread[row]
        cpu = " + ".join(f"{k[:-7]} {s[k]:.0f}" for k in s if k.endswith("_cpu_us"))

        def cell(key: str, s: dict = s, sp: dict = sp) -> str:
            return f"{s[key]:.2f} ({sp[key][0]:.2f}-{sp[key][1]:.2f})"

        lines.append(
            f"| {row} | {cell('c1_p50_ms')} | {cell('c1_p99_ms')} | {cell('c16_p50_ms')} | {cell('c16_p99_ms')} "
            f"| {s['c16_rps']:.0f} | {cpu} = {s['cpu_us_total']:.0f} |"
        )
    lines += [
        "",
        f"Added by the hop: c=1 median +{hop['c1_p50_ms'] - base['c1_p50_ms']:.2f} ms, "
        f"c=16 median +{hop['c16_p50_ms'] - base['c16_p50_ms']:.2f} ms; CPU per request "
        f"{hop['cpu_us_total'] / base['cpu_us_total']:.2f}x the router alone "
        f"(gateway {hop['gateway_cpu_us']:.0f} us, picker {hop['epp_cpu_us']:.0f} us).",
    ]
    (RESULTS / "endpoint_picker_hop.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
