"""Request priority under overload: per-class latency and shedding with the router's priority on and off.

Two real vLLM engines (CPU build, the tiny model, ``--max-num-seqs 4 --scheduling-policy priority``,
``max_model_len`` 512) behind our router (its own process, ``leastloaded``, ``queue_timeout`` 60).
First the capacity C (requests/s) of the pair: a closed loop at concurrency 16 (twice the 8 running
slots) for 15 s. Then open-loop Poisson arrivals for ``--duration`` seconds, 20% critical / 50%
standard / 30% sheddable (header ``x-request-priority``; critical sends a key from
``VLLM_STACK_PRIORITY_API_KEYS``), in three runs, interleaved per round:

- ``on-2x``: priority on (``priority_scheduling: true``, the model ``engine_priority: true``) at 2 x C;
- ``off-2x``: priority off (no saturation rule, no engine priorities) at 2 x C;
- ``on-0.5x``: priority on at half load, the baseline for critical latency;
- ``on-2x-headroom``: as ``on-2x`` with ``critical_reserve_slots`` (``--headroom-slots``, 1: running
  slots per engine kept free of standard and sheddable work).

Why: the claim is that with priority on, an overload lands on sheddable (429 at once) and standard
(waits in the router's queue), while critical requests keep the latency of an unloaded system.
Every request is a non-streamed chat completion with ``max_tokens`` = ``min_tokens`` = 32. Latency is
taken from each request's intended send time (no coordinated omission); after the arrivals the run
waits up to 120 s for what is outstanding and counts the rest as unfinished. Before each run both
engines must show nothing running or waiting.

Usage: ``python benchmarks/priority/load.py [--duration 30] [--rounds 2] [--runs on-2x,on-0.5x]
[--headroom-slots 1] [--out PATH]``; prints a table and writes ``benchmarks/results/priority_load.{md,json}``
(or ``PATH.{md,json}``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "router", ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import engine_bench  # noqa: E402  benchmarks/engine_bench.py
import httpx  # noqa: E402
from vllm_stack_dev.testbed import engines as tb  # noqa: E402

MODEL = "tiny-llama"
KEY = "bench-priority-key"
CLASSES = ("critical", "standard", "sheddable")
MIX = (0.2, 0.5, 0.3)
# priority, x capacity, running slots per engine kept for critical requests (critical_reserve_slots)
RUNS = {
    "on-2x": (True, 2.0, 0),
    "on-2x-headroom": (True, 2.0, 1),
    "off-2x": (False, 2.0, 0),
    "on-0.5x": (True, 0.5, 0),
}
DRAIN_S = 120.0
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a short story about a cat."}],
    "max_tokens": 32,
    "min_tokens": 32,
}


def router_config(priority: bool, backends: list[str], reserve: int = 0) -> dict:
    return {
        "static_backends": backends,
        "routing_logic": "leastloaded",
        "priority_scheduling": priority,
        "models": [{"name": MODEL, "engine_priority": True} if priority else MODEL],
        "queue_timeout": 60,
        "critical_reserve_slots": reserve,
    }


def router_env() -> dict[str, str]:
    """The router's environment: the API key that may raise a request to critical."""
    return os.environ | {"VLLM_STACK_PRIORITY_API_KEYS": KEY}


def headers(cls: str) -> dict[str, str]:
    h = {"x-request-priority": cls}
    if cls == "critical":  # above the model's default (standard): needs a key that may raise it
        h["authorization"] = f"Bearer {KEY}"
    return h


async def open_loop(url: str, rate: float, duration: float, seed: int) -> dict[str, dict]:
    """Poisson arrivals at ``rate``/s for ``duration`` s; per class: outcomes and latencies."""
    rng = random.Random(seed)
    plan: list[tuple[float, str]] = []
    t = rng.expovariate(rate)
    while t < duration:
        plan.append((t, rng.choices(CLASSES, MIX)[0]))
        t += rng.expovariate(rate)
    out = {c: {"sent": 0, "ok": 0, "rejected": 0, "other": 0, "unfinished": 0, "lat": []} for c in CLASSES}
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    timeout = httpx.Timeout(DRAIN_S + duration, connect=10)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.monotonic()

        async def one(at: float, cls: str) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            out[cls]["sent"] += 1
            try:
                r = await client.post("/v1/chat/completions", json=BODY, headers=headers(cls))
            except httpx.HTTPError:
                out[cls]["other"] += 1
                return
            if r.status_code == 200:
                out[cls]["ok"] += 1
                out[cls]["lat"].append(time.monotonic() - (t0 + at))  # from the intended send time
            else:
                out[cls]["rejected" if r.status_code == 429 else "other"] += 1

        tasks = {asyncio.create_task(one(at, cls)): cls for at, cls in plan}
        await asyncio.sleep(max(0.0, t0 + duration - time.monotonic()))
        _, pending = await asyncio.wait(tasks, timeout=DRAIN_S)
        for task in pending:
            task.cancel()
            out[tasks[task]]["unfinished"] += 1
        await asyncio.gather(*pending, return_exceptions=True)
    return out


