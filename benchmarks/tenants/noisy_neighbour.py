"""A noisy neighbour on a shared fleet: does one tenant's overload reach another tenant's latency?

Two real vLLM engines (CPU build, the tiny model, ``--max-num-seqs`` 4 by default and
``--scheduling-policy priority``, ``max_model_len`` 512) behind our router (its own process,
``leastloaded``, priority on with engine priorities, ``queue_timeout`` 30). Tenants are told apart by
``x-llm-d-inference-fairness-id`` (issue 51; a router that does not know tenants ignores it). First the
capacity C (requests/s) of the pair for the request shape used: a closed loop at concurrency 16 of
non-streamed chat completions with ``max_tokens`` = ``min_tokens`` = ``--tokens`` (128 by default).

Why that shape: the tiny model's decode step costs the same few milliseconds at any batch size, so C
scales with the engines' slots over the tokens per request. With 4 slots and 32 tokens a quiet machine
measured C = 57 requests/s, and 3 x C of streamed requests (5,000 SSE events/s) is more than the load
generator, the router and the engines can do on two cores: the noisy tenant's requests then left late
and the run measured the client, not the router. So the requests are 128 tokens (C near 14/s), and the
loud tenants (above capacity) send non-streamed requests, as a batch-like client would: the SSE events
are the quiet tenant's alone.

Then open-loop Poisson arrivals: the loud tenant from the start, the quiet one ``--lead`` seconds later
(45 by default) and both for ``--duration`` seconds more. The lead puts the loud tenant's first minute
behind the measurement: a rate limit is a bucket that starts full (an idle tenant may send a minute's
worth at once), and the backlog that burst leaves in the queue times out within ``queue_timeout``.
The quiet tenant's figure is its TTFT, from each request's intended send time (no coordinated omission)
to its first SSE event; a loud tenant's is the whole answer's latency. After the arrivals the run waits
up to 90 s and counts what is left as unfinished. Before each run both engines must show nothing
running or waiting. The router's mean queue wait per tenant is read from its metrics after each run
(``router_queue_wait_mean_ms`` in the JSON), so a TTFT can be split into the router's queue and the engine.

Runs (``--runs``, interleaved per round):

- ``A-alone``: the quiet tenant at 0.3 x C, alone (its baseline);
- ``A-beside``: the quiet tenant at 0.3 x C beside the noisy one at 3 x C, both standard priority;
- ``A-polite``: the quiet tenant at 0.3 x C beside a polite one that sends, from the start, what the noisy
  tenant's rate limit lets in (``--limit-share`` x C, non-streamed as the noisy tenant's, standard
  priority): nothing for the router to refuse. Its quiet p99 is the floor ``A-beside`` can reach on these engines: what a
  neighbour's admitted work costs the quiet tenant in the engines' batches and on the machine's cores;
- ``B-evict-off`` / ``B-evict-on``: a critical tenant at 0.3 x C beside a sheddable batch-like tenant
  (2 x ``--tokens`` each) at 3 x C, with the router's eviction of in-flight sheddable requests off and on
  (``eviction_enabled``; ``B-evict-on`` needs a router that has the setting);
- ``C-sdk``: as ``A-beside``, the noisy tenant sending through the OpenAI SDK (``openai``,
  ``max_retries`` 5, which honours ``retry-after``): its requests counted as answered or raised.

Every request's outcome is counted (answered, 429 with and without ``retry-after``, 503, other
status, transport error, unfinished): none is lost silently.

Usage: ``python benchmarks/tenants/noisy_neighbour.py [--duration 20] [--rounds 1] [--runs ...]
[--tokens 128] [--max-num-seqs 4] [--lead 45] [--tenants] [--label before] [--out PATH]``; prints a
table and writes ``benchmarks/results/tenants_noisy_neighbour.{md,json}`` (or ``PATH.{md,json}``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "router", ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import aiohttp  # noqa: E402
import engine_bench  # noqa: E402  benchmarks/engine_bench.py
import httpx  # noqa: E402
import yaml  # noqa: E402
from vllm_stack_dev.testbed import engines as tb  # noqa: E402
from vllm_stack_dev.testbed.inference_pool import PoolSite, pool_site  # noqa: E402
from vllm_stack_dev.testbed.upstream_epp import (  # noqa: E402
    LLMD_EPP_ENV,
    LLMD_ROUTER_COMMIT,
    LlmdRouterEpp,
    llmd_epp_binary,
    llmd_flow_control_profile,
)

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
    tokens: int
    priority: str = "standard"
    sdk: bool = False
    batch_like: bool = False  # non-streamed requests, as a loud tenant sends, without being loud

    @property
    def loud(self) -> bool:
        """A tenant above the fleet's capacity: it sends non-streamed requests (a batch-like client, whose
        figure is the whole answer's latency) and starts ``--lead`` seconds before the others."""
        return self.load > 1.0


