"""Routing-quality benchmark: how well each router places requests on 2 real vLLM engines for cache hits.

Two CPU vLLM engines (the test bed's `mid` model, each pinned to its own core, a small KV cache set
with --num-gpu-blocks-override, KV events on, VLLM_SERVER_DEV_MODE=1 for POST /reset_prefix_cache)
are started once and shared by every contender. Before each run both engines' prefix caches are reset
and the engines must be idle; each contender is a fresh router process; the order of contenders is
rotated between repeats. The engines' own counters are the referee (hit rate, requests per engine).
An oracle (one engine with both engines' KV together, no router) runs the same workloads afterwards,
alone: the hit rate that perfect placement could at best reach.

Results: benchmarks/results/routing_quality.json, .md and .png (--out). See README.md for the method.

Usage: ``make bench-routing`` or ``.venv/bin/python benchmarks/routing/quality.py [--quick]
[--workloads a,b,c,d,e] [--contenders NAME,...] [--repeat N] [--scale F] [--requests F]
[--kv-blocks N] [--concurrency N] [--no-oracle] [--out DIR]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "router"))

import contenders as cont  # noqa: E402
import workloads as wl  # noqa: E402
from client import RunResult, measured_run  # noqa: E402

cont.add_router_benchmarks_to_path()

from vllm_stack_dev.paths import cache_dir  # noqa: E402
from vllm_stack_dev.testbed import engines as tb  # noqa: E402
from vllm_stack_dev.testbed.inference_pool import PoolSite, pool_site  # noqa: E402
from vllm_stack_dev.testbed.models import build_model  # noqa: E402

MODEL = "mid"
BLOCK_SIZE = 128  # vLLM's CPU KV block size (FACTS.md)
ENGINE_READY_TIMEOUT = 600.0


@dataclass(frozen=True)
class Options:
    """The parsed command line, after --quick has filled in its defaults."""

    workloads: list[str]
    contenders: list[str]
    repeat: int
    oracle_repeat: int
    scale: float
    requests: float
    kv_blocks: int
    concurrency: int
    max_tokens: int
    oracle: bool
    out: Path
    seed: int

    @property
    def engine_blocks(self) -> int:
        """Blocks per engine actually started: --kv-blocks x --scale (at least 16)."""
        return max(16, round(self.kv_blocks * self.scale))

    @property
    def kv_tokens(self) -> int:
        return self.engine_blocks * BLOCK_SIZE


def parse_args(argv: list[str] | None = None) -> Options:
    """Command line -> Options. --quick: scale 0.5, half the requests, 1 repeat, workloads a,c."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--workloads", help=f"comma-separated, from {','.join(wl.WORKLOAD_NAMES)} (default all)")
    ap.add_argument("--contenders", help=f"comma-separated, from {','.join(cont.CONTENDERS)} (default all)")
    ap.add_argument("--repeat", type=int, help="runs per contender and workload, order rotated (default 3)")
    ap.add_argument(
        "--oracle-repeat", type=int, default=1, help="runs of the oracle per workload (default 1)"
    )
    ap.add_argument("--scale", type=float, help="multiplies prompt lengths and the KV blocks (default 1)")
    ap.add_argument("--requests", type=float, help="multiplies the number of users/requests (default 1)")
    ap.add_argument(
        "--kv-blocks", type=int, default=64, help="KV blocks per engine at scale 1 (128 tokens each)"
    )
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight (closed loop; default 4)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request (default 8)")
    ap.add_argument("--no-oracle", action="store_true", help="skip the single-engine oracle")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    ap.add_argument("--seed", type=int, default=0, help="workload content seed (default 0)")
    ap.add_argument("--quick", action="store_true", help="smoke run: scale 0.5, requests 0.5, repeat 1, a,c")
    args = ap.parse_args(argv)
    quick = args.quick
    names = (args.workloads or ("a,c" if quick else ",".join(wl.WORKLOAD_NAMES))).split(",")
    chosen = (args.contenders or ",".join(cont.CONTENDERS)).split(",")
    for name in names:
        if name not in wl.WORKLOAD_NAMES:
            ap.error(f"unknown workload {name!r}")
    for name in chosen:
        if name not in cont.CONTENDERS:
            ap.error(f"unknown contender {name!r}; choose from {', '.join(cont.CONTENDERS)}")
    return Options(
        workloads=names,
        contenders=chosen,
        repeat=args.repeat or (1 if quick else 3),
        oracle_repeat=args.oracle_repeat,
        scale=args.scale or (0.5 if quick else 1.0),
        requests=args.requests or (0.5 if quick else 1.0),
        kv_blocks=args.kv_blocks,
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        oracle=not args.no_oracle,
        out=Path(args.out),
        seed=args.seed,
    )


