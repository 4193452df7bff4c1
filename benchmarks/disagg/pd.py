"""Disaggregated prefill on real vLLM engines: our router and the Rust vllm-router, PD against whole.

Two engines A and B of one model, both with a KV connector (CPU: vLLM's ExampleConnector on one
shared folder, ``kv_both``, so the same two engines serve every contender). The contenders:

- ``ours-whole``: our router, ``leastloaded``, both engines serve whole requests;
- ``ours-pd``: our router, ``disaggregated_prefill``, A prefills (a 1-token leg with
  ``kv_transfer_params``) and B decodes; prompts with fewer than ``--disagg-min-uncached-tokens``
  (256) uncached tokens skip the prefill leg;
- ``rust-pd``: the Rust ``vllm-router==0.1.17`` with ``--vllm-pd-disaggregation --prefill A --decode B``;
- ``rust-whole``: the Rust router, ``--policy round_robin --worker-urls A B``.

Workload: a closed loop (``--concurrency`` 4) over ``--requests`` (48) streamed chat completions,
interleaved: half "long prompt, short answer" (~1200 prompt tokens, max_tokens 8), half "short prompt,
long answer" (~20 tokens, max_tokens 128); ``ignore_eos`` so every answer has its full length. Every
prompt starts with a nonce of its contender and round, so no contender reuses another's KV (neither
the engines' prefix caches nor the connector's folder); the folder is emptied and the prefix caches
reset before every contender. Per class, measured at the client: TTFT (to the first streamed chunk
with content) and inter-token latency (gaps between content chunks), p50/p99; wall time; errors.
Contenders are interleaved per round (A B C D, A B C D); the report gives medians and min-max over
rounds and per-round ratios against ``ours-whole``. The engines are the referee of what each
contender did: their counter deltas (requests, generated tokens, external prefix-cache hits) are
recorded and checked (PD: B's external hits > 0, A served only 1-token legs).

GPU: the same script runs on a machine with vLLM (GPU) and LMCache: ``--gpu --model HF_ID
--engine-python PATH --connector example|lmcache|nixl [--engine-args-prefill ...]
[--engine-args-decode ...]``. Only the CPU/ExampleConnector path has been run on this project's
machines.

Usage: ``python benchmarks/disagg/pd.py [--rounds 2] [--requests 48] [--concurrency 4]
[--contenders ours-whole,ours-pd,rust-pd,rust-whole] [--out PATH] [--dry-run]``; prints a table and
writes ``benchmarks/results/disagg_pd.{md,json}`` (or ``PATH.{md,json}``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "router", ROOT / "benchmarks" / "routing", ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import aiohttp  # noqa: E402
from client import read_stream, reset_prefix_caches, scrape, wait_idle  # noqa: E402  benchmarks/routing
from contenders import (  # noqa: E402  benchmarks/routing
    OURS,
    Contender,
    RouterProcess,
    Setup,
    add_router_benchmarks_to_path,
    start,
    wait_ready,
)
from engine_bench import markdown_table, percentile_ms, spread_cell, write_report  # noqa: E402  benchmarks/engine_bench.py
from vllm_stack_dev.paths import cache_dir  # noqa: E402
from vllm_stack_dev.testbed import engines as tb  # noqa: E402
from vllm_stack_dev.testbed.models import build_model  # noqa: E402

add_router_benchmarks_to_path()
from run import REFERENCE_PACKAGE, REFERENCE_VENV, install_reference  # noqa: E402  benchmarks/router

MODEL = "tiny-llama"
CONTENDER_NAMES = ("ours-whole", "ours-pd", "rust-pd", "rust-whole")
CLASSES = ("long", "short")  # long prompt + short answer; short prompt + long answer
ENGINE_COUNTERS = (
    "vllm:request_success_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
)
WORDS = (
    "river stone cloud engine garden yellow market silent window copper harbor lantern meadow pocket "
    "thunder velvet orbit candle forest marble signal quiet ladder planet saddle winter bridge hollow "
    "mirror basket violet rocket shadow timber falcon glacier canyon pepper ribbon tunnel island "
    "compass feather anchor summit crystal willow ember prairie beacon cobalt dune harvest quartz"
).split()


# ---------------------------------------------------------------- workload


@dataclass(frozen=True)
class Item:
    """One request of the workload: its class, its prompt (without the nonce) and its answer length."""

    index: int
    cls: str
    text: str
    max_tokens: int
    est_prompt_tokens: int


def token_counter(model_dir: Path | None, model: str, online: bool = True):
    """A function counting the tokens of a text with the model's tokenizer (words x 1.3 if none;
    `online`: a HF id's tokenizer may be fetched from the Hub)."""
    with contextlib.suppress(Exception):
        from tokenizers import Tokenizer

        if model_dir is not None and (model_dir / "tokenizer.json").exists():
            tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        elif Path(model, "tokenizer.json").exists():
            tok = Tokenizer.from_file(str(Path(model, "tokenizer.json")))
        elif online:
            tok = Tokenizer.from_pretrained(model)
        else:
            raise LookupError(model)
        return lambda text: len(tok.encode(text, add_special_tokens=False).ids)
    return lambda text: int(len(text.split()) * 1.3)


