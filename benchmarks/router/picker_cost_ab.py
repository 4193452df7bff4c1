"""Our picker before and after a change, and grpcio's floor, at one cell under the same load: the three
started once, then measured in turn (rotated) with the same requests.

Why: ``picker_cost.py`` starts each picker fresh for every cell and needs a test cluster for the upstream
pickers; on a machine loaded many times over, a picker's start alone takes minutes. This compares only
our two trees and the floor (no cluster), so a change's effect on CPU per pick is measured side by side.

The before tree is another checkout's router package first on PYTHONPATH (``--before-tree DIR``, e.g.
``git archive REV router | tar -x -C DIR``). Pickers on core 0, the driver and the stub engine on core 1;
each pick as ``picker_cost.drive`` makes it (1k-token chat bodies by default).

Usage: ``.venv/bin/python benchmarks/router/picker_cost_ab.py --before-tree DIR [--picks 1200]
[--concurrency 16] [--tokens 1000] [--repeat 3] [--name picker_cost_ab]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import picker_cost as pc  # noqa: E402
from run import PY, ROOT, end_all, free_port, start, wait_ready  # noqa: E402

READY_SECONDS = 600.0  # a picker's start on a machine loaded many times over


def _epp(stub_port: int, env: dict[str, str] | None) -> tuple[subprocess.Popen[bytes], int, int]:
    http, grpc_port = free_port(), free_port()
    backends = f"http://127.0.0.1:{stub_port},http://localhost:{stub_port}"
    process = start([PY, "-m", "vllm_stack.cli", "epp", "--host", "127.0.0.1", "--port", str(http),
                     "--ext-proc-port", str(grpc_port), "--static-backends", backends,
                     "--routing-logic", "prefixaware", "--log-level", "warning"], 0, env=env)  # fmt: skip
    return process, http, grpc_port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before-tree", type=Path, required=True)
    parser.add_argument("--picks", type=int, default=1200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--name", default="picker_cost_ab")
    args = parser.parse_args()
    os.sched_setaffinity(0, {1})
    load = os.getloadavg()
    stub_port = free_port()
    procs = [start([PY, "benchmarks/router/fast_stub.py", "--host", "127.0.0.1", "--port", str(stub_port),
                    "--model", pc.MODEL], 1)]  # fmt: skip
    results: dict[str, list[dict[str, float]]] = {"ours": [], "ours-before": [], "grpc-floor": []}
    try:
        pc._wait_listening(procs[0], "127.0.0.1", stub_port, timeout=READY_SECONDS)
        after = _epp(stub_port, None)
        before = _epp(stub_port, {"PYTHONPATH": str(args.before_tree / "router")})
        floor_port = free_port()
        floor = start([PY, "benchmarks/router/extproc_floor.py", "--port", str(floor_port)], 0)
        procs += [after[0], before[0], floor]
        wait_ready(after[0], after[1], "/ready", timeout=READY_SECONDS)
        wait_ready(before[0], before[1], "/ready", timeout=READY_SECONDS)
        pc._wait_listening(floor, "127.0.0.1", floor_port, timeout=READY_SECONDS)
        targets = {"ours": (after[0], after[2]), "ours-before": (before[0], before[2]),
                   "grpc-floor": (floor, floor_port)}  # fmt: skip
        for _, port in targets.values():
            warm = pc.prompts(args.tokens, 200, seed=7)
            asyncio.run(pc.drive(f"127.0.0.1:{port}", warm, args.concurrency, "warm"))
        names = list(targets)
        for repeat in range(args.repeat):
            bodies = pc.prompts(args.tokens, args.picks, seed=repeat * 1000 + args.tokens)
            for name in names[repeat % 3 :] + names[: repeat % 3]:
                process, port = targets[name]
                used = pc.cpu(process.pid)
                latencies, errors, wall = asyncio.run(
                    pc.drive(f"127.0.0.1:{port}", bodies, args.concurrency, f"{name}-{repeat}")
                )
                used = pc.cpu(process.pid) - used
                row = {
                    "cpu_s_per_1000": used / args.picks * 1000,
                    "p50_ms": statistics.median(latencies) * 1e3,
                    "picks_per_s": args.picks / wall,
                    "errors": errors,
                    "load1": os.getloadavg()[0],
                }
                results[name].append(row)
                print(f"r{repeat} {name}: {row}", flush=True)
    finally:
        end_all(procs)
    lines = [
        f"# Our picker before and after, and grpcio's floor: {args.tokens} tokens, concurrency {args.concurrency}",
        "",
        f"{args.picks} picks per run, {args.repeat} rotated repeats, the three started once and measured in turn; "
        f"CPU s of the picker process per 1,000 picks, mean (min-max). Load average at start: "
        f"{', '.join(f'{x:.1f}' for x in load)}.",
        "",
        "| picker | CPU s / 1,000 picks | p50 ms | picks/s | errors | load (1 min) during |",
        "|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        if runs:
            col = {k: [r[k] for r in runs] for k in runs[0]}
            lines.append(
                f"| {name} | {pc._stat(col['cpu_s_per_1000'], '.3f')} | {pc._stat(col['p50_ms'], '.1f')} | "
                f"{pc._stat(col['picks_per_s'], '.0f')} | {int(sum(col['errors']))} | {pc._stat(col['load1'], '.0f')} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results"
    (out / f"{args.name}.md").write_text(text)
    (out / f"{args.name}.json").write_text(
        json.dumps({"args": vars(args), "load": load, "results": results}, indent=1, default=str)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