def build_workloads(options: Options, model_dir: Path) -> dict[str, wl.Workload]:
    """The chosen workloads, sized for one engine's KV; fails early if a prompt would not fit."""
    corpus = resources.files("vllm_stack_dev.testbed").joinpath("corpus.txt").read_text(encoding="utf-8")
    source = wl.TextSource(corpus, model_dir / "tokenizer.json")
    size = wl.Sizing(options.kv_tokens, options.scale, options.requests, options.seed)
    built = {name: wl.build(name, size, source) for name in options.workloads}
    limit = max_model_len(options)
    for workload in built.values():
        longest = wl.estimated_prompt_tokens(workload, source)
        if longest + options.max_tokens > limit:
            raise SystemExit(f"workload {workload.name}: prompts up to ~{longest} tokens exceed {limit}")
    return built


def max_model_len(options: Options) -> int:
    """The engines' context limit: 4,096 tokens, or less when one engine's KV is small.

    vLLM refuses to start unless one request of max_model_len fits in the KV cache, and it keeps one
    block back (32 blocks of 128 tokens allow 3,968, measured), hence one block less than the KV."""
    return min(4096, options.kv_tokens - BLOCK_SIZE)


def engine_spec(model_dir: Path, blocks: int, context: int) -> tb.EngineSpec:
    """The engine every run uses: KV events on, LoRA off, `blocks` KV blocks, cache reset allowed."""
    return tb.EngineSpec(
        model_dir=model_dir,
        served_model_name=MODEL,
        enable_lora=False,
        kv_events=True,
        max_model_len=context,
        extra_args=["--num-gpu-blocks-override", str(blocks)],
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )


def start_engines(
    spec: tb.EngineSpec,
    cpus: list[int | None],
    log_dir: Path,
    prefix: str,
    pool: PoolSite | None = None,
) -> tb.EngineGroup:
    """Start one engine per entry of `cpus` (pinned there), in parallel; wait until all serve. With a
    `pool`, engine i listens at the pool's Pod i's IP and port (the address a picker names) and publishes
    its KV events on the pool's KV-event port at that IP (where llm-d's precise profile connects)."""
    group = tb.EngineGroup()
    try:
        for index, cpu in enumerate(cpus):
            where = (
                {"host": pool.hosts[index], "port": pool.port, "kv_events_port": pool.kv_events_port}
                if pool is not None
                else {}
            )
            group.add(tb.launch(spec, name=f"{prefix}-{index}", cpu=cpu, log_dir=log_dir, **where))
        tb.wait_ready(group.engines, ENGINE_READY_TIMEOUT)
    except BaseException:
        group.stop()
        raise
    return group


def one_run(
    contender: cont.Contender,
    setup: cont.Setup,
    workload: wl.Workload,
    options: Options,
    log_dir: Path,
    tag: str,
) -> RunResult:
    """A fresh router for `contender`, the workload through it, the router stopped again."""
    router = cont.start(contender, setup, tb.free_port(), tb.free_port(), log_dir, tag)
    try:
        cont.wait_ready(router, setup.model, contender.ready_timeout)
        result = asyncio.run(
            measured_run(
                router.url, setup.engine_urls, workload, setup.model, options.concurrency, options.max_tokens
            )
        )
        result.router_metrics = router.policy_metrics()
        return result
    finally:
        router.stop()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def run_metrics(result: RunResult) -> dict[str, float]:
    """The report's figures for one run (engine counters for cache and balance, client for latency)."""
    ok = [o for o in result.outcomes if o.ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    hits = sum(d["vllm:prefix_cache_hits_total"] for d in result.engine_deltas)
    queries = sum(d["vllm:prefix_cache_queries_total"] for d in result.engine_deltas)
    per_engine = [d["vllm:request_success_total"] for d in result.engine_deltas]
    mean_requests = statistics.fmean(per_engine) if per_engine else 0.0
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_mean_ms": statistics.fmean(ttfts) * 1e3 if ttfts else float("nan"),
        "ttft_p90_ms": percentile(ttfts, 0.9) * 1e3 if ttfts else float("nan"),
        "requests_per_s": len(ok) / result.wall_s,
        "output_tokens_per_s": sum(o.output_tokens for o in ok) / result.wall_s,
        "imbalance": max(per_engine) / mean_requests if mean_requests else float("nan"),
        "errors": float(len(result.outcomes) - len(ok)),
        "wall_s": result.wall_s,
        "prompt_tokens": float(sum(o.prompt_tokens for o in ok)),
        "requests_per_engine": per_engine,  # type: ignore[dict-item]
        "router_metrics": result.router_metrics,  # type: ignore[dict-item]
    }