def build_workload(
    n: int, long_tokens: int, short_tokens: int, long_max: int, short_max: int, count
) -> list[Item]:
    """`n` requests, long and short interleaved (L S L S ...), seeded text sized with `count`."""
    rng = random.Random(1234)
    items = []
    for i in range(n):
        cls = CLASSES[i % 2]
        target = long_tokens if cls == "long" else short_tokens
        words = [rng.choice(WORDS) for _ in range(max(4, target))]
        lo, hi = 1, len(words)  # the longest prefix of `words` with at most `target` tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(" ".join(words[:mid])) <= target:
                lo = mid
            else:
                hi = mid - 1
        text = " ".join(words[:lo])
        items.append(Item(i, cls, text, long_max if cls == "long" else short_max, count(text)))
    return items


def nonce(contender: str, round_index: int) -> str:
    return f"[{contender} r{round_index} {random.Random(f'{contender}/{round_index}').getrandbits(48):012x}]"


def body(item: Item, model: str, prefix: str) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"{prefix} #{item.index} {item.text}"}],
        "max_tokens": item.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # random weights may stop at once; a fixed answer length is fairer
    }


# ---------------------------------------------------------------- engines and routers


def kv_transfer_config(connector: str, role: str, shared_dir: Path, cpu: bool = True) -> str:
    """The ``--kv-transfer-config`` of an engine: `role` is "prefill" (A) or "decode" (B)."""
    if connector == "example":
        config = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(shared_dir)},
        }
    elif connector == "lmcache":
        config = {
            "kv_connector": "LMCacheConnectorV1",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        }
    elif connector == "nixl":
        config = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        if cpu:  # vLLM's NixlConnector on CPU: the KV in a host buffer, NIXL over UCX
            config["kv_buffer_device"] = "cpu"
    else:
        raise ValueError(connector)
    return json.dumps(config, separators=(",", ":"))


def engine_spec(
    args: argparse.Namespace, model_dir: Path | None, role: str, shared_dir: Path
) -> tb.EngineSpec:
    extra = ["--kv-transfer-config", kv_transfer_config(args.connector, role, shared_dir, cpu=not args.gpu)]
    extra += shlex.split(args.engine_args_prefill if role == "prefill" else args.engine_args_decode)
    env = {"VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache
    if args.connector == "nixl":  # two engines on one host: a side channel each (where blocks are asked for)
        if args.gpu:  # UCX picks its own transports (NVLink, the NICs)
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(tb.free_port())
        else:
            env |= tb.nixl_loopback_env()
    for pair in shlex.split(args.engine_env_prefill if role == "prefill" else args.engine_env_decode):
        key, _, value = pair.partition("=")
        env[key] = value
    if args.gpu:  # real weights, the model's own defaults; one GPU per engine
        gpu_ids = args.gpu_ids.split(",")
        env["CUDA_VISIBLE_DEVICES"] = gpu_ids[0] if role == "prefill" else gpu_ids[-1]
        full = ["--model", args.model, "--served-model-name", args.served_name, "--enable-prefix-caching",
                "--max-model-len", str(args.max_model_len), *extra]  # fmt: skip
        return tb.EngineSpec(
            args.model, args.served_name, enable_lora=False, kv_events=False, args=full, env=env
        )
    return tb.EngineSpec(
        model_dir if model_dir is not None else args.model,
        args.served_name,
        enable_lora=False,
        kv_events=False,
        max_model_len=args.max_model_len,
        extra_args=extra,
        env=env,
    )


def rust_exe(install: bool) -> str:
    return str(install_reference() if install else REFERENCE_VENV / "bin" / "vllm-router")


def contender(name: str, args: argparse.Namespace, install: bool = True) -> Contender:
    """The router command line of contender `name` (setup.engine_urls = [A, B])."""
    family = name.split("-")[0]

    def command(setup: Setup, port: int, metrics_port: int) -> list[str]:
        a, b = setup.engine_urls
        if family == "ours":
            argv = [str(OURS), "router", "--host", "127.0.0.1", "--port", str(port),
                    "--static-backends", f"{a},{b}"]  # fmt: skip
            if name == "ours-pd":
                argv += ["--static-roles", "prefill,decode", "--routing-logic", "disaggregated_prefill",
                         "--disagg-min-uncached-tokens", str(args.disagg_min_uncached_tokens)]  # fmt: skip
                if args.connector == "lmcache":
                    argv += ["--disagg-protocol", "lmcache"]
            else:
                argv += ["--routing-logic", "leastloaded"]
            return [*argv, "--log-level", "warning"]
        argv = [rust_exe(install), "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                "--prometheus-port", str(metrics_port), "--worker-startup-check-interval", "1",
                "--log-level", "warning"]  # fmt: skip
        if name == "rust-pd":
            return [*argv, "--vllm-pd-disaggregation", "--prefill", a, "--decode", b]
        return [*argv, "--worker-urls", a, b]

    env = (
        (lambda setup: {"VLLM_ROUTER_TOKENIZER": str(setup.model_dir)})
        if family == "rust"
        else (lambda _s: {})
    )
    return Contender(name, family, command, env)


def router_metrics(router: RouterProcess) -> dict[str, float]:
    """The router's own disaggregation/PD counters (sum per series name+labels), to see what it did."""
    try:
        with urllib.request.urlopen(router.metrics_url, timeout=5) as response:
            text = response.read().decode(errors="replace")
    except (OSError, ValueError):
        return {}
    out = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or "_bucket" in line or "quantile=" in line:
            continue
        if any(k in line.lower() for k in ("disagg", "pd_", "prefill", "decode")):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


# ---------------------------------------------------------------- client


@dataclass
class Outcome:
    cls: str
    ok: bool = False
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


async def send(session: aiohttp.ClientSession, url: str, payload: dict, cls: str) -> Outcome:
    """One streamed chat request: TTFT at the first chunk with content, the gaps between content chunks."""
    outcome = Outcome(cls)
    stamps: list[float] = []
    started = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=payload) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return outcome
            stream = await read_stream(response)
            stamps = stream.stamps
            outcome.prompt_tokens, outcome.output_tokens = stream.prompt_tokens, stream.output_tokens
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome
    if not stamps:
        outcome.error = "no content chunk"
        return outcome
    outcome.ttft_s = stamps[0] - started
    outcome.gaps_s = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    outcome.ok = True
    return outcome


