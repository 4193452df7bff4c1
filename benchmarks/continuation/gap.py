"""A stream that survives its engine: how long the client waits for its next token when the engine dies.

Two tiny CPU vLLM engines A and B (the test bed's, one core each). Engine A is reached through a TCP
proxy that the benchmark can "kill": it drops every connection at once (as the kernel does when an engine
process dies) and refuses new ones until it is "revived". Every contender is started the same way over
the proxy's address for A and B's own:

- ``ours-continued``: our router (round-robin, continuation on, the default): the stream goes on on B;
- ``ours-client-retry``: our router with ``--no-stream-continuation``: the stream ends with an error event
  and the client sends the request again;
- ``rust-client-retry``: the Rust ``vllm-router==0.1.17`` (round-robin), which has no continuation: its
  stream is cut and the client sends the request again (answers of 5xx are retried by the client too).

One round per cut point and contender: a streamed chat completion (``ignore_eos``, ``max_tokens`` =
cut point + 64) goes to A; after ``k`` token events the proxy kills A. Measured at the client, from the
kill: the time to the next new token (continued: the continuation's first event, which ends the longest
wait after the kill, since events A sent before it died may still arrive first; client retry: the retried
stream's event number k + 1, the first the client did not have), and whether the answer the
client holds in the end is whole (k + 64 content events, no error). The normal inter-token gap (median
before the kill) is the reference. Rounds rotate the contenders' order; the proxy is revived and each
router sees A healthy again before the next round.

Usage: ``python benchmarks/continuation/gap.py [--rounds 5] [--cuts 16,128,384]
[--contenders ours-continued,ours-client-retry,rust-client-retry] [--out PATH]``; prints a table and
writes ``benchmarks/results/stream_continuation_gap.{md,json}`` (or ``PATH.{md,json}``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "router", ROOT / "benchmarks" / "routing", ROOT / "benchmarks"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import aiohttp  # noqa: E402
from contenders import Contender, Setup, _rust, add_router_benchmarks_to_path, start, wait_ready  # noqa: E402
from engine_bench import launch_tiny_engines, markdown_table, percentile_ms, write_report  # noqa: E402
from vllm_stack_dev.testbed import engines as tb  # noqa: E402

add_router_benchmarks_to_path()

MODEL = "tiny-llama"
TAIL = 64  # tokens after the cut point: the continuation's (or the retry's) part
OURS = ROOT / ".venv" / "bin" / "vllm-stack"
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "stream_continuation_gap"


class KillableProxy:
    """A TCP proxy in front of engine A that can play its death: :meth:`kill` aborts every connection (the
    router reads the stream's end, as from a dead process) and stops listening (connections refused);
    :meth:`revive` listens again on the same port."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = tb.port_for_later()
        self.server: asyncio.Server | None = None
        self.live: set[asyncio.Transport] = set()
        self.requests = 0  # connections that carried a request to A (the revive check)

    async def revive(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def kill(self) -> None:
        assert self.server is not None
        self.server.close()
        for transport in list(self.live):
            transport.abort()
        self.live.clear()
        await self.server.wait_closed()
        self.server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer.transport, up_writer.transport)
        self.live.update(pair)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, counts: bool) -> None:
            with contextlib.suppress(ConnectionError, asyncio.CancelledError):
                while data := await src.read(65536):
                    if counts and data.startswith(b"POST "):
                        self.requests += 1
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))
        self.live.difference_update(pair)


def ours(continuation: bool) -> Contender:
    def command(setup: Setup, port: int, _metrics_port: int) -> list[str]:
        args = [str(OURS), "router", "--host", "127.0.0.1", "--port", str(port),
                "--static-backends", ",".join(setup.engine_urls), "--routing-logic", "roundrobin",
                "--health-check-interval", "0.5", "--log-level", "warning"]  # fmt: skip
        return args if continuation else [*args, "--no-stream-continuation"]

    return Contender("ours-continued" if continuation else "ours-client-retry", "ours", command)


CONTENDERS = {
    "ours-continued": ours(True),
    "ours-client-retry": ours(False),
    "rust-client-retry": Contender("rust-client-retry", "rust", _rust("round_robin")),
}