def rotated(items: list[str], shift: int) -> list[str]:
    """`items` rotated left by `shift`: repeat i starts with a different contender."""
    shift %= max(1, len(items))
    return items[shift:] + items[:shift]


def run_contenders(
    options: Options, active: list[str], setup: cont.Setup, built: dict[str, wl.Workload], log_dir: Path
) -> dict[str, dict[str, list[dict]]]:
    """Every (repeat, workload, contender) run; runs[workload][contender] = per-repeat metrics."""
    runs: dict[str, dict[str, list[dict]]] = {w: {c: [] for c in active} for w in built}
    for repeat in range(options.repeat):
        for name, workload in built.items():
            for contender_name in rotated(active, repeat):
                tag = f"r{repeat}-{name}-{contender_name}"
                started = time.monotonic()
                try:
                    result = one_run(cont.CONTENDERS[contender_name], setup, workload, options, log_dir, tag)
                except (RuntimeError, TimeoutError) as exc:
                    print(f"  {tag}: FAILED {(str(exc).strip().splitlines() or ['?'])[-1]}", flush=True)
                    runs[name][contender_name].append({"failed": str(exc)[:2000]})
                    continue
                metrics = run_metrics(result)
                runs[name][contender_name].append(metrics)
                print(f"  {tag}: {short(metrics)} ({time.monotonic() - started:.0f} s)", flush=True)
    return runs


def run_oracle(
    options: Options, model_dir: Path, built: dict[str, wl.Workload], log_dir: Path
) -> dict[str, list[dict]]:
    """One engine with 2 x the blocks, on one core, no router: the same workloads, --oracle-repeat times."""
    spec = engine_spec(model_dir, 2 * options.engine_blocks, max_model_len(options))
    results: dict[str, list[dict]] = {name: [] for name in built}
    print(f"==> oracle: one engine with {2 * options.engine_blocks} KV blocks", flush=True)
    with start_engines(spec, [tb.default_cpus(1)[0]], log_dir, "oracle") as group:
        engine = group[0]
        for repeat in range(options.oracle_repeat):
            for name, workload in built.items():
                result = asyncio.run(
                    measured_run(
                        engine.url, [engine.url], workload, MODEL, options.concurrency, options.max_tokens
                    )
                )
                metrics = run_metrics(result)
                results[name].append(metrics)
                print(f"  r{repeat}-{name}-oracle: {short(metrics)}", flush=True)
    return results


def short(metrics: dict) -> str:
    """One line of a run's main figures, for progress output."""
    return (
        f"hit {metrics['hit_rate']:.1%}, TTFT {metrics['ttft_mean_ms']:.0f}/{metrics['ttft_p90_ms']:.0f} ms "
        f"(mean/p90), {metrics['requests_per_s']:.2f} req/s, imbalance {metrics['imbalance']:.2f}, "
        f"errors {metrics['errors']:.0f}, {metrics['wall_s']:.0f} s"
    )


STAT_KEYS = (
    "hit_rate",
    "ttft_mean_ms",
    "ttft_p90_ms",
    "requests_per_s",
    "output_tokens_per_s",
    "imbalance",
    "errors",
)


def aggregate(per_repeat: list[dict]) -> dict[str, dict[str, float]] | None:
    """Mean, min, max and stdev over the repeats that did not fail (None if all failed)."""
    good = [r for r in per_repeat if "failed" not in r]
    if not good:
        return None
    out: dict[str, dict[str, float]] = {}
    for key in STAT_KEYS:
        values = [r[key] for r in good]
        out[key] = {
            "mean": statistics.fmean(values),
            "min": min(values),
            "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": float(len(values)),
        }
    return out