async def drive(url: str, payloads: list[tuple[dict, str]], concurrency: int) -> tuple[float, list[Outcome]]:
    """Closed loop: `concurrency` workers take the requests in order; (wall seconds, outcomes)."""
    queue: asyncio.Queue[tuple[dict, str]] = asyncio.Queue()
    for p in payloads:
        queue.put_nowait(p)
    outcomes: list[Outcome] = []
    timeout = aiohttp.ClientTimeout(total=600, sock_read=300)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency)
    ) as session:

        async def worker() -> None:
            while not queue.empty():
                payload, cls = queue.get_nowait()
                outcomes.append(await send(session, url, payload, cls))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, outcomes


async def counters(urls: list[str]) -> list[dict[str, float]]:
    async with aiohttp.ClientSession() as session:
        return [await scrape(session, u, ENGINE_COUNTERS) for u in urls]


async def reset_caches(urls: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        await reset_prefix_caches(session, urls)  # waits for idle first


def prepare(urls: list[str], shared_dir: Path | None) -> None:
    """Same starting state: engines idle, prefix caches reset, the connector's folder empty."""
    asyncio.run(reset_caches(urls))
    if shared_dir is not None:
        shutil.rmtree(shared_dir, ignore_errors=True)
        shared_dir.mkdir(parents=True)


async def settle(urls: list[str]) -> None:
    async with aiohttp.ClientSession() as session:
        await wait_idle(session, urls)


def measure(outcomes: list[Outcome], wall_s: float) -> dict:
    result: dict = {"wall_s": wall_s, "errors": sum(not o.ok for o in outcomes)}
    result["error_samples"] = sorted({o.error for o in outcomes if not o.ok})[:3]
    for cls in CLASSES:
        ok = [o for o in outcomes if o.cls == cls and o.ok]
        ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
        gaps = [g for o in ok for g in o.gaps_s]
        result[cls] = {
            "n_ok": len(ok),
            "ttft_p50_ms": percentile_ms(ttfts, 0.5),
            "ttft_p99_ms": percentile_ms(ttfts, 0.99),
            "itl_p50_ms": percentile_ms(gaps, 0.5),
            "itl_p99_ms": percentile_ms(gaps, 0.99),
            "prompt_tokens_median": statistics.median([o.prompt_tokens for o in ok]) if ok else None,
            "output_tokens_median": statistics.median([o.output_tokens for o in ok]) if ok else None,
        }
    return result


# ---------------------------------------------------------------- checks, summary, report


def checks(name: str, run: dict, n_long: int, n_total: int) -> list[str]:
    """What the engines say the contender did; an empty list when it did what it claims."""
    a, b = run["engines"]["A"], run["engines"]["B"]
    problems = []
    if name.endswith("-pd"):
        if b["vllm:external_prefix_cache_hits_total"] <= 0:
            problems.append("B reported no external prefix-cache hits (no KV handed over)")
        if a["vllm:generation_tokens_total"] != a["vllm:request_success_total"]:
            problems.append(
                f"A generated {a['vllm:generation_tokens_total']:.0f} tokens for {a['vllm:request_success_total']:.0f} "
                "requests (not only 1-token prefill legs)"
            )
        if b["vllm:request_success_total"] != n_total:
            problems.append(f"B served {b['vllm:request_success_total']:.0f} of {n_total} requests")
        if name == "ours-pd" and a["vllm:request_success_total"] != n_long:
            problems.append(
                f"A served {a['vllm:request_success_total']:.0f} prefill legs for {n_long} long requests"
            )
    elif min(a["vllm:request_success_total"], b["vllm:request_success_total"]) == 0:
        problems.append("one engine served nothing")
    if run["client"]["errors"]:
        problems.append(f"{run['client']['errors']} client errors: {run['client']['error_samples']}")
    return problems


def spread(values: list[float | None]) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


FIGURES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def summarize(rounds: list[dict], names: list[str], baseline: str = "ours-whole") -> dict:
    summary: dict = {}
    for name in names:
        runs = [r[name] for r in rounds if name in r]
        row: dict = {
            "wall_s": spread([r["client"]["wall_s"] for r in runs]),
            "errors": sum(r["client"]["errors"] for r in runs),
        }
        for cls in CLASSES:
            row[cls] = {f: spread([r["client"][cls][f] for r in runs]) for f in FIGURES}
        if baseline in names and name != baseline:  # per-round ratios, then their median
            ratios: dict = {"wall": spread([r[name]["client"]["wall_s"] / r[baseline]["client"]["wall_s"]
                                            for r in rounds if name in r and baseline in r])}  # fmt: skip
            for cls in CLASSES:
                for f in FIGURES:
                    ratios[f"{cls}_{f}"] = spread(
                        [r[name]["client"][cls][f] / r[baseline]["client"][cls][f]
                         for r in rounds if name in r and baseline in r
                         and r[name]["client"][cls][f] and r[baseline]["client"][cls][f]]
                    )  # fmt: skip
            row["ratio_vs_" + baseline] = ratios
        for engine in ("A", "B"):
            row[f"engine_{engine}"] = {
                k: spread([r["engines"][engine][k] for r in runs]) for k in ENGINE_COUNTERS
            }
        summary[name] = row
    return summary


COLUMNS = ("contender", "class", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "wall s", "errors")


def rows(report: dict) -> list[list[str]]:
    out = []
    for name in report["contenders"]:
        s = report["summary"][name]
        for cls in CLASSES:
            figs = [spread_cell(s[cls][f]) if "ttft" in f else spread_cell(s[cls][f], 1) for f in FIGURES]
            out.append([name, cls, *figs, spread_cell(s["wall_s"], 1), str(s["errors"])])
    return out


def ratio_rows(report: dict) -> list[list[str]]:
    out = []
    for name in report["contenders"]:
        r = report["summary"][name].get("ratio_vs_ours-whole")
        if not r:
            continue
        out.append([name, *(spread_cell(r[f"{c}_{f}"], 2) for c in CLASSES for f in ("ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")),
                    spread_cell(r["wall"], 2)])  # fmt: skip
    return out


RATIO_COLUMNS = ("contender", "long TTFT p50", "long ITL p50", "long ITL p99", "short TTFT p50", "short ITL p50",
                 "short ITL p99", "wall")  # fmt: skip

ENGINE_COLUMNS = ("contender", "A requests", "A gen tokens", "B requests", "B gen tokens", "B external hits (tokens)",
                  "A external hits", "router's own counters", "checks")  # fmt: skip
ROUTER_COUNTERS = ("disagg_requests_total", "pd_prefill_requests_total", "pd_decode_requests_total")


def router_counts(report: dict, name: str) -> str:
    """The router's own PD counters of round 1 (ours: outcome per request; Rust: requests per leg)."""
    first = next((r[name] for r in report["rounds"] if name in r), None)
    if not first:
        return "-"
    parts = []
    for key, value in first["router_metrics"].items():
        if any(c + "{" in key for c in ROUTER_COUNTERS):
            label = key.split("{", 1)[1].rstrip("}")
            label = ",".join(x for x in label.split(",") if not x.startswith(("model=", "route=", "worker=")))
            series = key.split("{")[0].rsplit("_", 2)[0].split("router_")[-1]
            parts.append(f"{series} {label.replace(chr(34), '')}".strip() + f": {value:.0f}")
    return "; ".join(parts) or "-"


def engine_rows(report: dict) -> list[list[str]]:
    out = []
    for name in report["contenders"]:
        s = report["summary"][name]
        a, b = s["engine_A"], s["engine_B"]
        problems = [p for r in report["rounds"] if name in r for p in r[name]["problems"]]
        out.append([
            name, spread_cell(a["vllm:request_success_total"]), spread_cell(a["vllm:generation_tokens_total"]),
            spread_cell(b["vllm:request_success_total"]), spread_cell(b["vllm:generation_tokens_total"]),
            spread_cell(b["vllm:external_prefix_cache_hits_total"]), spread_cell(a["vllm:external_prefix_cache_hits_total"]),
            router_counts(report, name),
            "ok" if not problems else "FAIL: " + "; ".join(sorted(set(problems))),
        ])  # fmt: skip
    return out


def class_mix(report: dict, name: str) -> list[tuple[int, int]]:
    """Per round, (long, short) requests engine A served for contender `name`, solved from A's request and
    generated-token deltas (every answer has its full length: ignore_eos)."""
    w = report["workload"]
    lm, sm = w["long_max_tokens"], w["short_max_tokens"]
    out = []
    for r in report["rounds"]:
        if name in r and sm != lm:
            a = r[name]["engines"]["A"]
            requests, tokens = a["vllm:request_success_total"], a["vllm:generation_tokens_total"]
            short = round((tokens - lm * requests) / (sm - lm))
            out.append((round(requests) - short, short))
    return out


def split_by_class(mix: list[tuple[int, int]]) -> int:
    """Rounds in which at least 90% of engine A's requests were of one class."""
    return sum(1 for lo, sh in mix if lo + sh and max(lo, sh) >= 0.9 * (lo + sh))


def reading(report: dict) -> str:
    s = report["summary"]

    def ratio(name: str, key: str) -> str:
        r = s.get(name, {}).get("ratio_vs_ours-whole", {}).get(key)
        if r is None:
            return "-"
        crosses = " (rounds disagree: range crosses 1)" if r["min"] < 1 < r["max"] else ""
        return f"{r['median']:.2f}x{crosses}"

    parts = []
    for name in ("ours-pd", "rust-pd", "rust-whole"):
        if name in s and "ours-whole" in s:
            parts.append(
                f"{name} against ours-whole, per round: long TTFT p50 {ratio(name, 'long_ttft_p50_ms')}, long ITL p99 "
                f"{ratio(name, 'long_itl_p99_ms')}, short TTFT p50 {ratio(name, 'short_ttft_p50_ms')}, short ITL p50 "
                f"{ratio(name, 'short_itl_p50_ms')} and p99 {ratio(name, 'short_itl_p99_ms')}, wall {ratio(name, 'wall')}."
            )
    if "ours-pd" in s:
        parts.append(
            "PD pays on the long requests' TTFT (a prefill leg on A, its KV written to disk, read back by B, B "
            "prefilling the last partial block, a second HTTP exchange) and is meant to gain on decode ITL: the "
            "short class's ITL is the decode that long prefills interrupt under whole serving, and under PD B's "
            "decode is interrupted only by KV loads and tail prefills, although all decoding then runs on B's one core."
        )
    if "ours-pd" in s and "rust-pd" in s:
        parts.append(
            "ours-pd sends only the long prompts through A (short ones are below the 256-token threshold and go "
            "straight to B); rust-pd sends every request through A first (A's request count in the engine table), "
            "so its short requests wait for a prefill leg and then are prefilled again on B (a prompt shorter "
            "than one 128-token block leaves no whole block for ExampleConnector to hand over): its short TTFT shows it."
        )
    n_rounds = len(report["rounds"])
    if "ours-pd" in s and "ours-whole" in s:
        r = s["ours-pd"]["ratio_vs_ours-whole"]["short_itl_p99_ms"]
        if r is not None:
            parts.append(
                f"Here ours-pd's short-class ITL p99 is {r['median']:.2f}x ours-whole's: "
                + ("the interference it removes was worth less than what it costs on these engines (all decoding on "
                   "one core, the KV loads and tail prefills on that same core)." if r["median"] > 1 else
                   "less prefill interference on the decode engine outweighed moving all decoding to one core.")
            )  # fmt: skip
    for name in ("ours-whole", "rust-whole"):
        if name in s:
            mix = class_mix(report, name)
            text = ", ".join(f"{lo} long + {sh} short" for lo, sh in mix)
            split = split_by_class(mix)
            parts.append(f"{name} put on engine A, per round: {text} (from A's counters).")
            if split:
                parts.append(
                    f"In {split} of {n_rounds} rounds that is (almost) one class per engine: "
                    + ("round_robin alternates engines and the workload alternates long and short requests, so "
                       if name == "rust-whole" else "")
                    + "long prefills and short decodes rarely share an engine, a class split without any hand-over "
                    "(close to a PD placement for free) that flatters it on this interleaved workload only."
                )  # fmt: skip
    loads = [
        r[n]["load_average_1m"]["before"] for r in report["rounds"] for n in r if "load_average_1m" in r[n]
    ]
    if loads:
        parts.append(
            f"Noise: the 1-minute load average before the contender runs was {min(loads):.1f}-{max(loads):.1f} on "
            f"{report.get('nproc', 2)} cores (this benchmark's two engines alone make about 2 while busy; more is "
            "other work on the machine). Contenders ran in the same order in every round, "
            f"{', '.join(report['contenders'])}, {n_rounds} rounds: ranges that cross 1 are not measured differences."
        )
    return " ".join(parts)


CAVEATS = (
    "What CPU engines can and cannot show. Each engine has one core, and the model is the tiny test model "
    "(hidden 128, 2 layers, random weights): a ~1200-token prefill costs it little, so the hand-over of PD "
    "(A writes the prompt's KV to the shared folder in whole 128-token blocks, B reads it back, a second HTTP "
    "leg through the router, and B still prefills the last partial block) can cost more than it saves. The "
    "benefit PD is for, decode inter-token latency not disturbed by long prefills batched in with it, needs "
    "real compute contention (a large model on a GPU); with one core per engine, a disaggregated setup also "
    "leaves all decode work on one core while whole-request routing spreads it over two, which is a capacity "
    "difference, not a PD property. With ExampleConnector in `kv_both` both engines also write the KV of every "
    "prompt they prefill to disk in every contender (same engines for all), which slows all of them alike. "
    "These are tiny-model CPU figures on a noisy two-core machine (the client and the routers share its "
    "cores), not a claim about GPUs."
)


def render(report: dict) -> str:
    lines = [
        "# Disaggregated prefill (PD) against whole-request serving, real vLLM engines",
        "",
        f"Run {report['date']} on {report['machine']}, vLLM {report['vllm_version']}, "
        f"connector `{report['connector']}`{' (CPU path: the only path run on these machines)' if not report['gpu'] else ''}.",
        "",
        f"Command: `{report['command']}`; routers: our `vllm-stack router` (this tree) and the Rust "
        f"`{report.get('rust_router', REFERENCE_PACKAGE)}`, each started fresh per contender run.",
        "",
        f"Two engines of `{report['model']}` (one core each; for the PD contenders A prefills and B decodes, for the others both serve whole requests), "
        f"`--kv-transfer-config` A `{report['kv_transfer_config']['prefill']}`, B "
        f"`{report['kv_transfer_config']['decode']}`. Closed loop at concurrency {report['concurrency']}, "
        f"{report['requests']} streamed chat requests per contender and round, interleaved: long prompt "
        f"(~{report['workload']['long_prompt_tokens']} tokens, max_tokens {report['workload']['long_max_tokens']}) and "
        f"short prompt (~{report['workload']['short_prompt_tokens']} tokens, max_tokens "
        f"{report['workload']['short_max_tokens']}), `ignore_eos`; prompt tokens the engines counted (chat template "
        f"and nonce included, median): long {spread_cell(report['measured_prompt_tokens']['long'])}, short "
        f"{spread_cell(report['measured_prompt_tokens']['short'])}. {report['n_rounds']} rounds, contenders interleaved "
        "per round; figures are medians over rounds with min-max in brackets; TTFT to the first content chunk and "
        "ITL (gaps between content chunks, all gaps of the class) measured at the client.",
        "",
        *markdown_table(COLUMNS, rows(report)),
        "",
        "Ratios against ours-whole (per round, then the median; < 1 is better):",
        "",
        *markdown_table(RATIO_COLUMNS, ratio_rows(report)),
        "",
        "What the engines did (counter deltas per contender run, median over rounds):",
        "",
        *markdown_table(ENGINE_COLUMNS, engine_rows(report)),
        "",
        "## Reading",
        "",
        reading(report),
        "",
        CAVEATS,
        "",
    ]
    return "\n".join(lines)


def print_table(report: dict) -> None:
    for block in (markdown_table(COLUMNS, rows(report)), markdown_table(RATIO_COLUMNS, ratio_rows(report)),
                  markdown_table(ENGINE_COLUMNS, engine_rows(report))):  # fmt: skip
        print("\n".join(block))
        print()


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--requests", type=int, default=48, help="per contender and round (half long, half short)"
    )
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--contenders", default=",".join(CONTENDER_NAMES))
    ap.add_argument("--long-prompt-tokens", type=int, default=1200)
    ap.add_argument("--short-prompt-tokens", type=int, default=20)
    ap.add_argument("--long-max-tokens", type=int, default=8)
    ap.add_argument("--short-max-tokens", type=int, default=128)
    ap.add_argument("--disagg-min-uncached-tokens", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "disagg_pd"))
    ap.add_argument(
        "--dry-run", action="store_true", help="print the workload and command lines; start nothing"
    )
    ap.add_argument(
        "--render", metavar="JSON", help="only rewrite the .md (and print the tables) of a results JSON"
    )
    gpu = ap.add_argument_group("GPU machines (not run here)")
    gpu.add_argument("--gpu", action="store_true", help="real weights, no core pinning, one GPU per engine")
    gpu.add_argument("--gpu-ids", default="0,1", help="CUDA_VISIBLE_DEVICES of A,B")
    gpu.add_argument("--model", default=None, help="a HF model id or path instead of the tiny model")
    gpu.add_argument("--served-name", default=None, help="served model name (default tiny-llama / --model)")
    gpu.add_argument("--engine-python", default=None, help="the engines' Python (default .venv-engine)")
    gpu.add_argument(
        "--engine-args-prefill", default="", help="extra engine args of A (one shell-quoted string)"
    )
    gpu.add_argument(
        "--engine-args-decode", default="", help="extra engine args of B (one shell-quoted string)"
    )
    gpu.add_argument(
        "--engine-env-prefill", default="", help="KEY=VALUE ... for A (e.g. LMCACHE_CONFIG_FILE=...)"
    )
    gpu.add_argument("--engine-env-decode", default="", help="KEY=VALUE ... for B")
    gpu.add_argument(
        "--connector",
        choices=("example", "lmcache", "nixl"),
        default="example",
        help="example: ExampleConnector kv_both on a shared folder; lmcache: LMCacheConnectorV1 kv_producer (A) / "
        "kv_consumer (B), our router with --disagg-protocol lmcache (the engines need an LMCache PD config, "
        "e.g. --engine-env-prefill LMCACHE_CONFIG_FILE=...); nixl: NixlConnector kv_both",
    )
    args = ap.parse_args(argv)
    args.names = [n for n in args.contenders.split(",") if n]
    unknown = sorted(set(args.names) - set(CONTENDER_NAMES))
    if unknown:
        ap.error(f"unknown contenders: {', '.join(unknown)}")
    if args.gpu and not args.model:
        ap.error("--gpu needs --model")
    args.served_name = args.served_name or (args.model if args.model else MODEL)
    return args


