"""A noisy neighbour on a shared fleet: does one tenant's overload reach another tenant's latency?

Two real vLLM engines (CPU build, the tiny model, ``--max-num-seqs 4 --scheduling-policy priority``,
``max_model_len`` 512) behind our router (its own process, ``leastloaded``, priority on with engine
priorities, ``queue_timeout`` 30). Tenants are told apart by ``x-llm-d-inference-fairness-id``
(issue 51; a router that does not know tenants ignores it). First the capacity C (requests/s) of the
pair for the request shape used: a closed loop at concurrency 16 of non-streamed chat completions with
``max_tokens`` = ``min_tokens`` = 32. Then open-loop Poisson arrivals for ``--duration`` seconds of
streamed chat completions of that shape, TTFT taken from each request's intended send time (no
coordinated omission) to its first SSE event; after the arrivals the run waits up to 90 s and counts
what is left as unfinished. Before each run both engines must show nothing running or waiting.

Runs (``--runs``, interleaved per round):

- ``A-alone``: the quiet tenant at 0.3 x C, alone (its baseline);
- ``A-beside``: the quiet tenant at 0.3 x C beside the noisy one at 3 x C, both standard priority;
- ``B-evict-off`` / ``B-evict-on``: a critical tenant at 0.3 x C beside a sheddable batch-like tenant
  (128 tokens each) at 3 x C, with the router's eviction of in-flight sheddable requests off and on
  (``eviction_enabled``; ``B-evict-on`` needs a router that has the setting);
- ``C-sdk``: as ``A-beside``, the noisy tenant sending through the OpenAI SDK (``openai``,
  ``max_retries`` 5, which honours ``retry-after``): its requests counted as answered or raised.

Every request's outcome is counted (answered, 429 with and without ``retry-after``, 503, other
status, transport error, unfinished): none is lost silently.

Usage: ``python benchmarks/tenants/noisy_neighbour.py [--duration 20] [--rounds 1] [--runs ...]
[--label before] [--out PATH]``; prints a table and writes
``benchmarks/results/tenants_noisy_neighbour.{md,json}`` (or ``PATH.{md,json}``).
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
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "router", ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import engine_bench  # noqa: E402  benchmarks/engine_bench.py
import httpx  # noqa: E402
import yaml  # noqa: E402
from vllm_stack_dev.testbed import engines as tb  # noqa: E402

MODEL = "tiny-llama"
KEY = "bench-tenants-key"
TENANT_HEADER = "x-llm-d-inference-fairness-id"
DRAIN_S = 90.0
SDK_RETRIES = 5
PROMPT = [{"role": "user", "content": "Tell me a short story about a cat."}]


@dataclass(frozen=True)
class Tenant:
    """One tenant's load in a run: its name, rate in x C, priority class, tokens, and client."""

    name: str
    load: float
    priority: str = "standard"
    tokens: int = 32
    sdk: bool = False


QUIET = Tenant("quiet", 0.3)
NOISY = Tenant("noisy", 3.0)
CRITICAL = Tenant("critical", 0.3, "critical")
BATCH = Tenant("batch", 3.0, "sheddable", tokens=128)
# run -> (tenants, eviction on)
RUNS: dict[str, tuple[tuple[Tenant, ...], bool]] = {
    "A-alone": ((QUIET,), False),
    "A-beside": ((QUIET, NOISY), False),
    "B-evict-off": ((CRITICAL, BATCH), False),
    "B-evict-on": ((CRITICAL, BATCH), True),
    "C-sdk": ((QUIET, Tenant("noisy-sdk", 3.0, sdk=True)), False),
}
OUTCOMES = ("sent", "ok", "429_retry_after", "429_bare", "503", "other", "error", "unfinished")


#: --tenants: the noisy tenants' requests per minute, as a share of the fleet's capacity C
NOISY_LIMIT_SHARE = 0.6


def router_config(backends: list[str], eviction: bool, tenants_file: Path | None = None) -> dict:
    config = {
        "static_backends": backends,
        "routing_logic": "leastloaded",
        "priority_scheduling": True,
        "models": [{"name": MODEL, "engine_priority": True}],
        "queue_timeout": 30,
    }
    if eviction:  # only a router with the setting accepts the key (an unknown key is refused)
        config |= {"eviction_enabled": True, "eviction_after": 1.0}
    if tenants_file is not None:  # issue 51's tenants: declared, and requests held in the router
        # An engine with one request waiting is saturated: the rest wait in the router's queue, where
        # they leave by tenant in turn (the default 5 lets each engine queue five in arrival order).
        config |= {"tenants_file": str(tenants_file), "saturation_max_waiting": 1}
    return config


