"""Before/after in machine instructions per request: ``handler_cost``'s in-process request path of a
git revision and of the working tree, counted by valgrind (callgrind), so the comparison is free of
the machine's noise.

Why: on these shared two-core machines CPU-time comparisons of a few per cent drown in noise (the
same code measures 37-76 us per request from one process to the next); instructions executed do
not depend on what else runs. Each cell runs ``handler_cost.measure`` twice under callgrind, with
``n`` and ``n + extra`` requests per repeat; the difference over the ``3 * extra`` extra requests is
the cost of one request, start-up and warm-up cancelled out. ``PYTHONHASHSEED=0`` keeps dict layouts
the same between runs. Instructions are not time (a cache miss costs more than an add), so this
complements the interleaved CPU-time runs (``compare_handler_cost.py``, ``compare.py``), it does not
replace them.

Usage: ``python benchmarks/router/compare_instructions.py --before REV [--after REV] [--extra 500] [--jobs 2] [--name NAME]
[--after-settings JSON]``
Results: ``benchmarks/results/NAME.{md,json}`` (default ``instructions_compare``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare_handler_cost import _CELL, LOGICS, MODES, ROOT, export_tree  # the same cell, counted

BASE_N = 100
#: handler_cost's cell with the request count as a fourth argument.
#: With the after tree's router settings from ``--after-settings`` (JSON in the environment).
_CELL_N = (
    _CELL.replace(
        "tree, logic, mode = sys.argv[1], sys.argv[2], sys.argv[3]",
        "tree, logic, mode, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])",
    )
    .replace('"msgspec", mode)', '"msgspec", mode, n=n)')
    .replace(
        '{**cli, "routing_logic": logic}',
        '{**cli, "routing_logic": logic, **json.loads(__import__("os").environ.get("CELL_SETTINGS", "{}"))}',
    )
)


def instructions(tree: Path, logic: str, mode: str, n: int, settings: str = "{}") -> int:
    env = {**os.environ, "PYTHONHASHSEED": "0", "CELL_SETTINGS": settings}
    out = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", _CELL_N,
         str(tree), logic, mode, str(n)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    match = re.search(r"Collected : (\d+)", out.stderr)
    if match is None:
        raise RuntimeError(out.stderr[-2000:])
    return int(match.group(1))


def per_request(tree: Path, logic: str, mode: str, extra: int, settings: str = "{}") -> float:
    low = instructions(tree, logic, mode, BASE_N, settings)
    high = instructions(tree, logic, mode, BASE_N + extra, settings)
    return (high - low) / (3 * extra)  # handler_cost.measure runs 3 repeats of n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True)
    parser.add_argument(
        "--after", help="a git revision instead of the working tree (edits meanwhile do not count)"
    )
    parser.add_argument("--extra", type=int, default=500)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cases", help="comma-separated logic/mode cells (default: all)")
    parser.add_argument("--name", default="instructions_compare", help="results file name (without suffix)")
    parser.add_argument(
        "--after-settings",
        default="{}",
        help="router settings of the after tree, JSON (e.g. '{\"stream_continuation\": false}')",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        after = ROOT
        if args.after:
            after = Path(tmp) / "after"
            after.mkdir()
            export_tree(args.after, after)
        before = Path(tmp) / "before"
        before.mkdir()
        trees = {"before": export_tree(args.before, before), "after": after}
        wanted = set(args.cases.split(",")) if args.cases else None
        cells = [
            (name, logic, mode)
            for logic in LOGICS
            for mode in MODES
            for name in trees
            if wanted is None or f"{logic}/{mode}" in wanted
        ]
        with ThreadPoolExecutor(args.jobs) as pool:
            values = list(
                pool.map(
                    lambda c: per_request(
                        trees[c[0]], c[1], c[2], args.extra, args.after_settings if c[0] == "after" else "{}"
                    ),
                    cells,
                )
            )
    result: dict[str, dict[str, float]] = {}
    for (name, logic, mode), value in zip(cells, values, strict=True):
        result.setdefault(f"{logic}/{mode}", {})[name] = value
    lines = [
        f"# Instructions per request, before ({args.before}) and after (callgrind, handler_cost path)"
        + (f", after with {args.after_settings}" if args.after_settings != "{}" else ""),
        "",
        "| case | before | after | after/before |",
        "|---|---|---|---|",
    ]
    for case, v in result.items():
        lines.append(f"| {case} | {v['before']:,.0f} | {v['after']:,.0f} | {v['after'] / v['before']:.3f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    out = ROOT / "benchmarks" / "results"
    (out / f"{args.name}.md").write_text(table)
    record = {
        "before": args.before,
        "after": args.after,
        "after_settings": args.after_settings,
        "cells": result,
    }
    (out / f"{args.name}.json").write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
