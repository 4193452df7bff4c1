"""What tracing costs: CPU per request of the in-process request path with tracing off, on at 100%
sampling, and on at 1%, the spans sent over OTLP/gRPC to a real OpenTelemetry Collector.

Each cell is ``handler_cost.measure`` (the router's request path without sockets; min of 3 repeats)
in a fresh process; the states are interleaved, their order rotated per round, so the machine's drift
stays out of the ratios. With tracing on, each repeat ends by flushing every span it made, inside the
measured CPU time, and ``process_time`` counts the exporter's thread: the cost is the spans' creation,
their batching, their encoding and their sending, all of it. The span queue is made large enough
(``OTEL_BSP_MAX_QUEUE_SIZE``) that no span is dropped, as the SDK would under a burst this fast.

The collector is the test bed's (``vllm_stack_dev.testbed.collector``, built by ``make install``).

Usage: ``.venv/bin/python benchmarks/router/tracing_overhead.py [--rounds 5] [--n 5000]``
Results: ``benchmarks/results/tracing_overhead.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "router"))

from vllm_stack_dev.testbed.collector import Collector  # noqa: E402

LOGICS = ("roundrobin", "prefixaware")
STATES = {"off": None, "on, 100%": 1.0, "on, 1%": 0.01}

_CELL = r"""
import asyncio, json, sys
root, logic, n, endpoint, ratio = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
sys.path[:0] = [root + "/benchmarks/router", root + "/router"]
import handler_cost as h
from run import BODY
settings = {"routing_logic": logic}
if endpoint:
    settings.update(otlp_traces_endpoint=endpoint, trace_sample_ratio=float(ratio))
print(asyncio.run(h.measure(BODY, "msgspec", "one_read", n=n, settings=settings)))
"""


def cell(logic: str, n: int, endpoint: str, ratio: float | None) -> float:
    env = {**os.environ, "OTEL_BSP_MAX_QUEUE_SIZE": str(20 * n)}
    args = [str(ROOT), logic, str(n), endpoint if ratio is not None else "", str(ratio or 0)]
    out = subprocess.run(
        [sys.executable, "-c", _CELL, *args], check=True, capture_output=True, text=True, env=env
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=5000, help="requests per repeat")
    args = parser.parse_args()
    samples: dict[str, dict[str, list[float]]] = {logic: {state: [] for state in STATES} for logic in LOGICS}
    with tempfile.TemporaryDirectory() as folder, Collector(Path(folder)) as collector:
        for r in range(args.rounds):
            order = list(STATES) if r % 2 == 0 else list(reversed(STATES))
            for logic in LOGICS:
                for state in order:
                    value = cell(logic, args.n, collector.grpc_endpoint, STATES[state])
                    samples[logic][state].append(value)
                    print(f"round {r + 1} {logic:11} {state:9}: {value:.1f} us", flush=True)
        received = len(collector.spans())
    lines = [
        "# Tracing overhead: CPU per request, tracing off and on (handler_cost path, OTLP/gRPC to a real collector)",
        "",
        f"`benchmarks/router/tracing_overhead.py --rounds {args.rounds} --n {args.n}`: medians over the rounds "
        "(min-max), each cell the min of 3 repeats in a fresh process, states interleaved. Spans the collector "
        f"received over the whole run: {received:,}.",
        "",
        "| logic | tracing | CPU us/request | vs off |",
        "|---|---|---|---|",
    ]
    result: dict[str, dict[str, dict[str, float]]] = {}
    for logic in LOGICS:
        off = statistics.median(samples[logic]["off"])
        for state in STATES:
            values = samples[logic][state]
            median = statistics.median(values)
            result.setdefault(logic, {})[state] = {"median": median, "min": min(values), "max": max(values)}
            lines.append(
                f"| {logic} | {state} | {median:.1f} ({min(values):.1f}-{max(values):.1f}) | {median / off:.2f}x |"
            )
    table = "\n".join(lines) + "\n"
    print(table)
    out = ROOT / "benchmarks" / "results"
    (out / "tracing_overhead.md").write_text(table)
    (out / "tracing_overhead.json").write_text(
        json.dumps(
            {"rounds": args.rounds, "n": args.n, "spans_received": received, "cells": result}, indent=1
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