def summarise(runs: dict, oracle: dict, contender_family: dict[str, str]) -> dict[str, dict[str, dict]]:
    """summary[workload][contender] = aggregates plus ratios to the oracle's hit rate and best Rust TTFT."""
    summary: dict[str, dict[str, dict]] = {}
    for workload, by_contender in runs.items():
        rows = {name: aggregate(per_repeat) for name, per_repeat in by_contender.items()}
        oracle_stats = aggregate(oracle.get(workload, []))
        rust_ttfts = [
            row["ttft_mean_ms"]["mean"]
            for name, row in rows.items()
            if row and contender_family[name] == "rust"
        ]
        best_rust = min(rust_ttfts) if rust_ttfts else None
        summary[workload] = {}
        for name, row in rows.items():
            if row is None:
                summary[workload][name] = {"failed": True}
                continue
            row = dict(row)
            if oracle_stats and oracle_stats["hit_rate"]["mean"] > 0:
                row["hit_vs_oracle"] = row["hit_rate"]["mean"] / oracle_stats["hit_rate"]["mean"]
            if best_rust:
                row["ttft_vs_best_rust"] = row["ttft_mean_ms"]["mean"] / best_rust
            summary[workload][name] = row
        if oracle_stats:
            summary[workload]["oracle (1 engine, 2x KV)"] = oracle_stats
    return summary


def fmt_stat(stat: dict[str, float] | None, fmt: str, scale: float = 1.0) -> str:
    """`mean (min-max)` of a statistic, or `mean` alone for a single run."""
    if stat is None:
        return "-"
    mean = format(stat["mean"] * scale, fmt)
    if stat["n"] <= 1:
        return mean
    return f"{mean} ({format(stat['min'] * scale, fmt)}-{format(stat['max'] * scale, fmt)})"


COLUMNS = (
    "workload", "contender", "hit rate %", "vs oracle", "TTFT mean ms", "TTFT p90 ms",
    "vs best Rust", "req/s", "out tok/s", "imbalance", "errors",
)  # fmt: skip


def table_rows(summary: dict) -> list[list[str]]:
    """The report table's cells (shared by the rich table and the markdown)."""
    rows = []
    for workload, by_contender in summary.items():
        for name, row in by_contender.items():
            if row.get("failed"):
                rows.append([workload, name, "failed", *["-"] * (len(COLUMNS) - 3)])
                continue
            rows.append(
                [
                    workload,
                    name,
                    fmt_stat(row["hit_rate"], ".1f", 100),
                    f"{row['hit_vs_oracle']:.2f}" if "hit_vs_oracle" in row else "-",
                    fmt_stat(row["ttft_mean_ms"], ".0f"),
                    fmt_stat(row["ttft_p90_ms"], ".0f"),
                    f"{row['ttft_vs_best_rust']:.2f}" if "ttft_vs_best_rust" in row else "-",
                    fmt_stat(row["requests_per_s"], ".2f"),
                    fmt_stat(row["output_tokens_per_s"], ".1f"),
                    fmt_stat(row["imbalance"], ".2f"),
                    f"{row['errors']['mean'] * row['errors']['n']:.0f}",
                ]
            )
    return rows


def print_table(summary: dict) -> None:
    """The results as a rich table on the terminal."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Routing quality (2 engines; mean, (min-max) over repeats)")
    for column in COLUMNS:
        table.add_column(column, justify="left" if column in ("workload", "contender") else "right")
    for row in table_rows(summary):
        table.add_row(*row)
    Console(width=200).print(table)


def render_markdown(report: dict) -> str:
    """The markdown report: set-up, workloads, the table, skipped contenders."""
    cfg = report["config"]
    lines = [
        "# Routing quality: prefix-cache hits on 2 real vLLM engines",
        "",
        f"2 vLLM CPU engines (model `{MODEL}`, {cfg['engine_blocks']} KV blocks of {BLOCK_SIZE} tokens = "
        f"{cfg['kv_tokens']} tokens each, one core each); closed loop, {cfg['concurrency']} requests in flight, "
        f"streamed chat, {cfg['max_tokens']} output tokens, temperature 0; {cfg['repeat']} repeat(s), order of "
        f"contenders rotated, both prefix caches reset before every run; scale {cfg['scale']}, "
        f"requests x{cfg['requests']}. Oracle: one engine with both engines' KV together, alone, no router "
        "(its TTFT is one core's, not comparable; its hit rate is the target). "
        f"Hit rate: the engines' own prefix_cache_hits / queries over the run. Imbalance: max / mean requests "
        "per engine. `vs best Rust`: mean TTFT / the best Rust policy's mean TTFT on that workload. "
        f"Took {report['duration_s'] / 60:.1f} min; load average at start {report['host']['loadavg_at_start']}.",
        "",
        "| workload | description | requests | working set (x one engine's KV) | details |",
        "|---|---|---|---|---|",
    ]
    for name, w in report["workloads"].items():
        lines.append(
            f"| {name} | {w['description']} | {w['requests']} | {w['working_set_x_kv']:.2f} | "
            + ", ".join(f"{k} {v}" for k, v in w["details"].items())
            + " |"
        )
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(report["summary"])]
    if report["skipped"]:
        lines += ["", "Not measured:"]
        lines += [f"- {name}: {reason}" for name, reason in report["skipped"].items()]
    failures = [
        f"- workload {workload}, {name}, repeat {index}: {(run['failed'].strip().splitlines() or ['?'])[-1][:300]}"
        for workload, by_contender in report.get("runs", {}).items()
        for name, per_repeat in by_contender.items()
        for index, run in enumerate(per_repeat)
        if "failed" in run
    ]
    if failures:
        lines += ["", "Failed runs (router log tails in the JSON):", *failures]
    return "\n".join(lines) + "\n"


def write_report(report: dict, out: Path) -> None:
    """JSON, markdown and PNG under `out` (routing_quality.*)."""
    import plot

    out.mkdir(parents=True, exist_ok=True)
    base = out / "routing_quality"
    base.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    base.with_suffix(".md").write_text(render_markdown(report))
    plot.plot(report["summary"], base.with_suffix(".png"))
    print(f"results: {base}.json, .md, .png", flush=True)


def describe_workloads(built: dict[str, wl.Workload]) -> dict[str, dict]:
    """What each workload was, for the report."""
    return {
        name: {
            "description": w.description,
            "requests": len(w.requests),
            "working_set_tokens": w.working_set_tokens,
            "working_set_x_kv": w.working_set_x_kv,
            "details": w.details,
        }
        for name, w in built.items()
    }


def check_contenders(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the contenders that can run, {name: why not} for the others)."""
    skipped = {}
    for name in names:
        reason = cont.unavailable(name)
        if reason:
            skipped[name] = reason
            print(f"skipping {name}: {reason}", flush=True)
    return [n for n in names if n not in skipped], skipped


