"""Run a tier of the test suite N times and record every failure: the flakiness record.

A flaky test blocks every landing, so the suite is run again and again on one checkout and each run's
failures are kept with the commit they ran at (`benchmarks/results/suite_runs.json`, appended; the table
in `suite_runs.md` is rewritten from it). A failure is then fixed at its cause and the tier run again
until a whole series passes.

    .venv/bin/python benchmarks/suite/repeat.py --tier fast --runs 20
    .venv/bin/python benchmarks/suite/repeat.py --tier engine --runs 3

Tiers: fast (`not engine and not cluster and not node`, what `make test-fast` runs), engine, cluster, all.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
MARKERS = {
    "fast": "not engine and not cluster and not node",
    "engine": "engine",
    "cluster": "cluster",
    "all": "",
}


def failures(junit: Path) -> dict[str, str]:
    """The tests (file::name) that failed or errored in a JUnit XML report, each with the first line of
    its message (what to look at first; the cause is then found from the test's own output)."""
    found = {}
    for case in ET.parse(junit).iter("testcase"):
        outcome = case.find("failure")
        if outcome is None:
            outcome = case.find("error")
        if outcome is not None:
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            message = (outcome.get("message") or outcome.text or "").strip().splitlines()
            found[name] = message[0][:300] if message else ""
    return found


def counts(junit: Path) -> dict[str, int]:
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None
    return {key: int(suite.get(key, "0")) for key in ("tests", "failures", "errors", "skipped")}


def one_run(tier: str, extra: list[str]) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as folder:
        junit = Path(folder) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        if MARKERS[tier]:
            command += ["-m", MARKERS[tier]]
        started = time.monotonic()
        result = subprocess.run([*command, *extra], cwd=ROOT, capture_output=True, text=True)
        seconds = time.monotonic() - started
        if not junit.exists():
            return {"seconds": round(seconds), "rc": result.returncode, "failed": ["(no report)"],
                    "tail": result.stdout[-2000:] + result.stderr[-2000:]}  # fmt: skip
        failed = failures(junit)
        return {
            "seconds": round(seconds),
            "rc": result.returncode,
            **counts(junit),
            "failed": list(failed),
            "messages": failed,
            "summary": _summary_lines(result.stdout),
        }


def _summary_lines(stdout: str) -> list[str]:
    """pytest's short test summary (its `FAILED ... - message` lines), kept whole for the record."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if "short test summary info" in line), None)
    return [] if start is None else lines[start + 1 : start + 41]


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    # The record itself is written into the checkout between runs: it does not make the tested code dirty.
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":(exclude)benchmarks/results"], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # fmt: skip
    return head.stdout.strip() + ("+dirty" if dirty else "")


def table(records: list[dict]) -> str:
    lines = [
        "# Test-suite runs, one after another on one checkout (benchmarks/suite/repeat.py)",
        "",
        "| date (UTC) | commit | tier | run | tests | failed | seconds | failing tests | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        failed = ", ".join(f"`{name}`" for name in r["failed"]) or "-"
        lines.append(
            f"| {r['date']} | {r['commit']} | {r['tier']} | {r['run']} | {r.get('tests', '?')} "
            f"| {len(r['failed'])} | {r['seconds']} | {failed} | {r.get('note', '')} |"
        )
    series: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        series.setdefault((r["commit"], r["tier"]), []).append(r)
    lines += ["", "| commit | tier | runs | runs with a failure |", "|---|---|---|---|"]
    for (rev, tier), runs in series.items():
        lines.append(f"| {rev} | {tier} | {len(runs)} | {sum(1 for r in runs if r['failed'])} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", choices=sorted(MARKERS), default="fast")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--note", default="", help="what else ran on the machine meanwhile, for the record")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args()
    store = RESULTS / "suite_runs.json"
    records = json.loads(store.read_text()) if store.exists() else []
    rev = commit()
    for run in range(1, args.runs + 1):
        outcome = one_run(args.tier, args.pytest_args)
        record = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"), "commit": rev,
                  "tier": args.tier, "run": run, **outcome}  # fmt: skip
        if args.note:
            record["note"] = args.note
        records.append(record)
        store.write_text(json.dumps(records, indent=1) + "\n")
        (RESULTS / "suite_runs.md").write_text(table(records))
        print(f"{args.tier} run {run}/{args.runs}: {len(outcome['failed'])} failed in {outcome['seconds']} s"
              + "".join(f"\n  {name}" for name in outcome["failed"]), flush=True)  # fmt: skip
    print(table([r for r in records if r["commit"] == rev and r["tier"] == args.tier]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