def write_tenants(log_dir: Path, cap: float) -> Path:
    """The tenants declaration of ``--tenants``: equal weights; the noisy tenants limited to
    NOISY_LIMIT_SHARE x C requests per minute (their excess refused 429 with retry-after), the quiet
    and critical ones unlimited."""
    limit = max(1, round(NOISY_LIMIT_SHARE * cap * 60))
    tenants = [{"name": name} for name in ("quiet", "critical")] + [
        {"name": name, "requests_per_minute": limit} for name in ("noisy", "noisy-sdk", "batch")
    ]
    path = log_dir / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return path


def router_env() -> dict[str, str]:
    """The router's environment: the API key that may raise a request to critical."""
    return os.environ | {"VLLM_STACK_PRIORITY_API_KEYS": KEY}


def headers(tenant: Tenant) -> dict[str, str]:
    h = {"x-request-priority": tenant.priority, TENANT_HEADER: tenant.name}
    if tenant.priority == "critical":
        h["authorization"] = f"Bearer {KEY}"
    return h


def body(tenant: Tenant, stream: bool) -> dict:
    return {"model": MODEL, "messages": PROMPT, "max_tokens": tenant.tokens, "min_tokens": tenant.tokens,
            "stream": stream}  # fmt: skip


async def _httpx_one(client: httpx.AsyncClient, tenant: Tenant, sent_at: float, out: dict) -> None:
    """One streamed request: TTFT at the first SSE event; the outcome counted whatever it is."""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body(tenant, True),
                                 headers=headers(tenant)) as r:  # fmt: skip
            if r.status_code != 200:
                await r.aread()
                if r.status_code == 429:
                    out["429_retry_after" if "retry-after" in r.headers else "429_bare"] += 1
                else:
                    out["503" if r.status_code == 503 else "other"] += 1
                return
            ttft = None
            broken = False
            async for line in r.aiter_lines():
                if line.startswith("data: ") and ttft is None:
                    ttft = time.monotonic() - sent_at
                if line.startswith('data: {"error"'):
                    broken = True
            if broken:
                out["evicted_midstream"] = out.get("evicted_midstream", 0) + 1
                out["other"] += 1
                return
            out["ok"] += 1
            if ttft is not None:
                out["ttft"].append(ttft)
    except httpx.HTTPError as e:
        _error(out, e)


async def _sdk_one(sdk: object, tenant: Tenant, sent_at: float, out: dict) -> None:
    """One request through the OpenAI SDK (its own retries on 429 and 5xx, honouring retry-after)."""
    import openai

    try:
        stream = await sdk.chat.completions.create(  # type: ignore[attr-defined]
            model=MODEL, messages=PROMPT, max_tokens=tenant.tokens, stream=True,
            extra_body={"min_tokens": tenant.tokens}, extra_headers=headers(tenant),
        )  # fmt: skip
        ttft = None
        async for _ in stream:
            if ttft is None:
                ttft = time.monotonic() - sent_at
        out["ok"] += 1
        if ttft is not None:
            out["ttft"].append(ttft)
    except openai.RateLimitError as e:
        out["429_retry_after" if "retry-after" in e.response.headers else "429_bare"] += 1
    except openai.APIStatusError as e:
        out["503" if e.status_code == 503 else "other"] += 1
    except openai.APIError as e:
        _error(out, e)


def _error(out: dict, error: BaseException) -> None:
    """A transport error, counted by its kind (a timeout, the router closing the connection...)."""
    out["error"] += 1
    kinds = out.setdefault("error_kinds", {})
    kinds[type(error).__name__] = kinds.get(type(error).__name__, 0) + 1