#: the runs by name, in their order
RUN_NAMES = ("A-alone", "A-beside", "A-polite", "B-evict-off", "B-evict-on", "C-sdk")
#: the batch-like tenant's requests are this many times the interactive ones' tokens
BATCH_TOKENS_FACTOR = 2  # within max_model_len 512 with the prompt: a longer request is refused 400


def runs(tokens: int, polite_load: float = 0.3) -> dict[str, tuple[tuple[Tenant, ...], bool]]:
    """Each run's tenants (interactive ones ``tokens`` long; the polite one at ``polite_load`` x C) and
    whether eviction is on."""
    quiet = Tenant("quiet", 0.3, tokens)
    critical = Tenant("critical", 0.3, tokens, "critical")
    batch = Tenant("batch", 3.0, BATCH_TOKENS_FACTOR * tokens, "sheddable")
    return {
        "A-alone": ((quiet,), False),
        "A-beside": ((quiet, Tenant("noisy", 3.0, tokens)), False),
        "A-polite": ((quiet, Tenant("polite", polite_load, tokens, batch_like=True)), False),
        "B-evict-off": ((critical, batch), False),
        "B-evict-on": ((critical, batch), True),
        "C-sdk": ((quiet, Tenant("noisy-sdk", 3.0, tokens, sdk=True)), False),
    }


OUTCOMES = ("sent", "ok", "429_retry_after", "429_bare", "503", "other", "error", "unfinished")


#: --tenants: the loud tenants' requests per minute, as a share of the fleet's capacity C (--limit-share).
#: Rate limits share capacity, they do not create it: the quiet tenant keeps its TTFT only while what the
#: limits let in, with its own load, leaves engines room. On these two cores the load generator and the
#: router take CPU from the engines, so they serve about 0.6 x C under this load (the engines' own token
#: throughput shows it), and 0.3 x C for the loud tenant beside the quiet one's 0.3 x C is near that.
NOISY_LIMIT_SHARE = 0.3


def router_config(
    backends: list[str],
    eviction: bool,
    tenants_file: Path | None = None,
    headroom: bool = True,
    headroom_slots: int | None = None,
    instant_share: bool = False,
) -> dict:
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
    if not headroom:  # fair queueing and limits alone: no slot kept free of a tenant past its share
        config |= {"tenant_headroom_slots": 0}
    elif headroom_slots is not None:
        config |= {"tenant_headroom_slots": headroom_slots}
    if instant_share:  # past its share by the count of the moment, not the average over seconds
        config |= {"tenant_share_seconds": 0}
    return config


def write_tenants(log_dir: Path, cap: float, share: float = NOISY_LIMIT_SHARE) -> Path:
    """The tenants declaration of ``--tenants``: equal weights; the noisy tenants limited to
    ``share`` x C requests per minute (their excess refused 429 with retry-after), the quiet
    and critical ones unlimited."""
    limit = max(1, round(share * cap * 60))
    tenants = [{"name": name} for name in ("quiet", "critical", "polite")] + [
        {"name": name, "requests_per_minute": limit} for name in ("noisy", "noisy-sdk", "batch")
    ]
    path = log_dir / "tenants.yaml"
    path.write_text(yaml.safe_dump({"tenants": tenants}))
    return path


