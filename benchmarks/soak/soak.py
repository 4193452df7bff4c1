"""Soak benchmark: the router under N minutes of mixed traffic while its engines fail on a schedule.

What runs (all on 127.0.0.1, all started here and stopped by PID at the end):

- three stub engines (``flaky_stub.py``: the fast stub, 5 ms between streamed tokens, plus a
  close-every-connection mode), and the router (``python -m vllm_stack.router_cli``) in front of them;
- a load generator in this process, ``--concurrency`` workers over raw sockets, each request with a
  unique ``X-Request-Id``, drawn from this mix: chat and completions, streamed and not; invalid JSON;
  an unknown model; a slow reader (a streamed answer read a few bytes at a time); a client that
  disconnects mid-stream; three pipelined requests on one connection; a body over ``--max-body-bytes``;
- faults, one every ``--fault-every`` seconds in turn: engine 0 SIGKILLed and restarted on the same
  port; engine 1 SIGSTOPped for 6 s (longer than the router's request timeout) then SIGCONTed;
  engine 2 closing every connection (open ones at once, new ones on arrival) for 3 s;
- a sampler, every ``--interval`` seconds: the router's RSS (``/proc/PID/status`` VmRSS), open fds
  (``/proc/PID/fd``), and p50/p99 latency of the requests answered in the interval (chat and
  completions, streamed or not, and pipelined ones, successes and errors alike; from writing the
  request to the answer's end).

"Nothing lost": every request is answered exactly once, with a success or a clear error (an
OpenAI-shaped JSON error, or a stream that ends with an error event), its answer carrying its own
request id; the counts per outcome are printed. A client that disconnects on purpose is counted as
``client_left``. Anything else (no answer, a cut without an error event, a wrong or repeated id, a
malformed answer) is ``lost`` and makes the run exit 1.

Writes ``benchmarks/results/soak.{json,md,png}``. Not part of ``make test``; ``make soak`` runs the
default 30 minutes (``SOAK_ARGS="--minutes 3"`` for a short run).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = ROOT / "benchmarks" / "results"
HOST = "127.0.0.1"
MARKER = b"x-vllm-stack-error"
READ_TIMEOUT = 20.0  # no answer byte for this long: the request is lost
MSG = [{"role": "user", "content": "soak"}]

# scenario -> weight
MIX = {
    "chat": 20,
    "chat_stream": 20,
    "completion": 8,
    "completion_stream": 8,
    "bad_json": 6,
    "unknown_model": 6,
    "slow_reader": 4,
    "disconnect": 6,
    "pipelined": 6,
    "too_large": 3,
}


#: Scenarios whose answers (successes and errors alike: a 504 after a stall counts) make the latency
#: samples; a slow reader is slow on purpose, bad inputs are answered at once.
TIMED = frozenset({"chat", "chat_stream", "completion", "completion_stream", "pipelined"})


# ---- processes -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def wait_http(url: str, within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen | None = None
    stopped: bool = False

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def stop(self) -> None:
        """SIGCONT (in case it is stopped), SIGTERM, then SIGKILL after 5 s; only this process."""
        if self.popen is None or self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, signal.SIGCONT)
            os.kill(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(5)


# ---- one request on the wire --------------------------------------------------------------------------
@dataclass
class Answer:
    status: int
    headers: dict[bytes, bytes]
    body: bytes
    complete: bool  # the body ended as its framing says


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b":")
            key = name.strip().lower()
            if key in headers:  # a repeated id or marker would be a bug: keep both to notice
                headers[key] += b"," + value.strip()
            else:
                headers[key] = value.strip()
    return status, headers


async def read_answer(reader: asyncio.StreamReader, slow: bool = False) -> Answer:
    """One response; ``complete`` False when the connection ended inside the body."""
    status, headers = await _read_head(reader)
    parts: list[bytes] = []
    complete = True
    try:
        if b"chunked" in headers.get(b"transfer-encoding", b""):
            while True:
                size = int(
                    (await asyncio.wait_for(reader.readuntil(b"\r\n"), READ_TIMEOUT)).split(b";")[0], 16
                )
                if size == 0:
                    await asyncio.wait_for(reader.readuntil(b"\r\n"), READ_TIMEOUT)
                    break
                if slow:  # a slow reader: a few bytes, a pause, and so on
                    left = size
                    while left:
                        piece = await asyncio.wait_for(reader.readexactly(min(left, 16)), READ_TIMEOUT)
                        parts.append(piece)
                        left -= len(piece)
                        await asyncio.sleep(0.01)
                else:
                    parts.append(await asyncio.wait_for(reader.readexactly(size), READ_TIMEOUT))
                await asyncio.wait_for(reader.readexactly(2), READ_TIMEOUT)
        elif b"content-length" in headers:
            parts.append(
                await asyncio.wait_for(reader.readexactly(int(headers[b"content-length"])), READ_TIMEOUT)
            )
        else:
            while chunk := await asyncio.wait_for(reader.read(65536), READ_TIMEOUT):
                parts.append(chunk)
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        complete = False
    return Answer(status, headers, b"".join(parts), complete)


def request_bytes(path: str, body: bytes, request_id: str, extra: bytes = b"") -> bytes:
    return (
        b"POST %b HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\nX-Request-Id: %b\r\n"
        b"Content-Length: %d\r\n%b\r\n%b" % (path.encode(), request_id.encode(), len(body), extra, body)
    )


def outcome(answer: Answer, request_id: str, stream: bool) -> str:
    """``ok``, ``error:<code>`` (a clear error), ``engine_error:<status>``, or ``lost:<why>``."""
    echoed = answer.headers.get(b"x-request-id", b"").decode("latin-1") == request_id
    if answer.status >= 400:
        try:
            error = orjson.loads(answer.body)["error"]
            code = error["code"]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            return "lost:error_not_openai_shaped" if answer.complete else "lost:cut_error_body"
        if MARKER not in answer.headers:
            return f"engine_error:{answer.status}"
        # A router error on this request's own connection is its answer even when the id is not
        # echoed; shown apart because the id should be there.
        return f"error:{code}" if echoed else f"error:{code}(request id not echoed)"
    if not echoed:
        return "lost:wrong_request_id"
    if not answer.complete:
        return "lost:cut_without_error_event"
    if stream:
        events = [e for e in answer.body.split(b"\n\n") if e.startswith(b"data:")]
        if events and events[-1] == b"data: [DONE]":
            return "ok"
        if events and b'"error"' in events[-1]:
            try:
                return "error:" + str(orjson.loads(events[-1][5:])["error"]["code"]) + "(in stream)"
            except (orjson.JSONDecodeError, KeyError, TypeError):
                return "lost:bad_error_event"
        return "lost:stream_without_done"
    try:
        doc = orjson.loads(answer.body)
    except orjson.JSONDecodeError:
        return "lost:bad_json_answer"
    return "ok" if isinstance(doc, dict) and doc.get("choices") else "lost:no_choices"


# ---- the load generator ---------------------------------------------------------------------------------
@dataclass
class Tally:
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    per_scenario: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    sent: int = 0
    answers: collections.Counter[str] = field(default_factory=collections.Counter)  # request id -> answers
    latencies: list[float] = field(default_factory=list)  # seconds, answered requests, this interval
    lost_examples: list[str] = field(default_factory=list)

    def record(self, scenario: str, request_id: str, result: str, seconds: float | None) -> None:
        self.outcomes[result] += 1
        self.per_scenario[scenario][result] += 1
        if result != "client_left":
            self.answers[request_id] += 1
        if seconds is not None and scenario in TIMED and not result.startswith("lost"):
            self.latencies.append(seconds)
        if result.startswith("lost") and len(self.lost_examples) < 20:
            self.lost_examples.append(f"{scenario} {request_id} {result}")


class LoadGen:
    def __init__(self, port: int, max_body: int, tally: Tally, seed: int) -> None:
        self.port = port
        self.max_body = max_body
        self.tally = tally
        self.rng = random.Random(seed)
        self.counter = 0
        self.scenarios = list(MIX)
        self.weights = [MIX[s] for s in self.scenarios]

    def next_id(self) -> str:
        self.counter += 1
        self.tally.sent += 1
        return f"soak-{self.counter:09d}"

    async def worker(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            scenario = self.rng.choices(self.scenarios, self.weights)[0]
            try:
                await getattr(self, "_" + scenario)(scenario)
            except OSError as exc:  # cannot even connect: the router itself is unwell
                self.tally.record(scenario, self.next_id(), f"lost:connect_{type(exc).__name__}", None)
                await asyncio.sleep(0.1)

    async def _one(self, scenario: str, path: str, body: bytes, stream: bool, slow: bool = False) -> None:
        request_id = self.next_id()
        reader, writer = await asyncio.open_connection(HOST, self.port)
        started = time.perf_counter()
        try:
            writer.write(request_bytes(path, body, request_id))
            try:
                answer = await read_answer(reader, slow=slow)
            except (asyncio.IncompleteReadError, ConnectionError):
                result = "lost:closed_without_answer"
            except TimeoutError:
                result = "lost:timeout"
            else:
                result = outcome(answer, request_id, stream)
            self.tally.record(scenario, request_id, result, time.perf_counter() - started)
        finally:
            writer.close()

    def _body(self, stream: bool, chat: bool = True, model: str = "stub-model") -> bytes:
        if chat:
            return orjson.dumps({"model": model, "messages": MSG, "max_tokens": 8, "stream": stream})
        return orjson.dumps({"model": model, "prompt": "soak", "max_tokens": 8, "stream": stream})

    async def _chat(self, s: str) -> None:
        await self._one(s, "/v1/chat/completions", self._body(False), False)

    async def _chat_stream(self, s: str) -> None:
        await self._one(s, "/v1/chat/completions", self._body(True), True)

    async def _completion(self, s: str) -> None:
        await self._one(s, "/v1/completions", self._body(False, chat=False), False)

    async def _completion_stream(self, s: str) -> None:
        await self._one(s, "/v1/completions", self._body(True, chat=False), True)

    async def _bad_json(self, s: str) -> None:
        await self._one(s, "/v1/chat/completions", b'{"model": "stub-model", "messages": [', False)

    async def _unknown_model(self, s: str) -> None:
        await self._one(s, "/v1/chat/completions", self._body(False, model="no-such-model"), False)

    async def _slow_reader(self, s: str) -> None:
        await self._one(s, "/v1/chat/completions", self._body(True), True, slow=True)

    async def _too_large(self, s: str) -> None:
        body = b'{"model": "stub-model", "prompt": "' + b"x" * (self.max_body + 1024) + b'"}'
        request_id = self.next_id()
        reader, writer = await asyncio.open_connection(HOST, self.port)
        started = time.perf_counter()
        try:
            head, payload = request_bytes("/v1/completions", body, request_id).split(b"\r\n\r\n", 1)
            writer.write(head + b"\r\n\r\n")
            # Not drained: the router answers at the head and stops reading.
            writer.write(payload[: self.max_body + 1024])
            try:
                answer = await read_answer(reader)
                result = outcome(answer, request_id, False)
            except (asyncio.IncompleteReadError, ConnectionError):
                result = "lost:closed_without_answer"
            except TimeoutError:
                result = "lost:timeout"
            self.tally.record(s, request_id, result, time.perf_counter() - started)
        finally:
            writer.close()

    async def _disconnect(self, s: str) -> None:
        request_id = self.next_id()
        reader, writer = await asyncio.open_connection(HOST, self.port)
        try:
            writer.write(request_bytes("/v1/chat/completions", self._body(True), request_id))
            try:
                status, headers = await _read_head(reader)
                if status == 200:
                    await asyncio.wait_for(reader.read(64), READ_TIMEOUT)  # part of the first event
                    result = "client_left"  # on purpose, mid-stream
                else:  # an error instead of a stream: it was answered
                    result = "error:" + str(status) if MARKER in headers else f"engine_error:{status}"
            except (asyncio.IncompleteReadError, ConnectionError):
                result = "lost:closed_without_answer"
            except TimeoutError:
                result = "lost:timeout"
            self.tally.record(s, request_id, result, None)
        finally:
            writer.close()  # mid-stream: the router must abort the engine request

    async def _pipelined(self, s: str) -> None:
        ids = [self.next_id() for _ in range(3)]
        streams = [False, True, False]
        reader, writer = await asyncio.open_connection(HOST, self.port)
        started = time.perf_counter()
        try:
            writer.write(
                b"".join(
                    request_bytes("/v1/chat/completions", self._body(st), i)
                    for i, st in zip(ids, streams, strict=True)
                )
            )
            closed = False
            for request_id, stream in zip(ids, streams, strict=True):
                if closed:
                    self.tally.record(s, request_id, "lost:closed_before_pipelined_answer", None)
                    continue
                try:
                    answer = await read_answer(reader)
                    result = outcome(answer, request_id, stream)
                    closed = b"close" in answer.headers.get(b"connection", b"") or not answer.complete
                except (asyncio.IncompleteReadError, ConnectionError):
                    result, closed = "lost:closed_without_answer", True
                except TimeoutError:
                    result, closed = "lost:timeout", True
                self.tally.record(s, request_id, result, time.perf_counter() - started)
        finally:
            writer.close()


# ---- faults and sampling ------------------------------------------------------------------------------
async def faults(engines: list[Proc], every: float, stop: asyncio.Event, log: list[dict]) -> None:
    """One fault every ``every`` seconds, in turn; each undone before the next starts."""
    t0 = time.monotonic()
    turn = 0
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
        if stop.is_set():
            return
        kind = ("sigkill_restart", "sigstop_6s", "close_connections_3s")[turn % 3]
        engine = engines[turn % 3]
        log.append({"t": round(time.monotonic() - t0, 1), "fault": kind, "engine": engine.name})
        if kind == "sigkill_restart":
            engine.signal(signal.SIGKILL)
            engine.popen.wait(5)  # type: ignore[union-attr]
            await asyncio.sleep(2.0)
            engine.start()
        elif kind == "sigstop_6s":
            engine.signal(signal.SIGSTOP)
            await asyncio.sleep(6.0)
            engine.signal(signal.SIGCONT)
        else:
            engine.signal(signal.SIGUSR1)
            await asyncio.sleep(3.0)
            engine.signal(signal.SIGUSR2)
        turn += 1


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def sampler(pid: int, tally: Tally, interval: float, stop: asyncio.Event, samples: list[dict]) -> None:
    t0 = time.monotonic()
    answered = 0
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)
        lat, tally.latencies = tally.latencies, []
        total = sum(tally.outcomes.values())
        p50, p99 = percentile(lat, 0.50), percentile(lat, 0.99)
        samples.append(
            {
                "t": round(time.monotonic() - t0, 1),
                "rss_kib": rss_kib(pid),
                "fds": open_fds(pid),
                "answered": total - answered,
                "p50_ms": None if p50 is None else round(p50 * 1000, 2),
                "p99_ms": None if p99 is None else round(p99 * 1000, 2),
            }
        )
        answered = total


# ---- the run ---------------------------------------------------------------------------------------------
async def drive(args: argparse.Namespace, router: Proc, engines: list[Proc]) -> dict:
    tally = Tally()
    gen = LoadGen(router_port(router), args.max_body_bytes, tally, args.seed)
    stop = asyncio.Event()
    samples: list[dict] = []
    fault_log: list[dict] = []
    tasks = [asyncio.ensure_future(gen.worker(stop)) for _ in range(args.concurrency)]
    if args.fault_every > 0:
        tasks.append(asyncio.ensure_future(faults(engines, args.fault_every, stop, fault_log)))
    sample_task = asyncio.ensure_future(sampler(router.pid, tally, args.interval, stop, samples))
    deadline = time.monotonic() + args.minutes * 60
    while time.monotonic() < deadline:
        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if router.popen.poll() is not None:  # type: ignore[union-attr]
            print("router exited", file=sys.stderr)
            break
    stop.set()
    # Workers finish the request they are in (bounded by READ_TIMEOUT per read).
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), READ_TIMEOUT * 3)
    await sample_task
    twice = [request_id for request_id, n in tally.answers.items() if n > 1]
    return {"tally": tally, "samples": samples, "faults": fault_log, "answered_twice": twice}


def router_port(router: Proc) -> int:
    return int(router.argv[router.argv.index("--port") + 1])


def report(args: argparse.Namespace, result: dict, started: str, wall: float) -> tuple[str, bool]:
    tally: Tally = result["tally"]
    samples = result["samples"]
    lost = sum(v for k, v in tally.outcomes.items() if k.startswith("lost"))
    answered = sum(tally.outcomes.values())
    unanswered = tally.sent - answered
    ok = lost == 0 and unanswered == 0 and not result["answered_twice"]
    steady = samples[1:] if len(samples) > 2 else samples  # the first interval includes warm-up
    rss = [s["rss_kib"] for s in steady]
    fds = [s["fds"] for s in steady]
    p99 = [s["p99_ms"] for s in steady if s["p99_ms"] is not None]
    lines = [
        f"# Router soak ({args.minutes:g}-minute run{'' if args.minutes >= 30 else ', shorter than the default 30'})",
        "",
        f"Started {started}, {wall:.0f} s wall, {args.concurrency} client workers, 3 stub engines "
        f"(flaky_stub.py, 5 ms token gap), {f'a fault every {args.fault_every:g} s' if args.fault_every > 0 else 'no faults'}, sampled every {args.interval:g} s.",
        *(["", args.note] if args.note else []),
        "",
        "| measure | first sample | last sample | min | max |",
        "|---|---|---|---|---|",
        f"| router RSS (MiB) | {rss[0] / 1024:.1f} | {rss[-1] / 1024:.1f} | {min(rss) / 1024:.1f} | {max(rss) / 1024:.1f} |",
        f"| router open fds | {fds[0]} | {fds[-1]} | {min(fds)} | {max(fds)} |",
        f"| p99 latency per interval (ms) | {p99[0]:.1f} | {p99[-1]:.1f} | {min(p99):.1f} | {max(p99):.1f} |"
        if p99
        else "| p99 latency | - | - | - | - |",
        "",
        f"Requests sent {tally.sent}, answered {answered}, unanswered {unanswered}, "
        f"answered twice {len(result['answered_twice'])}, lost {lost}: "
        + ("**nothing lost**" if ok else "**LOST REQUESTS**"),
        "",
        "| outcome | count |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in sorted(tally.outcomes.items(), key=lambda kv: (-kv[1], kv[0]))],
        "",
        "| scenario | outcomes |",
        "|---|---|",
        *[
            f"| {s} | " + ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])) + " |"
            for s, c in sorted(tally.per_scenario.items())
        ],
        "",
        f"Faults injected: {len(result['faults'])} ("
        + ", ".join(f"{k} {v}" for k, v in collections.Counter(f["fault"] for f in result["faults"]).items())
        + ").",
    ]
    if tally.lost_examples:
        lines += ["", "Lost (first 20):", *[f"- {x}" for x in tally.lost_examples]]
    return "\n".join(lines) + "\n", ok


def plot(samples: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    axes[0].plot(t, [s["rss_kib"] / 1024 for s in samples])
    axes[0].set_ylabel("router RSS (MiB)")
    axes[1].plot(t, [s["fds"] for s in samples])
    axes[1].set_ylabel("router open fds")
    axes[2].plot(t, [s["p99_ms"] if s["p99_ms"] is not None else float("nan") for s in samples], label="p99")
    axes[2].plot(t, [s["p50_ms"] if s["p50_ms"] is not None else float("nan") for s in samples], label="p50")
    axes[2].set_ylabel("latency (ms)")
    axes[2].set_xlabel("minutes")
    axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--fault-every", type=float, default=10.0, help="seconds between faults (0: none, a baseline)"
    )
    p.add_argument("--note", default="", help="a line added to the table (e.g. what else ran on the machine)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--max-body-bytes", type=int, default=64 * 1024)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for soak.json, soak.md, soak.png")
    args = p.parse_args()
    if args.minutes <= 0 or args.minutes > 24 * 60:
        p.error("--minutes must be in (0, 1440]")

    import uvloop

    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"vllm-stack-soak-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    engines = [
        Proc(
            f"engine-{i}",
            [py, str(HERE / "flaky_stub.py"), "--port", str(free_port())],
            logs / f"engine-{i}.log",
        )
        for i in range(3)
    ]
    backends = ",".join(f"http://{HOST}:{e.argv[-1]}" for e in engines)
    env_router = [
        py, "-m", "vllm_stack.router_cli", "--host", HOST, "--port", str(free_port()),
        "--static-backends", backends, "--health-check-interval", "1", "--engine-scrape-interval", "1",
        "--request-timeout", "4", "--max-body-bytes", str(args.max_body_bytes), "--log-level", "warning",
    ]  # fmt: skip
    router = Proc("router", env_router, logs / "router.log")
    procs = [*engines, router]
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    t0 = time.monotonic()
    try:
        for proc in procs:
            proc.start()
        wait_http(f"http://{HOST}:{router_port(router)}/health")
        deadline = time.monotonic() + 30
        while True:  # every engine healthy in the router's eyes
            with urllib.request.urlopen(f"http://{HOST}:{router_port(router)}/ready", timeout=2) as r:
                if json.load(r).get("healthy_engines") == 3:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"engines not healthy; logs in {logs}")
            time.sleep(0.2)
        result = uvloop.run(drive(args, router, engines))
    finally:
        for proc in reversed(procs):
            proc.stop()
    wall = time.monotonic() - t0
    table, ok = report(args, result, started, wall)
    print(table)
    tally: Tally = result["tally"]
    (args.out / "soak.md").write_text(table)
    (args.out / "soak.json").write_text(
        json.dumps(
            {
                "started": started,
                "minutes": args.minutes,
                "concurrency": args.concurrency,
                "fault_every_s": args.fault_every,
                "interval_s": args.interval,
                "sent": tally.sent,
                "outcomes": dict(tally.outcomes),
                "per_scenario": {k: dict(v) for k, v in tally.per_scenario.items()},
                "answered_twice": result["answered_twice"],
                "faults": result["faults"],
                "samples": result["samples"],
                "nothing_lost": ok,
            },
            indent=1,
        )
        + "\n"
    )
    plot(result["samples"], args.out / "soak.png", f"router soak, {args.minutes:g} min")
    print(f"wrote {args.out}/soak.md, soak.json, soak.png; process logs in {logs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