async def open_loop(url: str, tenants: tuple[Tenant, ...], cap: float, duration: float, seed: int) -> dict:
    """Poisson arrivals per tenant at its load x ``cap`` for ``duration`` s; per tenant: outcomes, TTFTs."""
    import openai

    rng = random.Random(seed)
    plan: list[tuple[float, Tenant]] = []
    for tenant in tenants:
        t = rng.expovariate(tenant.load * cap)
        while t < duration:
            plan.append((t, tenant))
            t += rng.expovariate(tenant.load * cap)
    out = {t.name: {o: 0 for o in OUTCOMES} | {"ttft": []} for t in tenants}
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=4000)
    timeout = httpx.Timeout(DRAIN_S + duration, connect=10)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        sdk = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=SDK_RETRIES,
                                 timeout=DRAIN_S + duration)  # fmt: skip
        t0 = time.monotonic()

        async def one(at: float, tenant: Tenant) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            out[tenant.name]["sent"] += 1
            if tenant.sdk:
                await _sdk_one(sdk, tenant, t0 + at, out[tenant.name])
            else:
                await _httpx_one(client, tenant, t0 + at, out[tenant.name])

        tasks = {asyncio.create_task(one(at, tenant)): tenant for at, tenant in plan}
        await asyncio.sleep(max(0.0, t0 + duration - time.monotonic()))
        _, pending = await asyncio.wait(tasks, timeout=DRAIN_S)
        for task in pending:
            task.cancel()
            out[tasks[task].name]["unfinished"] += 1
        await asyncio.gather(*pending, return_exceptions=True)
        await sdk.close()
    for res in out.values():
        lat = res.pop("ttft")
        res["p50_ms"] = engine_bench.percentile_ms(lat, 0.5)
        res["p99_ms"] = engine_bench.percentile_ms(lat, 0.99)
    return out


COLUMNS = ("run", "tenant", "sent", "200", "429+retry-after", "429 bare", "503", "other", "error",
           "unfinished", "p50 TTFT ms", "p99 TTFT ms")  # fmt: skip
FIGURES = (
    "sent",
    "ok",
    "429_retry_after",
    "429_bare",
    "503",
    "other",
    "error",
    "unfinished",
    "p50_ms",
    "p99_ms",
)


def summarize(rounds: list[dict]) -> dict:
    """Per run and tenant, per figure: median and min-max over the rounds."""
    table: dict = {}
    for run in rounds[0]:
        table[run] = {}
        for tenant in rounds[0][run]:
            row = {}
            for fig in (*FIGURES, "evicted_midstream"):
                vals = [r[run][tenant].get(fig) for r in rounds]
                vals = [v for v in vals if v is not None]
                row[fig] = (
                    {"median": statistics.median(vals), "min": min(vals), "max": max(vals)} if vals else None
                )
            table[run][tenant] = row
    return table


def rows(report: dict) -> list[list[str]]:
    return [
        [run, tenant, *(engine_bench.spread_cell(s[f]) for f in FIGURES)]
        for run, tenants in report["summary"].items()
        for tenant, s in tenants.items()
    ]


def verdicts(summary: dict) -> list[str]:
    """The issue's checks, from the medians, stated whether they pass or not (the "before" fails them)."""
    out = []

    def p99(run: str, tenant: str) -> float | None:
        s = summary.get(run, {}).get(tenant, {}).get("p99_ms")
        return None if s is None else s["median"]

    alone = p99("A-alone", "quiet")
    for run in ("A-beside", "C-sdk"):
        beside = p99(run, "quiet")
        if alone is not None and beside is not None:
            ok = beside <= 1.3 * alone
            out.append(
                f"{'PASS' if ok else 'FAIL'}: quiet p99 TTFT {run} {beside:.0f} ms <= 1.3 x alone {alone:.0f} ms"
            )
        if run in summary:
            q = summary[run]["quiet"]
            answered = q["ok"]["median"] == q["sent"]["median"]
            out.append(f"{'PASS' if answered else 'FAIL'}: every quiet request answered in {run} "
                       f"({q['ok']['median']:.0f} of {q['sent']['median']:.0f})")  # fmt: skip
    for run, tenants in summary.items():
        for tenant, s in tenants.items():
            counted = sum(s[f]["median"] for f in FIGURES[1:8] if s[f] is not None)
            if counted != s["sent"]["median"]:
                out.append(f"NOTE: {run} {tenant}: outcomes counted {counted:.0f} of {s['sent']['median']:.0f} "
                           "sent (medians over rounds need not add up)")  # fmt: skip
    return out


