"""What the benchmarks that load our router in front of the test bed's vLLM engines share.

``benchmarks/priority/load.py`` and ``benchmarks/batch/interactive.py`` set up the same two tiny CPU
engines, start the router the same way for every run, wait for both engines to go idle before each run
and measure the pair's capacity with the same closed loop; they, and ``benchmarks/disagg/pd.py``, report
the same way: nearest-rank percentiles in milliseconds, cells "median (min-max)" over rounds, a markdown
table, ``PATH.{json,md}``. Kept in one place so that these figures are taken and shown alike in every
report that compares them, and a fix to one (say, the idle check) reaches all.

Import it with ``router/`` (for ``vllm_stack_dev``) and ``benchmarks/`` on ``sys.path``, as those scripts
do at their top.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import yaml
from vllm_stack_dev.paths import cache_dir
from vllm_stack_dev.testbed import engines as tb
from vllm_stack_dev.testbed.models import build_model
from vllm_stack_dev.waiting import wait_http_ok

ENGINE_BUSY_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")

# ---------------------------------------------------------------- engines and router


def launch_tiny_engines(
    served_name: str,
    log_prefix: str,
    extra_args: list[str],
    count: int = 2,
    hosts: Sequence[str] | None = None,
    port: int | None = None,
) -> tuple[list[tb.Engine], Path]:
    """Start ``count`` engines of the test bed's tiny model (CPU build, ``max_model_len`` 512, one core
    each, no KV events, no LoRA) with ``extra_args``, logging to a fresh folder named ``log_prefix...``
    (printed); does not wait for them to be ready. ``hosts`` and ``port``: where each listens (a test
    cluster's Pod IPs and the pool's port, for a picker that reads the InferencePool), else a free port
    of 127.0.0.1 each. Returns the engines and that folder."""
    model_dir = build_model("tiny", cache_dir() / "models" / "tiny")
    log_dir = Path(tempfile.mkdtemp(prefix=log_prefix))
    spec = tb.EngineSpec(model_dir, served_name, kv_events=False, enable_lora=False, max_model_len=512,
                         extra_args=extra_args)  # fmt: skip
    cpus = tb.default_cpus(count)
    where = [{"host": h, "port": port} for h in hosts] if hosts else [{} for _ in range(count)]
    engines = [
        tb.launch(spec, name=f"engine-{i}", cpu=cpus[i], log_dir=log_dir, **where[i]) for i in range(count)
    ]
    print(f"logs in {log_dir}", flush=True)
    return engines, log_dir


def start_router(
    config: dict, log_dir: Path, name: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Our router in its own process on a free port, configured by ``config`` (written to
    ``log_dir/name.yaml``, its output to ``log_dir/name.log``; ``env``: the environment, this process's
    by default); returns once it answers ``/ready``, with its process and base URL."""
    path = log_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = tb.free_port()
    command = [sys.executable, "-m", "vllm_stack.cli", "router", "--host", "127.0.0.1", "--port", str(port),
               "--config", str(path)]  # fmt: skip
    process = tb.spawn_logged(command, log_dir / f"{name}.log", dict(os.environ) if env is None else env)
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(url + "/ready", 60, process)
    return process, url


def stop_testbed(router: subprocess.Popen[bytes] | None, engines: list[tb.Engine]) -> None:
    """Stop the router still running (if any), then the engines: the end of a run, failed or not."""
    if router is not None:
        tb.stop_process(router)
    for e in engines:
        e.stop()


def wait_idle(engines: list[tb.Engine], timeout: float = 180.0) -> float:
    """Until every engine runs and queues nothing (the same starting state for every run); the seconds
    waited."""
    start = time.monotonic()
    deadline = start + timeout
    while time.monotonic() < deadline:
        busy = sum(e.metric_value(m) for e in engines for m in ENGINE_BUSY_GAUGES)
        if busy == 0:
            return time.monotonic() - start
        time.sleep(0.5)
    raise TimeoutError("engines did not go idle")


# ---------------------------------------------------------------- capacity