def summarize(rounds: list[dict], runs: list[str]) -> dict:
    """Per run and class, per figure: median and min-max over the rounds."""
    table: dict = {}
    for run in runs:
        table[run] = {}
        for cls in CLASSES:
            row = {}
            for fig in ("sent", "ok", "rejected", "other", "unfinished", "p50_ms", "p99_ms"):
                vals = [r[run][cls][fig] for r in rounds if r[run][cls][fig] is not None]
                row[fig] = (
                    {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None
                )
            table[run][cls] = row
    return table


def reading(summary: dict, headroom: int) -> str:
    """The short interpretation, filled in from the medians."""

    def m(run: str, cls: str, fig: str) -> str:
        s = summary.get(run, {}).get(cls, {}).get(fig)
        return "-" if s is None else f"{s['median']:.0f}"

    crit = summary.get("on-2x", {}).get("critical", {}).get("p99_ms")
    spread = ""
    if crit is not None and crit["max"] > 3 * crit["median"]:
        spread = (
            f" Critical p99 at 2x varied across rounds ({crit['min']:.0f}-{crit['max']:.0f} ms): at least one round "
            "had a tail of critical requests far slower than the others; the median is the figure compared."
        )
    return (
        f"With priority on at 2x, sheddable requests are answered 429 at once ({m('on-2x', 'sheddable', 'rejected')} "
        f"of {m('on-2x', 'sheddable', 'sent')}) and standard ones wait in the router's queue (p99 "
        f"{m('on-2x', 'standard', 'p99_ms')} ms), while critical requests skip that queue and go first in the "
        f"engines' (p99 {m('on-2x', 'critical', 'p99_ms')} ms, against {m('on-0.5x', 'critical', 'p99_ms')} ms at "
        f"half load). The few sheddable requests admitted before the engines filled ({m('on-2x', 'sheddable', 'ok')}) "
        f"then wait behind every other class in the engines' priority queues (p99 "
        f"{m('on-2x', 'sheddable', 'p99_ms')} ms). With priority off, nothing is shed and no class goes first: every request waits in the "
        f"engines' own queues, which grow for the whole overload, so all three classes see the same latency "
        f"(critical p99 {m('off-2x', 'critical', 'p99_ms')} ms, sheddable {m('off-2x', 'sheddable', 'p99_ms')} ms) "
        f"and the backlog is served long after the arrivals stop. Two cores run both engines, the router and "
        f"the load generator, so absolute figures are this machine's; the comparison between runs is the point. "
        f"With {headroom} running slot(s) per engine kept for critical requests (on-2x-headroom, "
        f"`critical_reserve_slots: {headroom}`), critical p99 is {m('on-2x-headroom', 'critical', 'p99_ms')} ms "
        f"(without it {m('on-2x', 'critical', 'p99_ms')} ms) and standard p99 "
        f"{m('on-2x-headroom', 'standard', 'p99_ms')} ms (without it {m('on-2x', 'standard', 'p99_ms')} ms): the "
        f"slots it keeps free cost standard work, and what they give critical requests is read from these two rows."
        + spread
    )


COLUMNS = ("run", "class", "sent", "200", "429", "other", "unfinished", "p50 ms", "p99 ms")


def rows(report: dict) -> list[list[str]]:
    out = []
    for run in report["runs"]:
        for cls in CLASSES:
            s = report["summary"][run][cls]
            figs = [
                engine_bench.spread_cell(s[f])
                for f in ("sent", "ok", "rejected", "other", "unfinished", "p50_ms", "p99_ms")
            ]
            out.append([run, cls, *figs])
    return out


def render(report: dict) -> str:
    lines = [
        "# Request priority under overload",
        "",
        f"`python benchmarks/priority/load.py --duration {report['duration_s']:g} --rounds {report['rounds']}` on "
        f"{report['machine']}: two vLLM engines (CPU build, tiny model, `--max-num-seqs 4 --scheduling-policy "
        "priority`) behind our router (`leastloaded`, `queue_timeout` 60); non-streamed chat, 32 tokens; "
        f"capacity C = {report['capacity_rps']['median']:.1f} requests/s (closed loop at 16, median of "
        f"{len(report['capacity_rps']['raw'])}); Poisson arrivals for {report['duration_s']:g} s, 20% critical / 50% "
        f"standard / 30% sheddable; on-2x-headroom keeps {report['headroom_slots']} slot(s) per engine. "
        "Medians over the rounds, min-max in brackets; latency from the intended send time, of 200s only.",
        "",
        *engine_bench.markdown_table(COLUMNS, rows(report), left_columns=2),
    ]
    lines += ["", *report["verdicts"], "", "## Reading", "", report["reading"], ""]
    return "\n".join(lines)


def print_table(report: dict) -> None:
    engine_bench.print_console_table(
        f"Request priority under overload (C = {report['capacity_rps']['median']:.1f} req/s)",
        COLUMNS,
        rows(report),
        left_columns=2,
        width=160,
        notes=report["verdicts"],
        fallback_markdown=render(report),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "priority_load"))
    ap.add_argument("--runs", default=",".join(RUNS), help=f"a comma-separated subset of {', '.join(RUNS)}")
    ap.add_argument("--headroom-slots", type=int, default=1, help="critical_reserve_slots of on-2x-headroom")
    args = ap.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        ap.error(f"unknown runs: {', '.join(unknown)}")

    engines, log_dir = engine_bench.launch_tiny_engines(
        MODEL, "priority-load-", ["--max-num-seqs", "4", "--scheduling-policy", "priority"]
    )
    router: subprocess.Popen[bytes] | None = None
    caps: list[float] = []
    rounds: list[dict] = []
    try:
        tb.wait_ready(engines, 420)
        backends = [e.url for e in engines]
        caps = engine_bench.measure_capacity(
            engines, router_config(False, backends), log_dir, BODY, headers("standard"), router_env()
        )
        cap = statistics.median(caps)
        for i in range(args.rounds):
            result: dict = {}
            for run in runs:
                priority, load, reserve = RUNS[run]
                if run == "on-2x-headroom":
                    reserve = args.headroom_slots
                config = router_config(priority, backends, reserve)
                router, url = engine_bench.start_router(config, log_dir, f"{run}-{i}", router_env())
                engine_bench.wait_idle(engines)
                res = asyncio.run(open_loop(url, load * cap, args.duration, seed=1000 * i + int(load * 10)))
                tb.stop_process(router)
                router = None
                for c in CLASSES:
                    lat = res[c].pop("lat")
                    res[c] |= {
                        "p50_ms": engine_bench.percentile_ms(lat, 0.5),
                        "p99_ms": engine_bench.percentile_ms(lat, 0.99),
                    }
                result[run] = res
                print(f"round {i + 1} {run}: " + json.dumps(res), flush=True)
            rounds.append(result)
    finally:
        engine_bench.stop_testbed(router, engines)
    summary = summarize(rounds, runs)
    crit_base = summary["on-0.5x"]["critical"]["p99_ms"] if "on-0.5x" in summary else None
    verdicts = []
    for run in [r for r in ("on-2x", "on-2x-headroom") if r in summary]:
        crit_on = summary[run]["critical"]["p99_ms"]
        rejected = summary[run]["critical"]["rejected"]
        p99_ok = (
            crit_on is not None and crit_base is not None and crit_on["median"] <= 1.5 * crit_base["median"]
        )
        verdicts += [
            f"{'PASS' if p99_ok else 'FAIL'}: critical p99 at 2x ({run}: {engine_bench.spread_cell(crit_on)} ms) <= 1.5 x "
            f"critical p99 at 0.5x ({engine_bench.spread_cell(crit_base)} ms)",
            f"{'PASS' if rejected and rejected['max'] == 0 else 'FAIL'}: critical requests rejected ({run}): "
            f"{engine_bench.spread_cell(rejected)}",
        ]
    report = {
        "duration_s": args.duration,
        "rounds": args.rounds,
        "runs": runs,
        "headroom_slots": args.headroom_slots,
        "machine": engine_bench.machine_summary(),
        "capacity_rps": {"median": statistics.median(caps), "raw": caps},
        "summary": summary,
        "raw": rounds,
        "verdicts": verdicts,
    }
    report["reading"] = reading(summary, args.headroom_slots)
    engine_bench.write_report(args.out, report, render, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