def terminate_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt so the same clean-up as Ctrl-C runs (engines, routers)."""

    def handler(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    """Engines once, every contender on every workload, the oracle, then the report."""
    options = parse_args(argv)
    terminate_on_sigterm()
    started = time.monotonic()
    load_at_start = list(os.getloadavg())
    model_dir = build_model(MODEL, cache_dir() / "models" / MODEL)
    built = build_workloads(options, model_dir)
    for name, w in built.items():
        print(
            f"workload {name}: {len(w.requests)} requests, working set {w.working_set_x_kv:.2f} x KV, {w.details}"
        )
    active, skipped = check_contenders(options.contenders)
    log_dir = Path(tempfile.mkdtemp(prefix="routing-quality-"))
    print(f"==> 2 engines, {options.engine_blocks} KV blocks each; logs in {log_dir}", flush=True)
    spec = engine_spec(model_dir, options.engine_blocks, max_model_len(options))
    runs: dict = {}
    oracle: dict = {}
    try:
        with contextlib.ExitStack() as stack:
            pool = None
            if any(cont.CONTENDERS[name].family == "upstream" for name in active):
                print(
                    "==> a test cluster with the engines' InferencePool (the upstream EPP reads it)",
                    flush=True,
                )
                pool = stack.enter_context(pool_site(log_dir, 2, tb.port_for_later()))
            group = stack.enter_context(start_engines(spec, tb.default_cpus(2), log_dir, "engine", pool))
            setup = cont.Setup(
                group.urls, [e.kv_events_port for e in group], MODEL, model_dir, BLOCK_SIZE, pool
            )
            runs = run_contenders(options, active, setup, built, log_dir)
        if options.oracle:
            oracle = run_oracle(options, model_dir, built, log_dir)
    except KeyboardInterrupt:
        print("interrupted: engines and routers stopped", file=sys.stderr)
        return 130
    except tb.EngineStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    families = {name: cont.CONTENDERS[name].family for name in active}
    report = {
        "config": {**asdict(options), "out": str(options.out), "engine_blocks": options.engine_blocks,
                   "kv_tokens": options.kv_tokens, "model": MODEL, "block_size": BLOCK_SIZE,
                   "max_model_len": max_model_len(options), "session_header": wl.SESSION_HEADER},
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(),
                 "loadavg_at_start": load_at_start, "loadavg_at_end": list(os.getloadavg())},
        "workloads": describe_workloads(built),
        "skipped": skipped,
        "runs": runs,
        "oracle_runs": oracle,
        "summary": summarise(runs, oracle, families),
        "duration_s": time.monotonic() - started,
        "logs": str(log_dir),
    }  # fmt: skip
    print_table(report["summary"])
    write_report(report, options.out)
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
