"""Before/after: the router of a git revision against the working tree's, interleaved on one stub.

Why: a change to the request path must show it costs no CPU, and on these shared two-core machines
only an interleaved comparison in one run says that (load drifts between separate runs). Each round
starts every contender afresh (order rotated per round), measures one c=1 and one c=16 pass with
``run.measure`` (router on core 0, stub and load generator on core 1, as ``run.py``), and stops it.
The table gives medians over the rounds with min-max, and the after/before ratio of the medians.

Usage: ``python benchmarks/router/compare.py --before REV [--logics roundrobin,session] [--rounds 5]``
The revision's ``router/`` is exported with ``git archive`` into a temporary folder; results go to
``benchmarks/results/router_compare.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from run import PY, ROOT, end_all, free_port, measure, start, stop, wait_ready

#: c16_cpu_us_exact is the router's CPU over the c=16 pass from /proc/PID/schedstat (nanoseconds);
#: cpu_us_per_request is the same from utime+stime, whose 10 ms ticks add a few per cent of noise.
FIGURES = (
    ("c16_cpu_us_exact", "CPU us/req c=16 (schedstat)", ".1f"),
    ("cpu_us_per_request", "CPU us/req c=16 (ticks)", ".0f"),
    ("c1_p50_ms", "p50 c=1 ms", ".3f"),
)


def export_router(rev: str, into: Path) -> Path:
    """The revision's router package, unpacked under ``into`` (returns the PYTHONPATH entry)."""
    archive = subprocess.run(["git", "archive", rev, "router"], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "router"


def start_router(pythonpath: Path, stub_port: int, logic: str, procs: list) -> tuple:  # noqa: ANN001
    port = free_port()
    cmd = [PY, "-m", "vllm_stack.router_cli", "--host", "127.0.0.1", "--port", str(port),
           "--static-backends", f"http://127.0.0.1:{stub_port}", "--routing-logic", logic,
           "--log-level", "warning"]  # fmt: skip
    router = start(cmd, 0, {"PYTHONPATH": str(pythonpath)})
    procs.append(router)
    wait_ready(router, port, "/ready")
    return router, port


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="git revision of the 'before' router")
    ap.add_argument("--logics", default="roundrobin,session", help="routing logics, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--n1", type=int, default=600)
    ap.add_argument("--n16", type=int, default=6000)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "router_compare"))
    args = ap.parse_args()
    os.sched_setaffinity(0, {1})
    rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    trees = {f"before ({rev})": None, "after (working tree)": ROOT / "router"}
    samples: dict[str, dict[str, list[dict[str, float]]]] = {}
    procs: list = []
    with tempfile.TemporaryDirectory(prefix="router-before-") as tmp:
        trees[f"before ({rev})"] = export_router(args.before, Path(tmp))
        try:
            stub_port = free_port()
            stub = start([PY, "benchmarks/router/fast_stub.py", "--port", str(stub_port), "--tokens", "8"], 1)
            procs.append(stub)
            wait_ready(stub, stub_port, "/health")
            names = list(trees)
            for i in range(args.rounds):
                for logic in args.logics.split(","):
                    for name in names[i % 2 :] + names[: i % 2]:  # rotated: each goes first half the time
                        router, port = start_router(trees[name], stub_port, logic, procs)
                        res = measure(
                            port, args.n1, args.n16, router.pid, stub.pid, 1, warmup=500, cpu_c1=True
                        )
                        stop(router, procs)
                        samples.setdefault(logic, {}).setdefault(name, []).append(res)
                        print(f"round {i + 1} {logic:10s} {name:22s} {res['c16_cpu_us_exact']:.1f} us/req",
                              flush=True)  # fmt: skip
        finally:
            end_all(procs)
    rows = ["| logic | router | " + " | ".join(h for _, h, _ in FIGURES) + " |",
            "|---|---|" + "---|" * len(FIGURES)]  # fmt: skip
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for logic, by_name in samples.items():
        medians = {}
        for name, runs in by_name.items():
            cells = []
            for key, _, fmt in FIGURES:
                values = [r[key] for r in runs]
                med = statistics.median(values)
                medians.setdefault(name, {})[key] = med
                cells.append(f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})")
            rows.append(f"| {logic} | {name} | " + " | ".join(cells) + " |")
        before, after = (medians[n] for n in names)
        ratio = " | ".join(f"{after[k] / before[k]:.3f}" for k, _, _ in FIGURES)
        rows.append(f"| {logic} | after / before | {ratio} |")
        summary[logic] = medians
    table = "\n".join(rows)
    md = (f"# Router before/after ({rev} vs the working tree)\n\n{args.rounds} interleaved rounds per logic, "
          f"c=1 x {args.n1} and c=16 x {args.n16} streamed 8-token chat completions on the fast stub; "
          f"medians (min-max).\n\n{table}\n")  # fmt: skip
    out = Path(args.out)
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(
        json.dumps({"before": rev, "samples": samples, "medians": summary}, indent=2)
    )
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
