"""Batch API beside interactive traffic: interactive TTFT with and without a batch running, and the batch's
throughput in the capacity the interactive load leaves.

Two real vLLM engines (CPU build, the tiny model, ``--max-num-seqs 4 --scheduling-policy priority``,
``max_model_len`` 512, one core each) behind our router (its own process, ``leastloaded``, the model with
``engine_priority: true``, the default saturation rule: 5 waiting or KV usage 0.8) with the Batch API on
(``batch_api``, a fresh ``batch_dir`` per run, ``batch_concurrency`` from ``--concurrency``, default 8 as the
router's). Batch lines go through the director at sheddable priority (and behind interactive work in the
engines' priority queues); interactive requests are standard priority.

First the capacity C (requests/s) of the pair: a closed loop of non-streamed chat completions (32 tokens)
at concurrency 16 for 15 s, twice, median (skipped when ``--rate`` is given). The interactive load is
open-loop Poisson arrivals at ``--load`` x C (default 0.5) for ``--duration`` s (default 60), each a
streamed chat completion (``stream: true``, ``max_tokens`` = ``min_tokens`` = 32, one fixed prompt); TTFT
is the time from the request's intended send time (no coordinated omission) to the first chunk that
carries content. After the arrivals the run waits up to 120 s for what is outstanding.

Contenders, each on a fresh router with both engines idle (nothing running or waiting on their /metrics)
and the machine quiet (other processes below 0.15 core over 3 s, waited for up to 10 min: two cores run
everything, so other work skews the figures; each run reports the other processes' CPU in its window and
the report warns above 0.2 core) before it, in an order rotated every round (``--rounds``, default 3), the same arrival plan for every
interactive contender of a round:

- ``interactive-alone``: the interactive load, no batch;
- ``interactive+batch@N``: a batch of ``--batch-lines`` (default 5000) chat lines (``max_tokens`` =
  ``min_tokens`` = 32) uploaded with POST /v1/files and created with POST /v1/batches on a router with
  ``batch_concurrency`` N; once it is ``in_progress`` with N lines completed (steady state) the window
  starts with the interactive load; the batch's completed lines are read from ``request_counts`` at the
  window's start and end; after the window (and the interactive drain) the batch is cancelled;
- ``batch-alone@N``: the same batch and window with no interactive load.

``--concurrency 8,2`` runs a ``+batch`` / ``batch-alone`` pair for each N against one ``interactive-alone``.
Batch throughput = lines completed in the window x completion tokens per line (the mean of
``usage.completion_tokens`` over the cancelled batch's output file) / window seconds. Verdicts per N:
interactive p99 TTFT with the batch (median over rounds) within max(10%, the spread, max-min across rounds,
of ``interactive-alone``'s p99) of the p99 alone; interactive errors; and the batch's throughput beside
the interactive load as a fraction of the batch alone.

Usage: ``python benchmarks/batch/interactive.py [--duration 60] [--rounds 3] [--batch-lines 5000]
[--concurrency 8[,4,2]] [--load 0.5 | --rate R] [--out PATH]``; prints a table and writes
``benchmarks/results/batch_interactive.{md,json}`` (or ``PATH.{md,json}``).
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
TOKENS = 32
ALONE, MIXED, BATCH_ALONE = "interactive-alone", "interactive+batch", "batch-alone"
DRAIN_S = 120.0
BATCH_START_S = 120.0  # created to in_progress with its first lines done, at most
IDLE_S = 180.0
QUIET_CORES = 0.15  # other processes' CPU (cores) below which a run may start
QUIET_WAIT_S = 600.0  # then a run starts anyway (its "other CPU" figure says so)
DISTURBED_CORES = 0.2  # other processes' CPU during a run's window above which the report warns
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a short story about a cat."}],
    "max_tokens": TOKENS,
    "min_tokens": TOKENS,
}
STREAM_BODY = BODY | {"stream": True}
METRIC_LINES = "vllm_stack_router_batch_lines_total"


def router_config(backends: list[str], batch_dir: Path, concurrency: int, reserve: int | None) -> dict:
    reserved = {} if reserve is None else {"batch_reserve_slots": reserve}
    return {
        **reserved,
        "static_backends": backends,
        "routing_logic": "leastloaded",
        "models": [{"name": MODEL, "engine_priority": True}],
        "queue_timeout": 60,
        "batch_api": True,
        "batch_dir": str(batch_dir),
        "batch_concurrency": concurrency,
    }


def cpu_sample(groups: list[int]) -> tuple[float, float]:
    """(CPU seconds the machine spent busy, of which the processes of ``groups``, process-group ids: the
    engines, the router, this script) since boot; their difference over a run is other work on the machine,
    which disturbs the figures (two cores run everything here)."""
    tick = os.sysconf("SC_CLK_TCK")
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    busy = sum(
        int(v) for i, v in enumerate(fields) if i not in (3, 4, 8, 9)
    )  # not idle, iowait, guest (in user)
    mine = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        rest = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ... utime(11) stime(12)
        if int(rest[2]) in groups:
            mine += int(rest[11]) + int(rest[12])
    return busy / tick, mine / tick


def other_cores(before: tuple[float, float], after: tuple[float, float], seconds: float) -> float:
    """Cores' worth of CPU used by other processes between two :func:`cpu_sample`."""
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / seconds