#: --llmd: the runs llm-d's flow control takes part in (its priority comes from InferenceObjective
#: resources, which this run does not declare, so scenario B, which is about priority, is ours alone)
LLMD_RUNS = ("A-alone", "A-beside", "C-sdk")
LLMD_PREFIX = "llmd/"  # its default saturation detector (utilization: the engines' scraped metrics)
LLMD_CONC_PREFIX = "llmd-conc/"  # its concurrency detector (the requests it has in flight)
#: llm-d's saturation detector's queue depth: the pool is full at a mean of one waiting request per engine,
#: the point at which ours (``saturation_max_waiting`` 1 under ``--tenants``) holds requests back too
LLMD_QUEUE_DEPTH = 1
LLMD_TTL_S = 30.0  # as our router's queue_timeout


def gateway_config(backends: list[str], picker_target: str) -> dict:
    """Our router in gateway mode asking llm-d's picker, fail-closed: every request is its decision, and
    the gateway waits longer than the picker's flow control may hold a request."""
    return {
        "static_backends": backends,
        "endpoint_picker": f"grpc://{picker_target}",
        "endpoint_picker_fail_open": False,
        "endpoint_picker_timeout": LLMD_TTL_S + 10,
    }


#: --before: the runs a router from before issue 51 takes part in (it has no eviction setting)
BEFORE_RUNS = ("A-alone", "A-beside", "B-evict-off", "C-sdk")
BEFORE_PREFIX = "before/"
#: ``--no-headroom``: ours with ``tenant_headroom_slots`` 0, beside the noisy tenant (alone, one tenant is
#: active and the headroom never applies: the ``A-alone`` row is its baseline too)
NO_HEADROOM_RUNS = ("A-beside", "C-sdk")
NO_HEADROOM_PREFIX = "no-headroom/"
#: ``--instant-share``: ours with ``tenant_share_seconds`` 0 (a tenant past its share by the count of the
#: moment, the rule before the averaging), beside the noisy tenant
INSTANT_SHARE_RUNS = ("A-beside", "C-sdk")
INSTANT_SHARE_PREFIX = "instant-share/"


@contextlib.contextmanager
def our_router(config: dict, env: dict[str, str], log_dir: Path, name: str):  # noqa: ANN201
    """Our router in its own process with ``config`` (its code from ``env``'s PYTHONPATH when set);
    yields its URL; stopped after, by its PID."""
    router, url = engine_bench.start_router(config, log_dir, name, env)
    try:
        yield url
    finally:
        tb.stop_process(router)


@contextlib.contextmanager
def llmd_contender(  # noqa: ANN201
    pool: PoolSite, backends: list[str], log_dir: Path, name: str, max_concurrency: int | None = None
):
    """llm-d's router with its flow control (tenants by the fairness header, round robin between them;
    its utilization detector, or with ``max_concurrency`` its concurrency detector), and our gateway in
    front of it; yields the gateway's URL; both stopped after, each by its PID."""
    epp = LlmdRouterEpp(
        pool.kubeconfig, pool.namespace, pool.pool, log_dir / name,
        config=llmd_flow_control_profile(LLMD_QUEUE_DEPTH, LLMD_TTL_S, max_concurrency),
    )  # fmt: skip
    epp.start(timeout=120, ready_endpoints=len(backends))
    router = None
    try:
        router, url = engine_bench.start_router(gateway_config(backends, epp.target), log_dir, name)
        yield url
    finally:
        if router is not None:
            tb.stop_process(router)
        epp.stop()


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


def _refused(out: dict, status: int, response_headers: Mapping[str, str]) -> None:
    """A refusal, counted by its status (and, for a 429, whether it says when to come back)."""
    if status == 429:
        out["429_retry_after" if "retry-after" in response_headers else "429_bare"] += 1
    elif status == 503:
        out["503"] += 1
    else:  # counted by status too (`other_statuses` in the JSON): a 400 here is the benchmark's own fault
        out["other"] += 1
        statuses = out.setdefault("other_statuses", {})
        statuses[str(status)] = statuses.get(str(status), 0) + 1


