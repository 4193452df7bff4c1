"""The cost of a pick: our endpoint picker, the Inference Extension's EPP v1.5.0 and llm-d's router, driven
side by side by one Envoy-like driver with the same request stream.

What is measured, per picker and cell (concurrency 1 and 16, prompts of about 1k and 16k tokens):
- the picker process's CPU per 1,000 picks (``/proc/<pid>/stat`` user + system over the measured picks,
  all of its threads), and the same with its idle CPU taken out (what it burns with no request: metric
  scrapes, watches, timers; measured over a few seconds before the cell and scaled to the cell's time);
- the pick's latency, p50 and p99: from the first message of the stream to the answer that names the
  endpoint (after the body, for all three: each reads the body before it picks).

The driver is this process, on core 1 with the two stub engines; each picker is pinned to core 0 (all
its threads), so a picker's CPU is its own. Each pick is one ext_proc stream on one shared gRPC channel
per concurrent worker (as a gateway keeps its connection to the picker): request headers, the request
body in one message with end of stream, then the driver reads until the body's answer (or an immediate
response) and half-closes the stream; no response phase (a pick needs none). The prompts are one of 16
documents of the cell's length plus a question of 20 words unique to the request (seeded, the same for
every picker), sent as a chat completion for the stub engines' model.

The pickers (each started fresh for a cell, the order rotated every repeat):
- ``ours``: ``vllm-stack epp --routing-logic prefixaware`` over the two stub engines (static backends);
- ``ours-before`` (with ``--before-tree DIR``): the same, running the router package of another checkout
  (DIR/router first on PYTHONPATH), so a change is measured against its base in one run;
- ``grpc-floor`` (with ``--pickers``): grpcio's asyncio server answering each pick with nothing behind it
  (``extproc_floor.py``), the part of our picker's cost that is grpcio's; ``grpc-floor-sync``, ``-raw``
  and ``-sync-raw``: the same on grpcio's synchronous server and/or with raw-bytes handlers;
- ``upstream-epp``: the EPP v1.5.0 (``make install`` builds it) with its default configuration;
- ``llmd-router``: llm-d's router (``VLLM_STACK_LLMD_EPP``, benchmarks/routing/llmd.md), its default
  profile; both upstream pickers read an InferencePool of two Pods on a test cluster's real API server,
  whose IPs the two stub engines listen on (``vllm_stack_dev.testbed.inference_pool``).

The stub engines (``fast_stub.py``) answer ``/metrics`` with vLLM's gauge names at 0; nothing is sent to
them but scrapes. Not measured here: the gateway's side of the hop (``endpoint_picker_hop.py``).

Usage: ``.venv/bin/python benchmarks/router/picker_cost.py [--repeat 3] [--picks 600] [--pickers ours,...]``;
results: benchmarks/results/picker_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import PY, ROOT, cpu_times, end_all, free_port, pct, start, wait_ready  # noqa: E402
from vllm_stack_dev.testbed.inference_pool import PoolSite, pool_site  # noqa: E402
from vllm_stack_dev.testbed.upstream_epp import LlmdRouterEpp, UpstreamEpp, llmd_epp_binary  # noqa: E402

from vllm_stack.extproc import wire  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODEL = "stub-model"
#: Words per token of the corpus below, about: 1k-token prompts are 770 words.
WORDS_PER_TOKEN = 0.77
DOCUMENTS = 16
QUESTION_WORDS = 20
IDLE_SECONDS = 3.0
STOP_SECONDS = 60.0  # a picker's graceful stop, at most (minutes on a machine loaded 20 times over)
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu river stone cloud field market "
         "window garden engine silver purple orange yellow winter summer autumn spring").split()  # fmt: skip


def prompts(tokens: int, count: int, seed: int) -> list[bytes]:
    """``count`` chat bodies: one of :data:`DOCUMENTS` documents of about ``tokens`` tokens, then a question
    unique to the request."""
    rng = random.Random(seed)
    words = max(1, int(tokens * WORDS_PER_TOKEN))
    docs = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(DOCUMENTS)]
    bodies = []
    for i in range(count):
        question = " ".join(rng.choice(WORDS) for _ in range(QUESTION_WORDS))
        messages = [{"role": "system", "content": docs[i % DOCUMENTS]}, {"role": "user", "content": question}]
        bodies.append(json.dumps({"model": MODEL, "messages": messages, "max_tokens": 8}).encode())
    return bodies


def _headers(body: bytes, rid: str) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "gateway.example"),
            (":scheme", "http"), ("content-type", "application/json"), ("content-length", str(len(body))),
            ("x-request-id", rid)]  # fmt: skip


async def pick(stub: pb_grpc.ExternalProcessorStub, body: bytes, rid: str) -> tuple[float, str]:
    """One pick on an open channel: (seconds from the first message to the answer naming the endpoint, the
    answer's kind: ``request_body``, ``request_headers`` or ``immediate_response``)."""
    call = stub.Process(timeout=30)
    began = time.perf_counter()
    await call.write(
        wire.ProcessingRequest(
            request_headers=wire.pb.HttpHeaders(headers=wire.header_map(_headers(body, rid)))
        )
    )
    await call.write(wire.ProcessingRequest(request_body=wire.pb.HttpBody(body=body, end_of_stream=True)))
    kind = "eof"
    while True:
        answer = await call.read()
        if answer is grpc.aio.EOF:
            break
        kind = answer.WhichOneof("response")
        if kind in ("request_body", "immediate_response"):
            break
    took = time.perf_counter() - began
    await call.done_writing()
    call.cancel()
    return took, kind


async def drive(
    target: str, bodies: list[bytes], concurrency: int, tag: str
) -> tuple[list[float], int, float]:
    """Every body picked once, ``concurrency`` at a time (a channel each): (latencies, errors, wall s)."""
    queue = list(enumerate(bodies))
    latencies: list[float] = []
    errors = 0

    async def worker() -> None:
        nonlocal errors
        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            while queue:
                index, body = queue.pop()
                try:
                    took, kind = await pick(stub, body, f"{tag}-{index}")
                except grpc.aio.AioRpcError:
                    errors += 1
                    continue
                if kind != "request_body":
                    errors += 1
                latencies.append(took)

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, errors, time.perf_counter() - began


def pin(pid: int, core: int) -> None:
    """Every thread of ``pid`` on ``core``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {core})


def cpu(pid: int) -> float:
    return sum(cpu_times(pid))


def _wait_listening(process: subprocess.Popen[bytes], host: str, port: int, timeout: float = 30.0) -> None:
    """Until ``process`` accepts connections on ``host:port`` (a Pod's loopback IP)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{process.args} not listening on {host}:{port} (exit code {process.poll()})")


class Picker:
    """A picker started for one cell: its ext_proc target and its PID; :meth:`stop` ends it."""

    def __init__(self, name: str, site: PoolSite, work: Path, before: Path | None = None) -> None:
        self.name = name
        self.upstream: UpstreamEpp | None = None
        self.process: subprocess.Popen[bytes] | None = None
        if name.startswith("grpc-floor"):
            grpc_port = free_port()
            variant = ["--server", "sync"] if "-sync" in name else []
            variant += ["--raw"] if name.endswith("-raw") else []
            process = start([PY, "benchmarks/router/extproc_floor.py", "--port", str(grpc_port), *variant], 0)
            self.process = process
            _wait_listening(process, "127.0.0.1", grpc_port)
            self.target, self.pid = f"127.0.0.1:{grpc_port}", process.pid
        elif name in ("ours", "ours-before"):
            http, grpc_port = free_port(), free_port()
            backends = ",".join(f"http://{h}:{site.port}" for h in site.hosts)
            process = start([PY, "-m", "vllm_stack.cli", "epp", "--host", "127.0.0.1", "--port", str(http),
                             "--ext-proc-port", str(grpc_port), "--static-backends", backends,
                             "--routing-logic", "prefixaware", "--log-level", "warning"], 0,
                            env=_before_env(before) if name == "ours-before" else None)  # fmt: skip
            self.process = process
            try:
                wait_ready(process, http, "/ready", timeout=120)  # a loaded machine starts it slowly
            except TimeoutError:  # raised from the constructor: no stop() will come for it
                self.stop()
                raise
            self.target, self.pid = f"127.0.0.1:{grpc_port}", process.pid
        else:
            kind = UpstreamEpp if name == "upstream-epp" else LlmdRouterEpp
            self.upstream = kind(site.kubeconfig, site.namespace, site.pool, Path(tempfile.mkdtemp(dir=work)),
                                 extra_args=["--v=1"])  # fmt: skip
            self.upstream.start(timeout=120, ready_endpoints=len(site.hosts))
            assert self.upstream.process is not None
            self.target, self.pid = self.upstream.target, self.upstream.process.pid
            pin(self.pid, 0)

    def stop(self) -> None:
        """Ours by its PID (SIGTERM, then wait; SIGKILL after STOP_SECONDS), the upstream ones by their
        process group's leader."""
        process = self.process
        if process is not None:
            process.terminate()
            try:
                process.wait(STOP_SECONDS)
            except subprocess.TimeoutExpired:  # a loaded machine: its graceful stop ran long
                process.kill()
                process.wait(STOP_SECONDS)
        if self.upstream is not None:
            self.upstream.stop()


def _before_env(tree: Path | None) -> dict[str, str]:
    """``ours-before``: the router package of another checkout (``--before-tree``) ahead of ours."""
    if tree is None:
        raise SystemExit("the ours-before picker needs --before-tree")
    return {"PYTHONPATH": str(tree / "router")}


def measure(picker: Picker, bodies: list[bytes], concurrency: int) -> dict[str, float]:
    warm = bodies[: max(16, len(bodies) // 10)]
    asyncio.run(drive(picker.target, warm, concurrency, f"warm-{picker.name}"))
    idle_before = cpu(picker.pid)
    time.sleep(IDLE_SECONDS)  # the picker's own background CPU, no request in flight
    idle_rate = (cpu(picker.pid) - idle_before) / IDLE_SECONDS
    before = cpu(picker.pid)
    latencies, errors, wall = asyncio.run(drive(picker.target, bodies, concurrency, picker.name))
    used = cpu(picker.pid) - before
    picks = len(bodies)
    return {
        "cpu_s_per_1000": used / picks * 1000,
        "cpu_s_per_1000_net": max(0.0, used - idle_rate * wall) / picks * 1000,
        "idle_cpu_pct": idle_rate * 100,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": pct(latencies, 0.99) * 1e3,
        "picks_per_s": picks / wall,
        "errors": errors,
    }


def _stat(values: list[float], fmt: str) -> str:
    mean = statistics.fmean(values)
    return f"{mean:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})" if len(values) > 1 else f"{mean:{fmt}}"


def report(results: dict, args: argparse.Namespace, started_load: tuple[float, ...]) -> str:
    lines = [
        "# The cost of a pick: our picker, the EPP v1.5.0 and llm-d's router (one driver, same requests)",
        "",
        f"{args.picks} picks per cell at concurrency 16, {args.picks // 4} at concurrency 1; {args.repeat} repeat(s), "
        "the pickers' order rotated; each picker pinned to core 0, the driver and two stub engines on core 1. "
        "CPU: the picker process (all threads) per 1,000 picks; net: its idle CPU over the same time taken "
        f"out. Mean (min-max) over repeats. Load average at start: {', '.join(f'{x:.1f}' for x in started_load)}.",
        "",
        "| prompt | concurrency | picker | CPU s / 1,000 picks | net of idle | idle CPU % | p50 ms | p99 ms "
        "| picks/s | errors |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell, by_picker in results.items():
        tokens, conc = cell.split("/")
        for name, runs in by_picker.items():
            if not runs:
                continue
            col = {k: [r[k] for r in runs] for k in runs[0]}
            lines.append(
                f"| {tokens} | {conc} | {name} | {_stat(col['cpu_s_per_1000'], '.3f')} | "
                f"{_stat(col['cpu_s_per_1000_net'], '.3f')} | {_stat(col['idle_cpu_pct'], '.1f')} | "
                f"{_stat(col['p50_ms'], '.2f')} | {_stat(col['p99_ms'], '.2f')} | {_stat(col['picks_per_s'], '.0f')} | "
                f"{int(sum(col['errors']))} |"
            )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--picks", type=int, default=600, help="picks per cell at concurrency 16 (c=1: a quarter)"
    )
    parser.add_argument("--tokens", default="1000,16000")
    parser.add_argument("--concurrency", default="1,16", help="the cells' concurrencies, comma-separated")
    parser.add_argument("--pickers", default="ours,upstream-epp,llmd-router")
    parser.add_argument("--name", default="picker_cost")
    parser.add_argument(
        "--before-tree",
        type=Path,
        help="a checkout (e.g. git archive REV router | tar -x -C DIR) whose router package the "
        "ours-before picker runs: the same run measures our picker before and after a change",
    )
    args = parser.parse_args()
    names = args.pickers.split(",")
    if "llmd-router" in names and llmd_epp_binary() is None:
        print("skipping llmd-router: VLLM_STACK_LLMD_EPP is unset (benchmarks/routing/llmd.md)", flush=True)
        names.remove("llmd-router")
    os.sched_setaffinity(0, {1})
    load = os.getloadavg()
    cells = [(int(t), int(c)) for t in args.tokens.split(",") for c in args.concurrency.split(",")]
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        f"{t}/{c}": {n: [] for n in names} for t, c in cells
    }
    procs: list = []
    work = Path(tempfile.mkdtemp(prefix="picker-cost-"))
    with ExitStack() as stack:
        site = stack.enter_context(pool_site(work, 2, free_port()))
        for host in site.hosts:
            stub = start([PY, "benchmarks/router/fast_stub.py", "--host", host, "--port", str(site.port),
                          "--model", MODEL], 1)  # fmt: skip
            procs.append(stub)
            _wait_listening(stub, host, site.port)
        stack.callback(end_all, procs)
        for repeat in range(args.repeat):
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for tokens, conc in cells:
                picks = args.picks if conc == 16 else args.picks // 4
                bodies = prompts(tokens, picks, seed=repeat * 1000 + tokens)
                for name in order:
                    picker = Picker(name, site, work, args.before_tree)
                    try:
                        row = measure(picker, bodies, conc)
                    finally:
                        picker.stop()
                    results[f"{tokens}/{conc}"][name].append(row)
                    print(f"r{repeat} {tokens} tok c={conc} {name}: {row}", flush=True)
    text = report(results, args, load)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.md").write_text(text)
    (RESULTS / f"{args.name}.json").write_text(
        json.dumps({"args": vars(args), "load": load, "results": results}, indent=1, default=str)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