async def closed_loop_capacity(
    url: str,
    body: dict,
    headers: dict[str, str] | None = None,
    seconds: float = 15.0,
    concurrency: int = 16,
) -> float:
    """Completed requests/s of a closed loop at ``concurrency``, each a POST of ``body`` to
    ``/v1/chat/completions`` (after a 3 s warm-up, counting the requests that end within ``seconds``)."""
    done: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        start = time.monotonic() + 3
        end = start + seconds

        async def worker() -> None:
            while time.monotonic() < end:
                r = await client.post("/v1/chat/completions", json=body, headers=headers)
                r.raise_for_status()
                if time.monotonic() >= start:
                    done.append(time.monotonic())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len([t for t in done if t <= end]) / seconds


def measure_capacity(
    engines: list[tb.Engine],
    config: dict,
    log_dir: Path,
    body: dict,
    headers: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    repeats: int = 2,
) -> list[float]:
    """The capacity C of the engines behind one router started with ``config`` (named ``capacity``):
    :func:`closed_loop_capacity` ``repeats`` times, each from idle engines, printed as it comes; the
    router is stopped after. Returns the requests/s of each repeat (the scripts take their median)."""
    router, url = start_router(config, log_dir, "capacity", env)
    caps: list[float] = []
    try:
        for _ in range(repeats):
            wait_idle(engines)
            caps.append(asyncio.run(closed_loop_capacity(url, body, headers)))
            print(f"capacity: {caps[-1]:.2f} requests/s", flush=True)
    finally:
        tb.stop_process(router)
    return caps


# ---------------------------------------------------------------- figures and report


def percentile_ms(values: list[float], q: float) -> float | None:
    """Nearest-rank ``q`` percentile of ``values`` (seconds), in milliseconds; None if there are none."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * len(v)) - 1))] * 1e3


def spread_cell(s: dict | None, digits: int = 0) -> str:
    """A table cell for a figure over rounds (a dict with median, min and max): "median (min-max)", the
    median alone where every round agrees, "-" for none."""
    if s is None:
        return "-"
    if s["min"] == s["max"]:
        return f"{s['median']:.{digits}f}"
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def markdown_table(columns: tuple[str, ...], body_rows: list[list[str]], left_columns: int = 1) -> list[str]:
    """The lines of a markdown table; the first ``left_columns`` columns (names) left-aligned, the rest
    (figures) right-aligned."""
    return [
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * left_columns + "---:|" * (len(columns) - left_columns),
        *("| " + " | ".join(r) + " |" for r in body_rows),
    ]


def print_console_table(
    title: str,
    columns: tuple[str, ...],
    body_rows: list[list[str]],
    *,
    left_columns: int,
    width: int,
    notes: list[str],
    fallback_markdown: str,
) -> None:
    """The table on the terminal with rich, then ``notes`` (the verdicts) line by line; without rich,
    ``fallback_markdown`` (the whole report) instead."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(fallback_markdown)
        return
    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i < left_columns else "right")
    for r in body_rows:
        table.add_row(*r)
    Console(width=width).print(table)
    for note in notes:
        print(note)


def machine_summary() -> str:
    """The machine, as the reports name it: architecture and core count."""
    return f"{platform.machine()}, {os.cpu_count()} cores"


def write_report(
    out: str | Path,
    report: dict,
    render: Callable[[dict], str],
    print_table: Callable[[dict], None],
) -> None:
    """The end of a run: ``report`` to ``out.json``, ``render(report)`` to ``out.md`` (``out`` without its
    suffix; its folder made), then a blank line and ``print_table(report)`` on the terminal."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    path.with_suffix(".md").write_text(render(report))
    print()
    print_table(report)


async def create_batch(client: httpx.AsyncClient, content: bytes) -> str:
    """Upload ``content`` (a JSONL input file) and create a chat-completions batch of it: the batch's id."""
    uploaded = await client.post(
        "/v1/files", files={"file": ("in.jsonl", content, "application/jsonl")}, data={"purpose": "batch"}
    )
    uploaded.raise_for_status()
    created = await client.post(
        "/v1/batches",
        json={
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    created.raise_for_status()
    return created.json()["id"]
