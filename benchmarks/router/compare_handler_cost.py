"""Before/after for :mod:`handler_cost`: the in-process CPU cost per request of a git revision's router
against the working tree's, interleaved in one run.

Why: ``handler_cost`` takes the network out, so it sees a change of a few per cent in the request path
that socket benchmarks drown in noise; interleaving (order rotated per round, every contender in a
fresh process) keeps the machine's drift out of the ratio. Each cell runs ``handler_cost.measure``
of that tree (min of 3 x 20,000 requests) in its own process, for a strategy and a way of delivering
the answer; the table gives medians over the rounds, min-max, and after/before ratios.

``session`` requests carry a body ``user`` so that the session key is hashed (the affinity path, not
the no-key fallback). ``prefixaware`` runs the prefix-cache picker (character blocks of the prompt,
the index, the answer's usage read back by its response-complete hook): the path with the most
plugin work per request.

Usage: ``python benchmarks/router/compare_handler_cost.py --before REV [--rounds 5]``
Results: ``benchmarks/results/handler_cost_compare.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOGICS = ("roundrobin", "session", "prefixaware")
MODES = ("one_read", "per_token_reads")

_CELL = r"""
import asyncio, json, sys
tree, logic, mode = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path[:0] = [tree + "/benchmarks/router", tree + "/router"]
import handler_cost as h
from run import BODY
body = json.loads(BODY)
if logic == "session":
    body["user"] = "bench-user-1"
original = h.build_router
h.build_router = lambda cli, **kw: original({**cli, "routing_logic": logic}, **kw)
print(json.dumps(asyncio.run(h.measure(json.dumps(body).encode(), "msgspec", mode))))
"""


def export_tree(rev: str, into: Path) -> Path:
    """The revision's ``router/`` and ``benchmarks/`` unpacked under ``into``."""
    archive = subprocess.run(
        ["git", "archive", rev, "router", "benchmarks"], cwd=ROOT, check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def cell(tree: Path, logic: str, mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _CELL, str(tree), logic, mode], check=True, capture_output=True, text=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"before": export_tree(args.before, Path(tmp)), "after": ROOT}
        samples: dict[str, dict[str, list[float]]] = {
            name: {f"{logic}/{mode}": [] for logic in LOGICS for mode in MODES} for name in trees
        }
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for logic in LOGICS:
                for mode in MODES:
                    for name in order:
                        value = cell(trees[name], logic, mode)
                        samples[name][f"{logic}/{mode}"].append(value)
                        print(f"round {r + 1} {name:6} {logic}/{mode}: {value:.2f} us", flush=True)
    rows = []
    for key in samples["after"]:
        b, a = samples["before"][key], samples["after"][key]
        mb, ma = statistics.median(b), statistics.median(a)
        rows.append(
            {
                "case": key,
                "before_us": mb,
                "before_range": [min(b), max(b)],
                "after_us": ma,
                "after_range": [min(a), max(a)],
                "ratio": ma / mb,
                "min_ratio": min(a) / min(b),
            }
        )
    lines = [
        f"# handler_cost before ({args.before}) and after, interleaved, {args.rounds} rounds",
        "",
        "CPU us per request (median over rounds; min-max); each value the min of 3 x 20,000 requests.",
        "On a shared machine noise only adds, so the ratio of the minima is the steadier estimate.",
        "",
        "| case | before | after | after/before (medians) | after/before (minima) |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['before_us']:.2f} ({row['before_range'][0]:.2f}-{row['before_range'][1]:.2f})"
            f" | {row['after_us']:.2f} ({row['after_range'][0]:.2f}-{row['after_range'][1]:.2f})"
            f" | {row['ratio']:.3f} | {row['min_ratio']:.3f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    results = ROOT / "benchmarks" / "results"
    (results / "handler_cost_compare.md").write_text(table)
    (results / "handler_cost_compare.json").write_text(
        json.dumps({"before": args.before, "rounds": args.rounds, "rows": rows, "samples": samples}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