def vllm_version() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run([str(tb.engine_python()), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
        if out.returncode == 0:
            return out.stdout.strip().splitlines()[-1]
    return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render:  # the report's text from the figures of an earlier run: no engines, no routers
        source = Path(args.render)
        report = json.loads(source.read_text())
        source.with_suffix(".md").write_text(render(report))
        print_table(report)
        return 0
    if args.engine_python:
        os.environ["VLLM_STACK_ENGINE_PYTHON"] = args.engine_python
    if args.gpu:  # the test bed forces float32 on AMX hosts (a CPU-engine workaround): not for GPU engines
        os.environ.setdefault("VLLM_STACK_ENGINE_DTYPE", "auto")
    model_dir = None if args.model else build_model("tiny", cache_dir() / "models" / "tiny")
    count = token_counter(model_dir, args.model or MODEL, online=not args.dry_run)
    items = build_workload(args.requests, args.long_prompt_tokens, args.short_prompt_tokens,
                           args.long_max_tokens, args.short_max_tokens, count)  # fmt: skip
    n_long = sum(i.cls == "long" for i in items)
    workload = {
        "long_prompt_tokens": args.long_prompt_tokens,
        "short_prompt_tokens": args.short_prompt_tokens,
        "long_max_tokens": args.long_max_tokens,
        "short_max_tokens": args.short_max_tokens,
        "n_long": n_long,
        "n_short": len(items) - n_long,
        "est_prompt_tokens_long": statistics.median(
            [i.est_prompt_tokens for i in items if i.cls == "long"] or [0]
        ),
        "est_prompt_tokens_short": statistics.median(
            [i.est_prompt_tokens for i in items if i.cls == "short"] or [0]
        ),
    }

    if args.dry_run:
        shared = Path(tempfile.gettempdir()) / "disagg-kv-DRYRUN"
        setup = Setup(["http://127.0.0.1:PORT_A", "http://127.0.0.1:PORT_B"], [None, None], args.served_name,
                      model_dir or Path(args.model), 128)  # fmt: skip
        print(f"workload: {json.dumps(workload)}")
        for item in items[:4]:
            print(f"  #{item.index} {item.cls}: ~{item.est_prompt_tokens} tokens, max_tokens {item.max_tokens}: "
                  f"{nonce('ours-whole', 0)} #{item.index} {item.text[:60]}...")  # fmt: skip
        for role, name in (("prefill", "A"), ("decode", "B")):
            spec = engine_spec(args, model_dir, role, shared)
            print(
                f"engine {name}: {shlex.join([str(tb.engine_python()), '-m', 'vllm.entrypoints.openai.api_server', *tb.server_args(spec, 0, None)])}"
            )
        for name in args.names:
            print(f"{name}: {shlex.join(contender(name, args, install=False).command(setup, 0, 0))}")
        return 0

    log_dir = Path(tempfile.mkdtemp(prefix="disagg-pd-"))
    shared_dir = log_dir / "kv-shared"
    shared_dir.mkdir()
    print(f"logs in {log_dir}", flush=True)
    if any(n.startswith("rust") for n in args.names):
        install_reference()
    specs = {role: engine_spec(args, model_dir, role, shared_dir) for role in ("prefill", "decode")}
    cpus = [None, None] if args.gpu else tb.default_cpus(2)
    group = tb.EngineGroup()
    router: RouterProcess | None = None
    rounds: list[dict] = []
    failed: str | None = None
    try:
        for i, (role, name) in enumerate((("prefill", "A"), ("decode", "B"))):
            group.add(tb.launch(specs[role], name=f"engine-{name}", cpu=cpus[i], log_dir=log_dir))
        tb.wait_ready(group.engines, 600)
        urls = group.urls
        setup = Setup(urls, [None, None], args.served_name, model_dir or Path(args.model), 128)
        # warm-up, straight to each engine: the first requests of a fresh engine are slower
        warm = [(body(it, args.served_name, f"[warm-up {k}]"), it.cls) for k, it in enumerate(items[:4])]
        for url in urls:
            asyncio.run(drive(url, warm, 2))
        for r in range(args.rounds):
            result: dict = {}
            for name in args.names:
                load_before = os.getloadavg()[0]  # other work on the machine shows here
                prepare(urls, shared_dir if args.connector == "example" else None)
                router = start(
                    contender(name, args), setup, tb.free_port(), tb.free_port(), log_dir, f"{name}-{r}"
                )
                wait_ready(router, args.served_name)
                prefix = nonce(name, r)
                payloads = [(body(it, args.served_name, prefix), it.cls) for it in items]
                before = asyncio.run(counters(urls))
                wall, outcomes = asyncio.run(drive(router.url, payloads, args.concurrency))
                asyncio.run(settle(urls))
                after = asyncio.run(counters(urls))
                rmetrics = router_metrics(router)
                router.stop()
                router = None
                deltas = [
                    {k: a[k] - b[k] for k in ENGINE_COUNTERS} for a, b in zip(after, before, strict=True)
                ]
                run = {"client": measure(outcomes, wall), "engines": {"A": deltas[0], "B": deltas[1]},
                       "router_metrics": rmetrics}  # fmt: skip
                run["load_average_1m"] = {"before": load_before, "after": os.getloadavg()[0]}
                run["problems"] = checks(name, run, n_long, len(items))
                result[name] = run
                c = run["client"]
                print(f"round {r + 1} {name}: wall {wall:.1f} s, errors {c['errors']}, "
                      f"long TTFT p50 {c['long']['ttft_p50_ms'] or 0:.0f} ms, short ITL p50 {c['short']['itl_p50_ms'] or 0:.1f} ms; "
                      f"A {deltas[0]['vllm:request_success_total']:.0f} req / {deltas[0]['vllm:generation_tokens_total']:.0f} tok, "
                      f"B {deltas[1]['vllm:request_success_total']:.0f} req / ext hits "
                      f"{deltas[1]['vllm:external_prefix_cache_hits_total']:.0f}; "
                      f"{'ok' if not run['problems'] else run['problems']}", flush=True)  # fmt: skip
            rounds.append(result)
    except BaseException as exc:
        failed = f"{type(exc).__name__}: {exc}"
        for engine in group.engines:
            errors = [
                line for line in engine.log_tail(3000).splitlines() if "Error" in line or "Traceback" in line
            ]
            print(f"--- {engine.name} (running: {engine.is_running()}) error lines:\n" + "\n".join(errors[-30:]),
                  file=sys.stderr)  # fmt: skip
            print(f"--- {engine.name} log tail:\n{engine.log_tail(20)}", file=sys.stderr)
        if router is not None:
            print(f"--- {router.name} log tail:\n{router.log_tail(20)}", file=sys.stderr)
        raise
    finally:
        if router is not None:
            router.stop()
        group.stop()
        if failed:  # the logs stay for the post-mortem
            shutil.rmtree(shared_dir, ignore_errors=True)
            print(f"failed: {failed}; logs kept in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)

    report = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, nproc {len(os.sched_getaffinity(0))}, Linux {platform.release()}",
        "nproc": len(os.sched_getaffinity(0)),
        "vllm_version": vllm_version(),
        "rust_router": REFERENCE_PACKAGE,
        "command": shlex.join(
            [".venv/bin/python", "benchmarks/disagg/pd.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "gpu": args.gpu,
        "model": args.model or f"{MODEL} (tiny test model, dummy weights)",
        "connector": args.connector,
        "kv_transfer_config": {
            role: kv_transfer_config(args.connector, role, Path("DIR"), cpu=not args.gpu)
            for role in ("prefill", "decode")
        },
        "engine_args": {"prefill": args.engine_args_prefill, "decode": args.engine_args_decode},
        "requests": args.requests,
        "concurrency": args.concurrency,
        "n_rounds": args.rounds,
        "contenders": args.names,
        "workload": workload,
        "summary": summarize(rounds, args.names),
        "measured_prompt_tokens": {
            cls: spread([r[n]["client"][cls]["prompt_tokens_median"] for r in rounds for n in r])
            for cls in CLASSES
        },
        "rounds": rounds,  # per round, per contender: client figures, engine counter deltas, router metrics
    }
    write_report(args.out, report, render, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