async def _loud_one(
    session: aiohttp.ClientSession, url: str, tenant: Tenant, sent_at: float, out: dict
) -> None:
    """One non-streamed request of a loud tenant (aiohttp: thousands of requests held open in a queue
    cost httpx's connection pool more CPU than the router spends on them); its whole latency."""
    try:
        async with session.post(url + "/v1/chat/completions", json=body(tenant, False),
                                headers=headers(tenant)) as r:  # fmt: skip
            await r.read()
            if r.status != 200:
                _refused(out, r.status, r.headers)
                return
    except (TimeoutError, aiohttp.ClientError) as e:
        _error(out, e)
        return
    out["ok"] += 1
    out["ttft"].append(time.monotonic() - sent_at)


async def _streamed_one(client: httpx.AsyncClient, tenant: Tenant, sent_at: float, out: dict) -> None:
    """One streamed request: TTFT at the first SSE event; the outcome counted whatever it is."""
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body(tenant, True),
                                 headers=headers(tenant)) as r:  # fmt: skip
            if r.status_code != 200:
                await r.aread()
                _refused(out, r.status_code, r.headers)
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
    """One non-streamed request through the OpenAI SDK (its own retries on 429 and 5xx, honouring
    retry-after): its latency, retries included."""
    import openai

    try:
        await sdk.chat.completions.create(  # type: ignore[attr-defined]
            model=MODEL, messages=PROMPT, max_tokens=tenant.tokens, stream=False,
            extra_body={"min_tokens": tenant.tokens}, extra_headers=headers(tenant),
        )  # fmt: skip
        out["ok"] += 1
        out["ttft"].append(time.monotonic() - sent_at)
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


async def _tenant_loop(url: str, tenant: Tenant, arrivals: list[float], t0: float, end: float) -> dict:
    """One tenant's requests, each sent at ``t0`` + its arrival (monotonic clock); those not done
    DRAIN_S after ``end`` are cancelled and counted unfinished."""
    import openai

    out = {o: 0 for o in OUTCOMES} | {"ttft": []}
    timeout = DRAIN_S + end - t0
    limits = httpx.Limits(max_connections=4000, max_keepalive_connections=4000)
    async with (
        httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout, connect=10), limits=limits) as client,
        aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=timeout)
        ) as session,
    ):
        sdk = openai.AsyncOpenAI(
            base_url=url + "/v1", api_key="unused", max_retries=SDK_RETRIES, timeout=timeout
        )

        async def one(at: float) -> None:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            out["sent"] += 1
            if tenant.sdk:
                await _sdk_one(sdk, tenant, t0 + at, out)
            elif tenant.loud or tenant.batch_like:
                await _loud_one(session, url, tenant, t0 + at, out)
            else:
                await _streamed_one(client, tenant, t0 + at, out)

        tasks = [asyncio.create_task(one(at)) for at in arrivals]
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        _, pending = await asyncio.wait(tasks, timeout=DRAIN_S) if tasks else (set(), set())
        for task in pending:
            task.cancel()
            out["unfinished"] += 1
        await asyncio.gather(*pending, return_exceptions=True)
        await sdk.close()
    lat = out.pop("ttft")
    out["p50_ms"] = engine_bench.percentile_ms(lat, 0.5)
    out["p99_ms"] = engine_bench.percentile_ms(lat, 0.99)
    return out


def _tenant_process(url: str, tenant: Tenant, arrivals: list[float], t0: float, end: float) -> dict:
    return asyncio.run(_tenant_loop(url, tenant, arrivals, t0, end))


def open_loop(
    url: str, tenants: tuple[Tenant, ...], cap: float, duration: float, seed: int, lead: float
) -> dict:
    """Poisson arrivals per tenant at its load x ``cap`` for ``duration`` s, a loud tenant's from ``lead``
    s before the others' (when the run has others); per tenant: outcomes, TTFTs. Each tenant's client
    runs in a process of its own, so a loud tenant's thousands of requests cannot delay the event loop
    that times the quiet tenant's."""
    rng = random.Random(seed)
    lead = lead if any(not t.loud for t in tenants) and any(t.loud for t in tenants) else 0.0
    plans: dict[str, list[float]] = {}
    for tenant in tenants:
        t = (0.0 if tenant.loud else lead) + rng.expovariate(tenant.load * cap)
        plans[tenant.name] = []
        while t < lead + duration:
            plans[tenant.name].append(t)
            t += rng.expovariate(tenant.load * cap)
    with ProcessPoolExecutor(
        max_workers=len(tenants), mp_context=multiprocessing.get_context("fork")
    ) as pool:
        t0 = time.monotonic() + 1.0  # every process started before the first arrival
        end = t0 + lead + duration
        futures = {t.name: pool.submit(_tenant_process, url, t, plans[t.name], t0, end) for t in tenants}
        return {name: future.result() for name, future in futures.items()}