def render(report: dict) -> str:
    lines = [
        f"# A noisy neighbour on a shared fleet ({report['label']})",
        "",
        f"`python benchmarks/tenants/noisy_neighbour.py --duration {report['duration_s']:g} --rounds "
        f"{report['rounds']}{' --tenants' if report.get('tenants_declared') else ''} --label "
        f"{report['label']}` on {report['machine']} at {report['commit']} "
        f"({report['router']}); load average before the run {report['loadavg_before']}, after "
        f"{report['loadavg_after']} (other developers share the 2 cores: compare rows of one run, not "
        "across runs). Two vLLM engines (CPU build, tiny model, `--max-num-seqs 4 --scheduling-policy "
        "priority`) behind our router (`leastloaded`, priority on, `queue_timeout` 30); streamed chat, 32 "
        f"tokens (the batch tenant 128); capacity C = {report['capacity_rps']['median']:.2f} requests/s "
        "(closed loop at 16, non-streamed, 32 tokens); Poisson arrivals for "
        f"{report['duration_s']:g} s per tenant at its load x C. Medians over the rounds, min-max in "
        "brackets; TTFT from the intended send time to the first SSE event, of 200s only. 'other' "
        "includes streams ended by an error event (evicted mid-stream: "
        "`evicted_midstream` in the JSON); 'error' is a transport error (its kinds: `error_kinds` in the JSON).",
        *(
            [
                "",
                f"Tenants declared (`--tenants`): equal weights; noisy, noisy-sdk and batch limited to "
                f"{report['noisy_limit_share']:g} x C requests per minute; the router holds what engines "
                "cannot start at once (`saturation_max_waiting` 1), so waiting requests leave by tenant in turn.",
            ]
            if report.get("tenants_declared")
            else []
        ),
        "",
        *engine_bench.markdown_table(COLUMNS, rows(report), left_columns=2),
        "",
        *report["verdicts"],
        "",
    ]
    return "\n".join(lines)


def print_table(report: dict) -> None:
    engine_bench.print_console_table(
        f"Noisy neighbour ({report['label']}, C = {report['capacity_rps']['median']:.2f} req/s)",
        COLUMNS,
        rows(report),
        left_columns=2,
        width=180,
        notes=report["verdicts"],
        fallback_markdown=render(report),
    )


def _loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--label", default="after", help="what router this is (before, after, ...)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tenants_noisy_neighbour"))
    ap.add_argument("--tenants", action="store_true",
                    help="declare the tenants (noisy ones rate-limited to 0.6 x C per minute) and hold "
                    "requests in the router (saturation_max_waiting 1): issue 51's configuration")  # fmt: skip
    ap.add_argument("--runs", default=",".join(RUNS), help=f"a comma-separated subset of {', '.join(RUNS)}")
    args = ap.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(runs) - set(RUNS))
    if unknown:
        ap.error(f"unknown runs: {', '.join(unknown)}")
    loadavg_before = _loadavg()
    engines, log_dir = engine_bench.launch_tiny_engines(
        MODEL, "noisy-neighbour-", ["--max-num-seqs", "4", "--scheduling-policy", "priority"]
    )
    router: subprocess.Popen[bytes] | None = None
    caps: list[float] = []
    rounds: list[dict] = []
    try:
        tb.wait_ready(engines, 420)
        backends = [e.url for e in engines]
        caps = engine_bench.measure_capacity(
            engines, router_config(backends, False), log_dir, body(QUIET, False), headers(QUIET), router_env()
        )
        cap = statistics.median(caps)
        tenants_file = write_tenants(log_dir, cap) if args.tenants else None
        for i in range(args.rounds):
            result: dict = {}
            for n, run in enumerate(runs):
                tenants, eviction = RUNS[run]
                router, url = engine_bench.start_router(
                    router_config(backends, eviction, tenants_file), log_dir, f"{run}-{i}", router_env()
                )
                engine_bench.wait_idle(engines)
                result[run] = asyncio.run(open_loop(url, tenants, cap, args.duration, seed=1000 * i + n))
                tb.stop_process(router)
                router = None
                print(f"round {i + 1} {run}: " + json.dumps(result[run]), flush=True)
            rounds.append(result)
    finally:
        engine_bench.stop_testbed(router, engines)
    summary = summarize(rounds)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    import vllm_stack

    report = {
        "label": args.label,
        "commit": commit.stdout.strip(),
        "router": f"router code from {Path(vllm_stack.__file__).parent}",
        "duration_s": args.duration,
        "rounds": args.rounds,
        "tenants_declared": args.tenants,
        "noisy_limit_share": NOISY_LIMIT_SHARE if args.tenants else None,
        "runs": runs,
        "machine": engine_bench.machine_summary(),
        "loadavg_before": loadavg_before,
        "loadavg_after": _loadavg(),
        "capacity_rps": {"median": cap if caps else None, "raw": caps},
        "summary": summary,
        "raw": rounds,
    }
    report["verdicts"] = verdicts(summary)
    engine_bench.write_report(args.out, report, render, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