@dataclass
class Round:
    contender: str
    cut: int
    gap_s: float | None = None  # kill -> the client's next new content event
    itl_s: float | None = None  # median gap between content events before the kill
    events: int = 0  # content events the client holds in the end (the retry's, from a retry)
    whole: bool = False
    retries: int = 0
    error: str = ""
    notes: list[str] = field(default_factory=list)


def request(cut: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": cut + TAIL,
        "stream": True,
        "ignore_eos": True,
    }


async def content_events(response: aiohttp.ClientResponse):  # noqa: ANN201 - an async generator
    """(time, kind) per SSE event: "token" (content), "error", "done"; a cut connection ends it."""
    with contextlib.suppress(aiohttp.ClientPayloadError, aiohttp.ClientConnectionError):
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter()
            data = line[6:].strip()
            if data == b"[DONE]":
                yield now, "done"
                return
            event = json.loads(data)
            if "error" in event:
                yield now, "error"
                return
            for choice in event.get("choices") or ():
                delta = choice.get("delta") or {}
                if isinstance(delta.get("content"), str) and not delta.get("role"):
                    yield now, "token"  # one per token (its text empty while a character is incomplete)


async def one_round(
    session: aiohttp.ClientSession, url: str, proxy: KillableProxy, name: str, cut: int
) -> Round:
    result = Round(name, cut)
    body = request(cut)
    times: list[float] = []
    killed_at = 0.0
    ended = ""
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            result.error = f"status {response.status}"
            return result
        async for now, kind in content_events(response):
            if kind != "token":
                ended = kind
                break
            times.append(now)
            if len(times) == cut and not killed_at:
                await proxy.kill()
                killed_at = time.perf_counter()
    head = times[:cut]
    if len(head) > 1:
        result.itl_s = statistics.median(b - a for a, b in zip(head, head[1:], strict=False))
    if killed_at and ended == "done":
        # the continuation's first event ends the longest wait after the kill (events the first engine sent
        # before it died may still arrive first, at once)
        after = [killed_at] + times[cut:]
        waits = [(b - a, b) for a, b in zip(after, after[1:], strict=False)]
        if waits:
            result.gap_s = max(waits)[1] - killed_at
        result.events, result.whole = len(times), True  # one answer, continued (vLLM: one token per event)
        return result
    if not killed_at:
        result.error = f"the stream ended after {len(times)} events, before the cut"
        return result
    # the stream broke (no continuation): the client sends the request again, as a client of such a router must
    for attempt in range(1, 6):
        result.retries = attempt
        retried: list[float] = []
        ended = ""
        async with session.post(url + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                await response.read()
                continue
            async for now, kind in content_events(response):
                if kind != "token":
                    ended = kind
                    break
                retried.append(now)
                if len(retried) == cut + 1:
                    result.gap_s = now - killed_at
        if ended == "done":
            result.events, result.whole = len(retried), True
            return result
    result.error = "no whole answer after 5 retries"
    return result


async def revive(proxy: KillableProxy, session: aiohttp.ClientSession, url: str) -> None:
    """Revive A and wait until the router sends it a request again (it saw A healthy)."""
    await proxy.revive()
    before = proxy.requests
    deadline = time.monotonic() + 60
    while proxy.requests == before:
        if time.monotonic() > deadline:
            raise TimeoutError("the router did not send a request to the revived engine in 60 s")
        short = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        with contextlib.suppress(aiohttp.ClientError):
            async with session.post(url + "/v1/chat/completions", json=short) as response:
                await response.read()
        await asyncio.sleep(0.2)


async def run(args: argparse.Namespace) -> dict:
    engines, log_dir = launch_tiny_engines(MODEL, "continuation-gap-", [])
    rounds: list[Round] = []
    try:
        tb.wait_ready(engines, 600)
        proxy = KillableProxy(engines[0].port)
        await proxy.revive()
        setup = Setup([f"http://127.0.0.1:{proxy.port}", engines[1].url], [None, None], MODEL, Path(), 16)
        names = args.contenders.split(",")
        cuts = [int(c) for c in args.cuts.split(",")]
        timeout = aiohttp.ClientTimeout(total=600, sock_read=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for index in range(args.rounds):
                order = names[index % len(names) :] + names[: index % len(names)]
                for name in order:
                    if proxy.server is None:  # A listens before a router starts (the Rust one asks it first)
                        await proxy.revive()
                    router = start(
                        CONTENDERS[name],
                        setup,
                        tb.port_for_later(),
                        tb.port_for_later(),
                        log_dir,
                        f"{name}-{index}",
                    )
                    try:
                        # in a thread: the proxy serves on this loop (the Rust router asks A for /v1/models)
                        await asyncio.to_thread(wait_ready, router, MODEL, 120)
                        for cut in cuts:
                            await revive_if_dead(proxy, session, router.url)
                            await steer_to_a(proxy, session, router.url)
                            result = await one_round(session, router.url, proxy, name, cut)
                            rounds.append(result)
                            print(f"round {index} {name} cut {cut}: gap {result.gap_s} whole {result.whole} "
                                  f"retries {result.retries} {result.error}", flush=True)  # fmt: skip
                    finally:
                        router.stop()
    finally:
        for engine in engines:
            engine.stop()
    return report(args, rounds)


async def revive_if_dead(proxy: KillableProxy, session: aiohttp.ClientSession, url: str) -> None:
    if proxy.server is None:
        await revive(proxy, session, url)


async def steer_to_a(proxy: KillableProxy, session: aiohttp.ClientSession, url: str) -> None:
    """Round-robin: send short requests until the last one went to B, so the next goes to A."""
    short = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for _ in range(4):
        before = proxy.requests
        async with session.post(url + "/v1/chat/completions", json=short) as response:
            await response.read()
        if proxy.requests == before:  # it went to B
            return
    raise RuntimeError("round-robin did not alternate between the engines")


def report(args: argparse.Namespace, rounds: list[Round]) -> dict:
    rows = []
    for name in args.contenders.split(","):
        for cut in (int(c) for c in args.cuts.split(",")):
            mine = [r for r in rounds if r.contender == name and r.cut == cut]
            gaps = [r.gap_s for r in mine if r.gap_s is not None and r.whole]
            itls = [r.itl_s for r in mine if r.itl_s is not None]
            rows.append(
                {
                    "contender": name,
                    "cut": cut,
                    "rounds": len(mine),
                    "whole": sum(r.whole for r in mine),
                    "gap_p50_ms": percentile_ms(gaps, 0.5),
                    "gap_max_ms": max(gaps) * 1e3 if gaps else None,
                    "gap_min_ms": min(gaps) * 1e3 if gaps else None,
                    "itl_p50_ms": percentile_ms(itls, 0.5),
                    "client_retries": sum(r.retries for r in mine),
                    "errors": [r.error for r in mine if r.error],
                }
            )
    return {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "rounds": args.rounds,
        "tail": TAIL,
        "rows": rows,
        "raw": [r.__dict__ for r in rounds],
    }


def table(result: dict) -> list[str]:
    columns = ("contender", "tokens before the kill", "whole answers", "next token after the kill, ms p50 (min-max)",
               "normal gap, ms p50", "client retries")  # fmt: skip
    body = []
    for row in result["rows"]:
        gap = (
            "-"
            if row["gap_p50_ms"] is None
            else f"{row['gap_p50_ms']:.0f} ({row['gap_min_ms']:.0f}-{row['gap_max_ms']:.0f})"
        )
        itl = "-" if row["itl_p50_ms"] is None else f"{row['itl_p50_ms']:.0f}"
        body.append(
            [
                row["contender"],
                str(row["cut"]),
                f"{row['whole']}/{row['rounds']}",
                gap,
                itl,
                str(row["client_retries"]),
            ]
        )
    return markdown_table(columns, body, left_columns=2)


def render(result: dict) -> str:
    lines = ["# A stream that survives its engine: the client's wait for its next token", ""]
    lines += [
        f"{result['when']}, {result['rounds']} rounds, {result['tail']} tokens after the kill (benchmarks/continuation/gap.py).",
        "",
    ]
    lines += table(result)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cuts", default="16,128,384")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    result = asyncio.run(run(args))
    write_report(args.out, result, render, lambda r: print("\n".join(table(r))))


if __name__ == "__main__":
    main()