def wait_quiet(groups: list[int], timeout: float = QUIET_WAIT_S) -> float:
    """Until other processes use less than ``QUIET_CORES`` over 3 s (or ``timeout``); the seconds waited."""
    start = time.monotonic()
    while True:
        before = cpu_sample(groups)
        time.sleep(3)
        if other_cores(before, cpu_sample(groups), 3) < QUIET_CORES or time.monotonic() - start > timeout:
            return time.monotonic() - start


def batch_file(lines: int) -> bytes:
    out = []
    for n in range(lines):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Summarize item {n} of the catalogue."}],
            "max_tokens": TOKENS,
            "min_tokens": TOKENS,
        }
        out.append(
            json.dumps(
                {"custom_id": f"line-{n}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
        )
    return ("\n".join(out) + "\n").encode()


def arrival_plan(rate: float, duration: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    plan: list[float] = []
    t = rng.expovariate(rate)
    while t < duration:
        plan.append(t)
        t += rng.expovariate(rate)
    return plan


async def interactive(client: httpx.AsyncClient, plan: list[float], t0: float) -> dict:
    """The arrivals of ``plan`` (seconds after ``t0``), each a streamed chat completion: outcomes, TTFT and
    end-to-end latency (seconds from the intended send time, of complete 200 streams only)."""
    out = {"sent": 0, "ok": 0, "rejected": 0, "other": 0, "unfinished": 0, "ttft": [], "e2e": []}

    async def one(at: float) -> None:
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        out["sent"] += 1
        intended = t0 + at
        first: float | None = None
        try:
            async with client.stream("POST", "/v1/chat/completions", json=STREAM_BODY) as r:
                if r.status_code != 200:
                    await r.aread()
                    out["rejected" if r.status_code == 429 else "other"] += 1
                    return
                finished = False
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        finished = True
                    elif first is None:
                        choices = json.loads(data).get("choices") or [{}]
                        if (choices[0].get("delta") or {}).get("content"):
                            first = time.monotonic() - intended
        except httpx.HTTPError:
            out["other"] += 1
            return
        if not finished or first is None:
            out["other"] += 1
            return
        out["ok"] += 1
        out["ttft"].append(first)
        out["e2e"].append(time.monotonic() - intended)

    tasks = [asyncio.create_task(one(at)) for at in plan]
    duration = plan[-1] if plan else 0.0
    await asyncio.sleep(max(0.0, t0 + duration - time.monotonic()))
    _, pending = await asyncio.wait(tasks, timeout=DRAIN_S) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    out["unfinished"] = len(pending)
    await asyncio.gather(*pending, return_exceptions=True)
    return out


async def counts(client: httpx.AsyncClient, batch_id: str) -> dict:
    r = await client.get(f"/v1/batches/{batch_id}")
    r.raise_for_status()
    return r.json()


async def wait_batch(client: httpx.AsyncClient, batch_id: str, ok, within: float) -> dict:  # noqa: ANN001
    deadline = time.monotonic() + within
    while True:
        batch = await counts(client, batch_id)
        if ok(batch):
            return batch
        if batch["status"] in ("failed", "expired", "cancelled", "completed") or time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch_id}: {json.dumps(batch)}")
        await asyncio.sleep(0.1)


async def router_lines(client: httpx.AsyncClient) -> dict[str, float]:
    """The router's batch_lines_total by outcome (completed, failed, retried)."""
    text = (await client.get("/metrics")).text
    figures: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(METRIC_LINES + "{"):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            figures[outcome] = float(line.rsplit(" ", 1)[1])
    return figures


async def run_one(
    url: str,
    contender: str,
    plan: list[float],
    duration: float,
    content: bytes,
    concurrency: int,
    groups: list[int],
) -> dict:
    with_batch = contender != ALONE
    with_load = not contender.startswith(BATCH_ALONE)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    timeout = httpx.Timeout(DRAIN_S + duration, connect=10)
    result: dict = {}
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        batch_id = None
        if with_batch:
            batch_id = await engine_bench.create_batch(client, content)
            started = time.monotonic()
            await wait_batch(
                client,
                batch_id,
                lambda b: b["status"] == "in_progress" and b["request_counts"]["completed"] >= concurrency,
                BATCH_START_S,
            )
            result["batch_warmup_s"] = time.monotonic() - started
            before = (await counts(client, batch_id))["request_counts"]
            lines_before = await router_lines(client)
        cpu0 = cpu_sample(groups)
        t0 = time.monotonic()
        load = asyncio.create_task(interactive(client, plan, t0)) if with_load else None
        await asyncio.sleep(max(0.0, t0 + duration - time.monotonic()))
        result["other_cpu_cores"] = other_cores(cpu0, cpu_sample(groups), time.monotonic() - t0)
        if with_batch:
            after = (await counts(client, batch_id))["request_counts"]
            window = time.monotonic() - t0
            lines_after = await router_lines(client)
        if load is not None:
            res = await load
            ttft, e2e = res.pop("ttft"), res.pop("e2e")
            result["interactive"] = res | {
                "ttft_p50_ms": engine_bench.percentile_ms(ttft, 0.5),
                "ttft_p90_ms": engine_bench.percentile_ms(ttft, 0.9),
                "ttft_p99_ms": engine_bench.percentile_ms(ttft, 0.99),
                "e2e_p50_ms": engine_bench.percentile_ms(e2e, 0.5),
                "e2e_p99_ms": engine_bench.percentile_ms(e2e, 0.99),
            }
        if with_batch:
            cancel = await client.post(f"/v1/batches/{batch_id}/cancel")
            cancel.raise_for_status()
            ended = await wait_batch(client, batch_id, lambda b: b["status"] == "cancelled", DRAIN_S)
            tokens = []
            if ended["output_file_id"]:
                body = (await client.get(f"/v1/files/{ended['output_file_id']}/content")).content
                for line in body.splitlines():
                    doc = json.loads(line)
                    tokens.append(doc["response"]["body"]["usage"]["completion_tokens"])
            per_line = statistics.mean(tokens) if tokens else float(TOKENS)
            done = after["completed"] - before["completed"]
            result["batch"] = {
                "window_s": window,
                "lines_completed": done,
                "lines_failed": after["failed"] - before["failed"],
                "tokens_per_line": per_line,
                "tokens_per_s": done * per_line / window,
                "shed_retries": lines_after.get("retried", 0) - lines_before.get("retried", 0),
                "exhausted": after["completed"] + after["failed"] >= after["total"],
                "completed_at_cancel": ended["request_counts"]["completed"],
                "failed_at_cancel": ended["request_counts"]["failed"],
            }
    return result


def stat(vals: list[float]) -> dict | None:
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "raw": vals}


INTERACTIVE_FIGS = ("sent", "ok", "rejected", "other", "unfinished", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
                    "e2e_p99_ms")  # fmt: skip
BATCH_FIGS = ("lines_completed", "tokens_per_s", "shed_retries")


def contenders(concurrencies: list[int]) -> list[str]:
    names = [ALONE]
    for c in concurrencies:
        names += [f"{MIXED}@{c}", f"{BATCH_ALONE}@{c}"]
    return names


def concurrency_of(contender: str) -> int | None:
    return int(contender.rsplit("@", 1)[1]) if "@" in contender else None


def summarize(rounds: list[dict], names: list[str]) -> dict:
    table: dict = {}
    for c in names:
        runs = [r[c] for r in rounds if c in r]
        row: dict = {}
        if runs and "interactive" in runs[0]:
            row["interactive"] = {f: stat([r["interactive"][f] for r in runs]) for f in INTERACTIVE_FIGS}
            row["interactive"]["errors"] = stat(
                [
                    r["interactive"]["rejected"] + r["interactive"]["other"] + r["interactive"]["unfinished"]
                    for r in runs
                ]
            )
        if runs and "batch" in runs[0]:
            row["batch"] = {f: stat([r["batch"][f] for r in runs]) for f in BATCH_FIGS}
        row["other_cpu_cores"] = stat([r.get("other_cpu_cores") for r in runs])
        table[c] = row
    return table


def verdicts(summary: dict, rounds: list[dict], concurrencies: list[int]) -> tuple[list[str], dict]:
    """Per batch concurrency: the p99 criterion, interactive errors, and the batch's share of its throughput."""
    alone = summary[ALONE]["interactive"]["ttft_p99_ms"]
    spread = alone["max"] - alone["min"]
    allowed = max(0.10 * alone["median"], spread)
    figures: dict = {"p99_alone_ms": alone["median"], "p99_spread_ms": spread, "p99_allowed_ms": allowed}
    lines = []
    for c in concurrencies:
        mixed_name = f"{MIXED}@{c}"
        mixed = summary[mixed_name]["interactive"]["ttft_p99_ms"]
        b_mixed = summary[mixed_name]["batch"]["tokens_per_s"]
        b_alone = summary[f"{BATCH_ALONE}@{c}"]["batch"]["tokens_per_s"]
        paired = [
            r[mixed_name]["interactive"]["ttft_p99_ms"] / r[ALONE]["interactive"]["ttft_p99_ms"]
            for r in rounds
        ]
        ok = mixed["median"] - alone["median"] <= allowed
        share = b_mixed["median"] / b_alone["median"] if b_alone["median"] else None
        errors = summary[mixed_name]["interactive"]["errors"]["max"]
        figures[str(c)] = {
            "p99_ms": mixed["median"],
            "p99_ratio": mixed["median"] / alone["median"],
            "p99_ratio_per_round": paired,
            "p99_pass": ok,
            "interactive_errors_max": errors,
            "batch_tokens_per_s": b_mixed["median"],
            "batch_alone_tokens_per_s": b_alone["median"],
            "batch_share": share,
        }
        lines.append(
            f"{'PASS' if ok else 'FAIL'}: batch_concurrency {c}: interactive p99 TTFT {mixed['median']:.0f} ms with "
            f"the batch vs {alone['median']:.0f} ms alone (x{mixed['median'] / alone['median']:.2f}; per round "
            + ", ".join(f"x{p:.2f}" for p in paired)
            + f"), allowed +{allowed:.0f} ms = max(10%, alone's p99 spread {spread:.0f} ms); interactive errors "
            f"(worst round) {errors:.0f}; batch {b_mixed['median']:.0f} tokens/s beside the load = "
            + (f"{share:.0%}" if share is not None else "-")
            + f" of the batch alone ({b_alone['median']:.0f} tokens/s)"
        )
    return lines, figures


COLUMNS = ("contender", "sent", "200", "errors", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "e2e p99 ms",
           "batch lines", "batch tokens/s", "batch sheds", "other CPU (cores)")  # fmt: skip


def rows(report: dict) -> list[list[str]]:
    out = []
    for c in report["contenders"]:
        s = report["summary"][c]
        i = s.get("interactive")
        b = s.get("batch")
        row = [c]
        if i:
            figs = ("sent", "ok", "errors", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_p99_ms")
            row += [engine_bench.spread_cell(i[f]) for f in figs]
        else:
            row += ["-"] * 7
        if b:
            row += [
                engine_bench.spread_cell(b[f]) for f in ("lines_completed", "tokens_per_s", "shed_retries")
            ]
        else:
            row += ["-"] * 3
        row.append(engine_bench.spread_cell(s.get("other_cpu_cores"), 2))
        out.append(row)
    return out


def reading(report: dict) -> str:
    s = report["summary"]
    v = report["verdict_figures"]
    ia = s[ALONE]["interactive"]
    parts = []
    for c in report["concurrencies"]:
        ib = s[f"{MIXED}@{c}"]["interactive"]
        f = v[str(c)]
        sheds = s[f"{MIXED}@{c}"]["batch"]["shed_retries"]
        parts.append(
            f"with {c} batch lines in flight, interactive TTFT p50 {ib['ttft_p50_ms']['median']:.0f} ms and p99 "
            f"{ib['ttft_p99_ms']['median']:.0f} ms (x{f['p99_ratio']:.2f}), the batch at "
            + (f"{f['batch_share']:.0%}" if f["batch_share"] is not None else "-")
            + f" of its throughput alone, {sheds['median']:.0f} batch sends shed in the window"
        )
    text = (
        f"At {report['rate_rps']:.1f} interactive requests/s alone, TTFT p50 is {ia['ttft_p50_ms']['median']:.0f} ms "
        f"and p99 {ia['ttft_p99_ms']['median']:.0f} ms; " + "; ".join(parts) + ". "
    )
    within = [c for c in report["concurrencies"] if v[str(c)]["p99_ratio"] <= 1.10]
    text += (
        "Against 10% alone (without the allowance of the alone rounds' spread, "
        f"{v['p99_spread_ms']:.0f} ms here), p99 holds at batch_concurrency "
        + (", ".join(map(str, within)) if within else "none of those run")
        + ". "
    )
    shed_max = max(s[f"{MIXED}@{c}"]["batch"]["shed_retries"]["max"] for c in report["concurrencies"])
    if shed_max < 1:
        text += (
            "The director shed (almost) nothing: at this load the engines stay below the saturation rule (5 "
            "waiting), so the batch keeps its lines in flight the whole time. "
        )
    text += (
        "What interactive requests lose beside a batch is the running slots its lines hold (a request that "
        "finds every slot of its engine taken waits, first in the engine's priority queue, for one to end: "
        "vLLM does not preempt for priority while a slot, rather than KV, is short) and the longer decode steps "
        "of fuller engines on a shared core. Two cores run both engines, the router and the load generator, so "
        "absolute figures are this machine's; the comparison between contenders is the point."
    )
    return text


def render(report: dict) -> str:
    cap = report["capacity_rps"]
    load = (
        f"{report['load']:g} x C, C = {cap['median']:.1f} requests/s (closed loop at 16, median of {len(cap['raw'])})"
        if cap
        else "a fixed rate (--rate)"
    )
    concurrencies = ", ".join(str(c) for c in report["concurrencies"])
    lines = [
        "# Batch API beside interactive traffic",
        "",
        f"`{report['command']}` on {report['machine']}: two vLLM engines (CPU build, tiny model, `--max-num-seqs 4 "
        "--scheduling-policy priority`, one core each) behind our router (`leastloaded`, the model with "
        f"`engine_priority: true`, saturation rule 5 waiting / KV 0.8, `batch_concurrency` {concurrencies}: the "
        "number after @). "
        f"Interactive load: streamed chat (`max_tokens` = `min_tokens` = {TOKENS}), Poisson at "
        f"{report['rate_rps']:.2f} requests/s ({load}) for {report['duration_s']:g} s; TTFT = first content chunk, "
        f"from the intended send time. Batch: {report['batch_lines']} chat lines of {TOKENS} tokens, in steady "
        "state when the window starts; its throughput = lines completed in the window (request_counts) x "
        "completion tokens per line / window; sheds = the router's batch_lines_total{outcome=retried} in the "
        f"window; other CPU = cores' worth of CPU the machine spent outside the benchmark's processes during the "
        f"window (other work on the machine; a run starts once it is below {QUIET_CORES} over 3 s). "
        f"{report['rounds']} rounds, contenders rotated, one fresh router each; medians over the rounds, "
        f"min-max in brackets. The run took {report['wall_s'] / 60:.1f} min.",
        "",
        *engine_bench.markdown_table(COLUMNS, rows(report)),
    ]
    lines += ["", *report["verdicts"], "", "## Reading", "", report["reading"], ""]
    return "\n".join(lines)


def print_table(report: dict) -> None:
    engine_bench.print_console_table(
        f"Batch beside interactive ({report['rate_rps']:.2f} interactive requests/s)",
        COLUMNS,
        rows(report),
        left_columns=1,
        width=200,
        notes=report["verdicts"],
        fallback_markdown=render(report),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of each run's window")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-lines", type=int, default=5000)
    ap.add_argument(
        "--concurrency",
        default="8",
        help="the router's batch_concurrency; a comma list (8,2) runs a with/without-load pair for each",
    )
    ap.add_argument(
        "--load", type=float, default=0.5, help="interactive rate as a fraction of the capacity C"
    )
    ap.add_argument("--rate", type=float, default=None, help="interactive requests/s (skips measuring C)")
    ap.add_argument(
        "--reserve-slots",
        type=int,
        default=None,
        help="the router's batch_reserve_slots (running slots per engine left to interactive requests; "
        "default: the router's, 1)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "batch_interactive"))
    args = ap.parse_args(argv)
    try:
        concurrencies = [int(c) for c in str(args.concurrency).split(",") if c]
    except ValueError:
        ap.error("--concurrency: integers, comma-separated")
    if not concurrencies or min(concurrencies) < 1 or args.rounds < 1:
        ap.error("--concurrency and --rounds must be >= 1")
    names = contenders(concurrencies)
    begun = time.monotonic()

    engines, log_dir = engine_bench.launch_tiny_engines(
        MODEL, "batch-interactive-", ["--max-num-seqs", "4", "--scheduling-policy", "priority"]
    )
    router: subprocess.Popen[bytes] | None = None
    caps: list[float] = []
    rounds: list[dict] = []
    content = batch_file(args.batch_lines)
    try:
        tb.wait_ready(engines, 420)
        backends = [e.url for e in engines]
        if args.rate is None:
            config = router_config(backends, log_dir / "batch-capacity", concurrencies[0], args.reserve_slots)
            caps = engine_bench.measure_capacity(engines, config, log_dir, BODY)
            rate = args.load * statistics.median(caps)
        else:
            rate = args.rate
        print(f"interactive rate: {rate:.2f} requests/s", flush=True)
        for i in range(args.rounds):
            plan = arrival_plan(rate, args.duration, seed=1000 + i)
            order = [names[(j + i) % len(names)] for j in range(len(names))]
            result: dict = {}
            for contender in order:
                name = f"{contender}-{i}".replace("+", "-").replace("@", "-c")
                concurrency = concurrency_of(contender) or concurrencies[0]
                config = router_config(backends, log_dir / f"batch-{name}", concurrency, args.reserve_slots)
                router, url = engine_bench.start_router(config, log_dir, name)
                idle = engine_bench.wait_idle(engines, IDLE_S)
                groups = [os.getpgrp(), router.pid, *(e.process.pid for e in engines)]
                quiet = wait_quiet(groups)
                res = asyncio.run(run_one(url, contender, plan, args.duration, content, concurrency, groups))
                tb.stop_process(router)
                router = None
                res["idle_wait_s"] = idle
                res["quiet_wait_s"] = quiet
                result[contender] = res
                print(f"round {i + 1} {contender}: " + json.dumps(res), flush=True)
            rounds.append(result)
    finally:
        engine_bench.stop_testbed(router, engines)
    summary = summarize(rounds, names)
    verdict_lines, verdict_figures = verdicts(summary, rounds, concurrencies)
    command = "python benchmarks/batch/interactive.py " + " ".join(
        [f"--duration {args.duration:g}", f"--rounds {args.rounds}", f"--batch-lines {args.batch_lines}",
         f"--concurrency {','.join(map(str, concurrencies))}"]
        + ([f"--reserve-slots {args.reserve_slots}"] if args.reserve_slots is not None else [])
        + ([f"--rate {args.rate:g}"] if args.rate is not None else [f"--load {args.load:g}"])
    )  # fmt: skip
    report = {
        "command": command,
        "duration_s": args.duration,
        "rounds": args.rounds,
        "batch_lines": args.batch_lines,
        "concurrencies": concurrencies,
        "contenders": names,
        "load": args.load if args.rate is None else None,
        "rate_rps": rate,
        "machine": engine_bench.machine_summary(),
        "capacity_rps": {"median": statistics.median(caps), "raw": caps} if caps else None,
        "summary": summary,
        "raw": rounds,
        "verdicts": verdict_lines,
        "verdict_figures": verdict_figures,
        "wall_s": time.monotonic() - begun,
    }
    disturbed = [
        f"round {i + 1} {c} ({r[c]['other_cpu_cores']:.2f})"
        for i, r in enumerate(rounds)
        for c in names
        if r[c].get("other_cpu_cores", 0) > DISTURBED_CORES
    ]
    if disturbed:
        verdict_lines.append(
            f"WARNING: other processes used more than {DISTURBED_CORES} core during: " + ", ".join(disturbed)
        )
    for c in names:
        if any(r[c].get("batch", {}).get("exhausted") for r in rounds):
            verdict_lines.append(f"WARNING: {c} ran out of batch lines within a window: raise --batch-lines")
    report["reading"] = reading(report)
    engine_bench.write_report(args.out, report, render, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
