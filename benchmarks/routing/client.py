"""The load generator and the engine-side measurements of the routing-quality benchmark.

Closed loop: `concurrency` workers take the workload's requests in order; a request of a conversation
waits until the previous round of that conversation has finished (a user reads the answer before
asking again). TTFT is measured here, at the client, from sending the request to the first streamed
chunk that carries content, so it includes the router's own time and any queueing it causes.

The engines are the referee: the prefix-cache hit rate, the requests per engine and the generated
tokens come from each engine's own Prometheus counters (deltas over the run), not from the routers.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp
from workloads import SESSION_HEADER, Request, Workload

COUNTERS = (
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
    "vllm:request_success_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
)
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass
class Outcome:
    """What the client saw of one request."""

    ok: bool
    ttft_s: float | None = None
    latency_s: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


@dataclass
class RunResult:
    """One workload through one contender: client outcomes plus the engines' counter deltas."""

    wall_s: float
    outcomes: list[Outcome]
    engine_deltas: list[dict[str, float]] = field(default_factory=list)
    router_metrics: list[str] = field(default_factory=list)  # the router's own cache/policy counters


def parse_metrics(text: str, names: Iterable[str]) -> dict[str, float]:
    """Sum every sample of each metric in `names` (all label sets) from Prometheus exposition text."""
    wanted = set(names)
    totals = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


async def scrape(session: aiohttp.ClientSession, url: str, names: Iterable[str]) -> dict[str, float]:
    """One engine's metrics in `names` (the engine's own /metrics)."""
    async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as response:
        response.raise_for_status()
        return parse_metrics(await response.text(), names)


async def wait_idle(session: aiohttp.ClientSession, urls: list[str], limit_s: float = 300.0) -> None:
    """Until every engine reports 0 running and 0 waiting requests (a run must not inherit load)."""
    deadline = time.monotonic() + limit_s
    while True:
        values = [await scrape(session, url, GAUGES) for url in urls]
        if all(sum(v.values()) == 0 for v in values):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"engines not idle after {limit_s:.0f} s: {values}")
        await asyncio.sleep(0.5)


async def reset_prefix_caches(session: aiohttp.ClientSession, urls: list[str]) -> None:
    """POST /reset_prefix_cache on every engine (needs VLLM_SERVER_DEV_MODE=1), after they are idle.

    vLLM refuses the reset while requests hold blocks, so wait for idle first and retry briefly."""
    await wait_idle(session, urls)
    for url in urls:
        for _attempt in range(20):
            async with session.post(f"{url}/reset_prefix_cache") as response:
                body = await response.text()
                if response.status == 200 and "false" not in body.lower():
                    break
            await asyncio.sleep(0.5)
        else:
            raise RuntimeError(f"{url}/reset_prefix_cache kept failing: {response.status} {body[:200]}")


def request_body(request: Request, model: str, max_tokens: int) -> dict:
    """The chat request sent for `request`: streamed, greedy, `max_tokens` tokens, usage included."""
    body: dict = {
        "model": model,
        "messages": request.messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # random weights may emit EOS at once; a fixed output length is fairer
    }
    if request.session:
        body["user"] = request.session
    return body


@dataclass
class StreamRead:
    """What one streamed chat answer said: when each event with content arrived, and its usage."""

    stamps: list[float] = field(default_factory=list)  # time.perf_counter() per event with content
    prompt_tokens: int = 0
    output_tokens: int = 0


async def read_stream(response: aiohttp.ClientResponse) -> StreamRead:
    """Read an SSE chat stream to its end (JSON errors raise ValueError, as the callers expect)."""
    read = StreamRead()
    async for raw in response.content:
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        event = json.loads(line[5:])
        if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
            read.stamps.append(time.perf_counter())
        usage = event.get("usage")
        if usage:
            read.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            read.output_tokens = int(usage.get("completion_tokens") or 0)
    return read


async def send(
    session: aiohttp.ClientSession, url: str, request: Request, model: str, max_tokens: int
) -> Outcome:
    """Send one streamed chat request; TTFT at the first chunk with content."""
    headers = {"content-type": "application/json"}
    if request.session:
        headers[SESSION_HEADER] = request.session
    payload = json.dumps(request_body(request, model, max_tokens))
    started = time.perf_counter()
    outcome = Outcome(ok=False)
    try:
        async with session.post(f"{url}/v1/chat/completions", data=payload, headers=headers) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return outcome
            stream = await read_stream(response)
            chunks = len(stream.stamps)
            outcome.ttft_s = stream.stamps[0] - started if stream.stamps else None
            outcome.prompt_tokens, outcome.output_tokens = stream.prompt_tokens, stream.output_tokens
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        return outcome
    outcome.latency_s = time.perf_counter() - started
    outcome.output_tokens = outcome.output_tokens or chunks
    outcome.ok = True
    return outcome


async def drive(
    url: str, workload: Workload, model: str, concurrency: int, max_tokens: int
) -> tuple[float, list[Outcome]]:
    """Closed loop of `concurrency` workers over the workload; (wall seconds, outcome per request)."""
    outcomes: list[Outcome | None] = [None] * len(workload.requests)
    finished = {r.index: asyncio.Event() for r in workload.requests}
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for request in workload.requests:
        queue.put_nowait(request)
    timeout = aiohttp.ClientTimeout(total=600, sock_read=300)
    connector = aiohttp.TCPConnector(limit=concurrency)

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            request = queue.get_nowait()
            if request.after is not None:
                await finished[request.after].wait()
            outcomes[request.index] = await send(session, url, request, model, max_tokens)
            finished[request.index].set()

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return wall, [o if o is not None else Outcome(False, error="not sent") for o in outcomes]


async def measured_run(
    url: str, engine_urls: list[str], workload: Workload, model: str, concurrency: int, max_tokens: int
) -> RunResult:
    """Reset the engines' caches, wait for idle, drive the workload, and take the counters' deltas."""
    async with aiohttp.ClientSession() as session:
        await reset_prefix_caches(session, engine_urls)
        before = [await scrape(session, u, COUNTERS) for u in engine_urls]
    wall, outcomes = await drive(url, workload, model, concurrency, max_tokens)
    async with aiohttp.ClientSession() as session:
        await wait_idle(session, engine_urls)
        after = [await scrape(session, u, COUNTERS) for u in engine_urls]
    deltas = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)]
    return RunResult(wall, outcomes, deltas)