QUEUE_WAIT = "vllm_stack_router_tenant_queue_wait_seconds"


def add_router_queue_waits(result: dict, url: str, saved: Path) -> None:
    """Each tenant's mean time in the router's queue (``router_queue_wait_mean_ms``, from the router's
    ``tenant_queue_wait_seconds``; absent for a router without it), the rest of its TTFT being the engine's
    queue and prefill; the router's whole /metrics is kept in ``saved``."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return
    saved.write_text(text)
    sums: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.startswith((QUEUE_WAIT + "_sum{", QUEUE_WAIT + "_count{")):
            continue
        labels, value = line.rsplit(" ", 1)
        tenant = labels.split('tenant="', 1)[1].split('"', 1)[0]
        pair = sums.setdefault(tenant, [0.0, 0.0])
        pair[0 if labels.startswith(QUEUE_WAIT + "_sum") else 1] += float(value)
    for tenant, (total, count) in sums.items():
        if tenant in result and count:
            result[tenant]["router_queue_wait_mean_ms"] = 1000 * total / count


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
    runs = list(
        dict.fromkeys(run for r in rounds for run in r)
    )  # a contender that failed to start in a round
    for run in runs:
        table[run] = {}
        for tenant in next(r[run] for r in rounds if run in r):
            row = {}
            for fig in (*FIGURES, "evicted_midstream", "router_queue_wait_mean_ms"):
                vals = [r[run][tenant].get(fig) for r in rounds if run in r]
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

    for prefix in (
        "",
        NO_HEADROOM_PREFIX,
        INSTANT_SHARE_PREFIX,
        BEFORE_PREFIX,
        LLMD_PREFIX,
        LLMD_CONC_PREFIX,
    ):
        baseline = ("" if prefix in (NO_HEADROOM_PREFIX, INSTANT_SHARE_PREFIX) else prefix) + "A-alone"
        alone = p99(baseline, "quiet")
        for run in (prefix + "A-beside", prefix + "C-sdk"):
            beside = p99(run, "quiet")
            if alone is not None and beside is not None:
                ok = beside <= 1.3 * alone
                out.append(f"{'PASS' if ok else 'FAIL'}: quiet p99 TTFT {run} {beside:.0f} ms <= 1.3 x "
                           f"{baseline} {alone:.0f} ms ({beside / alone:.2f} x)")  # fmt: skip
            if run in summary:
                q = summary[run]["quiet"]
                answered = q["ok"]["median"] == q["sent"]["median"]
                out.append(f"{'PASS' if answered else 'FAIL'}: every quiet request answered in {run} "
                           f"({q['ok']['median']:.0f} of {q['sent']['median']:.0f})")  # fmt: skip
    floor = p99("A-polite", "quiet")
    if floor is not None:
        for run in [
            p + r for p in ("", NO_HEADROOM_PREFIX, INSTANT_SHARE_PREFIX) for r in ("A-beside", "C-sdk")
        ]:
            beside = p99(run, "quiet")
            if beside is not None:
                out.append(f"FLOOR: quiet p99 TTFT {run} {beside:.0f} ms against A-polite {floor:.0f} ms, a "
                           f"neighbour at its limit and no more ({beside / floor:.2f} x)")  # fmt: skip
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
        f"{report['rounds']} --tokens {report['tokens']} --max-num-seqs {report['max_num_seqs']} --lead "
        f"{report['lead_s']:g}"
        f"{' --tenants' if report.get('tenants_declared') else ''}"
        f"{' --before ' + report['before_tree'] if report.get('before_tree') else ''}"
        f"{' --no-headroom' if report.get('no_headroom') else ''}"
        f"{' --instant-share' if report.get('instant_share') else ''}"
        f"{' --limit-share ' + format(report['noisy_limit_share'], 'g') if report.get('tenants_declared') else ''}"
        f"{'' if report.get('headroom_slots') is None else ' --headroom-slots ' + str(report['headroom_slots'])}"
        f"{' --llmd' if report.get('llmd') else ''} --label "
        f"{report['label']}` on {report['machine']} at {report['commit']} "
        f"({report['router']}); load average before the run {report['loadavg_before']}, after "
        f"{report['loadavg_after']} (other developers share the 2 cores: compare rows of one run, not "
        "across runs). Two vLLM engines (CPU build, tiny model, `--max-num-seqs "
        f"{report['max_num_seqs']} --scheduling-policy priority`) behind our router (`leastloaded`, priority "
        f"on, `queue_timeout` 30); chat, {report['tokens']} tokens (the batch tenant "
        f"{report.get('batch_tokens', BATCH_TOKENS_FACTOR * report['tokens'])}), streamed by the quiet and critical tenants, "
        f"non-streamed by the loud ones, which start {report['lead_s']:g} s ahead; capacity C = {report['capacity_rps']['median']:.2f} "
        f"requests/s (closed loop at 16, non-streamed, {report['tokens']} tokens); Poisson arrivals for "
        f"{report['duration_s']:g} s per tenant at its load x C. Medians over the rounds, min-max in "
        "brackets; TTFT from the intended send time to the first SSE event (a loud tenant's: to the "
        "whole answer), of 200s only. 'other' "
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
        *(
            [
                "",
                f"`{NO_HEADROOM_PREFIX}` rows: ours with `tenant_headroom_slots: 0`, fair queueing and rate "
                "limits without the slot kept free of a tenant past its share (the rows without a prefix keep "
                "one per engine, the default).",
            ]
            if report.get("no_headroom")
            else []
        ),
        *(
            [
                "",
                f"`{INSTANT_SHARE_PREFIX}` rows: ours with `tenant_share_seconds: 0`, a tenant past its share "
                "by its requests on the engines at the moment (the rows without a prefix: averaged over 5 s, "
                "the default).",
            ]
            if report.get("instant_share")
            else []
        ),
        *(
            [
                "",
                f"`{BEFORE_PREFIX}` rows: the same runs through our router with its code from "
                f"`{report['before_tree']}` (main before issue 51: no tenants, no rate limits, no eviction; "
                "its queue leaves in arrival order within a priority), on the same engines, in the same rounds.",
            ]
            if report.get("before_tree")
            else []
        ),
        *(
            [
                "",
                f"`{LLMD_PREFIX}` rows: the same tenants and engines through llm-d's router "
                f"({report['llmd']['commit'][:12]}) with its flow control (`featureGates: [flowControl]`, "
                "`round-robin-fairness-policy` between the fairness ids, its utilization detector at a queue "
                f"depth of {report['llmd']['queue_depth']} waiting per engine, request TTL "
                f"{report['llmd']['ttl_s']:g} s; `vllm_stack_dev.testbed.upstream_epp.llmd_flow_control_profile`), "
                "reading the engines as an InferencePool's Pods from a test cluster, asked by our router in "
                "gateway mode (fail-closed: every request is its decision). It has no rate limits: what it "
                "refuses is 429 `rejected-ttl-expired` or `rejected-saturated`, without `retry-after`. "
                f"`{LLMD_CONC_PREFIX}` rows: the same with its concurrency detector instead (`maxConcurrency` "
                f"{report['llmd']['max_concurrency']} per engine: the engine's slots and one waiting, where "
                "ours holds requests back; it counts what it sent instead of reading the engines' metrics).",
            ]
            if report.get("llmd")
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
                    help="declare the tenants (loud ones rate-limited to --limit-share x C per minute) and hold "
                    "requests in the router (saturation_max_waiting 1): issue 51's configuration")  # fmt: skip
    ap.add_argument(
        "--runs", default=",".join(RUN_NAMES), help=f"a comma-separated subset of {', '.join(RUN_NAMES)}"
    )
    ap.add_argument("--tokens", type=int, default=128,
                    help="tokens of each interactive request (the batch tenant's: 2 x): sets the capacity C")  # fmt: skip
    ap.add_argument("--max-num-seqs", type=int, default=4, help="each engine's slots: sets the capacity C")
    ap.add_argument("--lead", type=float, default=45.0,
                    help="seconds the loud tenant sends before the others: its rate limit's first minute "
                    "(a full bucket) and the queue it fills are behind it when they start")  # fmt: skip
    ap.add_argument("--limit-share", type=float, default=NOISY_LIMIT_SHARE,
                    help="--tenants: the loud tenants' requests per minute as a share of C (x 60)")  # fmt: skip
    ap.add_argument("--before", metavar="TREE",
                    help=f"also run {', '.join(BEFORE_RUNS)} with the router's code from TREE/router (e.g. "
                    "`git archive 336715e router`, main before issue 51), without tenants, in the same rounds")  # fmt: skip
    ap.add_argument("--no-headroom", action="store_true",
                    help=f"--tenants: also run {', '.join(NO_HEADROOM_RUNS)} through ours with "
                    "tenant_headroom_slots 0 (fair queueing and limits alone), in the same rounds")  # fmt: skip
    ap.add_argument("--instant-share", action="store_true",
                    help=f"--tenants: also run {', '.join(INSTANT_SHARE_RUNS)} through ours with "
                    "tenant_share_seconds 0 (past its share by the count of the moment), in the same rounds")  # fmt: skip
    ap.add_argument("--headroom-slots", type=int,
                    help="--tenants: ours with this tenant_headroom_slots (default: the router's, 1)")  # fmt: skip
    ap.add_argument("--llmd", action="store_true",
                    help=f"also run {', '.join(LLMD_RUNS)} through llm-d's router with its flow control "
                    f"({LLMD_EPP_ENV}: its epp binary), on the same engines, in the same rounds")  # fmt: skip
    args = ap.parse_args(argv)
    if args.llmd and llmd_epp_binary() is None:
        ap.error(f"--llmd: llm-d's router is not built ({LLMD_EPP_ENV}: benchmarks/routing/llmd.md)")
    chosen = [r for r in args.runs.split(",") if r]
    unknown = sorted(set(chosen) - set(RUN_NAMES))
    if unknown:
        ap.error(f"unknown runs: {', '.join(unknown)}")
    tenants_of = runs(args.tokens, args.limit_share)
    quiet = tenants_of["A-alone"][0][0]
    loadavg_before = _loadavg()
    stack = contextlib.ExitStack()
    pool = None
    if args.llmd:  # the engines are the Pods of an InferencePool that llm-d's picker reads
        print("a test cluster with the engines' InferencePool (llm-d's picker reads it)", flush=True)
        pool = stack.enter_context(
            pool_site(Path(tempfile.mkdtemp(prefix="noisy-pool-")), 2, tb.port_for_later())
        )
    engines, log_dir = engine_bench.launch_tiny_engines(
        MODEL,
        "noisy-neighbour-",
        ["--max-num-seqs", str(args.max_num_seqs), "--scheduling-policy", "priority"],
        hosts=pool.hosts if pool else None,
        port=pool.port if pool else None,
    )
    caps: list[float] = []
    rounds: list[dict] = []
    failures: list[str] = []
    try:
        tb.wait_ready(engines, 420)
        backends = [e.url for e in engines]
        caps = engine_bench.measure_capacity(
            engines, router_config(backends, False), log_dir, body(quiet, False), headers(quiet), router_env()
        )
        cap = statistics.median(caps)
        tenants_file = write_tenants(log_dir, cap, args.limit_share) if args.tenants else None
        for i in range(args.rounds):
            result: dict = {}
            for n, run in enumerate(chosen):
                tenants, eviction = tenants_of[run]
                ours = router_config(backends, eviction, tenants_file, headroom_slots=args.headroom_slots)
                contenders = [("", partial(our_router, ours,
                                           router_env(), log_dir, f"{run}-{i}"))]  # fmt: skip
                if args.no_headroom and tenants_file is not None and run in NO_HEADROOM_RUNS:
                    contenders.append((NO_HEADROOM_PREFIX, partial(
                        our_router, router_config(backends, eviction, tenants_file, headroom=False),
                        router_env(), log_dir, f"no-headroom-{run}-{i}")))  # fmt: skip
                if args.instant_share and tenants_file is not None and run in INSTANT_SHARE_RUNS:
                    contenders.append((INSTANT_SHARE_PREFIX, partial(our_router, router_config(
                        backends, eviction, tenants_file, headroom_slots=args.headroom_slots, instant_share=True),
                        router_env(), log_dir, f"instant-share-{run}-{i}")))  # fmt: skip
                if args.before and run in BEFORE_RUNS:
                    before_env = router_env() | {"PYTHONPATH": str(Path(args.before) / "router")}
                    contenders.append((BEFORE_PREFIX, partial(our_router, router_config(backends, False),
                                                              before_env, log_dir, f"before-{run}-{i}")))  # fmt: skip
                if pool is not None and run in LLMD_RUNS:
                    contenders.append(
                        (LLMD_PREFIX, partial(llmd_contender, pool, backends, log_dir, f"llmd-{run}-{i}"))
                    )
                    # its concurrency detector at our saturation point: the engine's slots and one waiting
                    contenders.append((LLMD_CONC_PREFIX, partial(llmd_contender, pool, backends, log_dir,
                                                                 f"llmd-conc-{run}-{i}", args.max_num_seqs + 1)))  # fmt: skip
                for prefix, contender in contenders:
                    name = prefix + run
                    with contextlib.ExitStack() as running:
                        try:
                            url = running.enter_context(contender())
                        except (RuntimeError, TimeoutError) as exc:  # counted as missing, the others go on
                            print(f"round {i + 1} {name}: did not start: {exc}", flush=True)
                            failures.append(f"round {i + 1} {name}: did not start: {str(exc)[:300]}")
                            continue
                        engine_bench.wait_idle(engines)
                        result[name] = open_loop(
                            url, tenants, cap, args.duration, seed=1000 * i + n, lead=args.lead
                        )
                        add_router_queue_waits(
                            result[name], url, log_dir / f"{name.replace('/', '-')}-{i}.metrics"
                        )
                    print(f"round {i + 1} {name}: " + json.dumps(result[name]), flush=True)
            rounds.append(result)
    finally:
        engine_bench.stop_testbed(None, engines)
        stack.close()
    summary = summarize(rounds)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    import vllm_stack

    report = {
        "label": args.label,
        "commit": commit.stdout.strip(),
        # the router's process finds its code on PYTHONPATH first (a "before" tree), else this checkout's
        "router": f"router code from {os.environ.get('PYTHONPATH') or Path(vllm_stack.__file__).parent}",
        "duration_s": args.duration,
        "rounds": args.rounds,
        "tenants_declared": args.tenants,
        "noisy_limit_share": args.limit_share if args.tenants else None,
        "runs": chosen,
        "tokens": args.tokens,
        "max_num_seqs": args.max_num_seqs,
        "lead_s": args.lead,
        "batch_tokens": BATCH_TOKENS_FACTOR * args.tokens,
        "before_tree": args.before,
        "no_headroom": bool(args.no_headroom and args.tenants),
        "instant_share": bool(args.instant_share and args.tenants),
        "headroom_slots": args.headroom_slots if args.tenants else None,
        "llmd": (
            {
                "commit": LLMD_ROUTER_COMMIT,
                "queue_depth": LLMD_QUEUE_DEPTH,
                "ttl_s": LLMD_TTL_S,
                "max_concurrency": args.max_num_seqs + 1,
            }  # fmt: skip
            if args.llmd
            else None
        ),
        "machine": engine_bench.machine_summary(),
        "loadavg_before": loadavg_before,
        "loadavg_after": _loadavg(),
        "capacity_rps": {"median": cap if caps else None, "raw": caps},
        "summary": summary,
        "raw": rounds,
    }
    report["verdicts"] = verdicts(summary) + [f"NOTE: {f}" for f in failures]
    engine_bench.write_report(args.out, report, render, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
