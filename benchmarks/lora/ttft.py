"""Time to first token for a LoRA adapter by where it is when the request arrives: cold, warm, resident.

- cold: registered with the router, loaded on no engine: the router loads it on the engine it picks
  (``POST /v1/load_lora_adapter``, which reads the adapter from disk) before forwarding. Each repeat
  uses an adapter never loaded before, so vLLM has no copy of it in any cache.
- warm: loaded on the engine earlier (on demand) and idle: two other adapters ran since.
- resident: a hot adapter (loaded at start) that the request before used too.
- base: the base model, for reference.

One real vLLM engine (CPU build, the tiny model, ``--max-loras 4``) behind our router (its own process,
the command line the chart renders, the adapters in its config file). Streamed chat completions,
``max_tokens`` 4; TTFT is measured by the client to the first streamed event. Phases are interleaved
per repeat (cold, warm, resident, base, then again) so machine noise spreads over all of them.

Usage: ``python benchmarks/lora/ttft.py [--repeats 8]``; prints a table and writes
``benchmarks/results/lora_ttft.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "router"))

import httpx  # noqa: E402
import yaml  # noqa: E402
from vllm_stack_dev.paths import cache_dir  # noqa: E402
from vllm_stack_dev.testbed import engines as tb  # noqa: E402
from vllm_stack_dev.testbed.models import build_lora, build_model  # noqa: E402
from vllm_stack_dev.waiting import wait_http_ok  # noqa: E402

MODEL = "tiny-llama"
PHASES = ("cold", "warm", "resident", "base")


def ttft(client: httpx.Client, model: str) -> float:
    """Seconds to the first streamed event of a chat completion for ``model``."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write one short sentence."}],
        "max_tokens": 4,
        "stream": True,
    }
    started = time.perf_counter()
    first: float | None = None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():  # read to the end: the next request starts on an idle engine
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"no streamed event for {model}")
    return first


def stats(values: list[float]) -> dict[str, float]:
    return {
        "median_ms": statistics.median(values) * 1e3,
        "min_ms": min(values) * 1e3,
        "max_ms": max(values) * 1e3,
        "n": len(values),
    }


def render(report: dict) -> str:
    base = report["phases"]["base"]["median_ms"]
    lines = [
        "# LoRA adapters: time to first token by where the adapter is",
        "",
        f"`python benchmarks/lora/ttft.py --repeats {report['repeats']}` on {report['machine']}: one vLLM engine "
        "(CPU build, tiny model, `--max-loras 4`) behind our router; streamed chat, `max_tokens` 4; "
        "phases interleaved per repeat. Medians with min-max.",
        "",
        "| adapter | TTFT median ms | min-max ms | vs base |",
        "|---|---:|---:|---:|",
    ]
    for phase in PHASES:
        s = report["phases"][phase]
        lines.append(
            f"| {phase} | {s['median_ms']:.1f} | {s['min_ms']:.1f}-{s['max_ms']:.1f} | {s['median_ms'] / base:.2f} |"
        )
    lines += ["", report["notes"], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lora_ttft"))
    args = ap.parse_args(argv)

    model_dir = build_model("tiny", cache_dir() / "models" / "tiny")
    adapters = cache_dir() / "models" / "bench-lora"
    cold = [f"cold-{i}" for i in range(args.repeats)]
    names = [*cold, "warm", "other-1", "other-2", "resident"]
    dirs = {n: build_lora(model_dir, adapters / n, seed=100 + i) for i, n in enumerate(names)}
    tiers = {n: "cold" for n in cold} | {
        "warm": "warm",
        "other-1": "warm",
        "other-2": "warm",
        "resident": "hot",
    }

    log_dir = Path(tempfile.mkdtemp(prefix="lora-ttft-"))
    spec = tb.EngineSpec(model_dir, MODEL, kv_events=False, max_loras=4)
    engine = tb.launch(spec, name="lora-engine", cpu=tb.default_cpus(2)[0], log_dir=log_dir)
    router = None
    try:
        tb.wait_ready([engine], 420)
        config = log_dir / "router.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "lora_adapters": [
                        {"name": n, "source": str(dirs[n]), "base_model": MODEL, "tier": tiers[n]}
                        for n in names
                    ]
                }
            )
        )
        port = tb.free_port()
        command = [
            sys.executable, "-m", "vllm_stack.cli", "router", "--host", "127.0.0.1", "--port", str(port),
            "--service-discovery", "static", "--static-backends", engine.url,
            "--routing-logic", "roundrobin", "--config", str(config),
        ]  # fmt: skip
        router_cpu = tb.default_cpus(2)[-1]
        pin = ["taskset", "-c", str(router_cpu)] if router_cpu is not None else []
        with (log_dir / "router.log").open("wb") as log:
            router = subprocess.Popen([*pin, *command], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_http_ok(url + "/ready", 60, router)
        results: dict[str, list[float]] = {p: [] for p in PHASES}
        with httpx.Client(base_url=url, timeout=120) as client:
            deadline = time.monotonic() + 60
            while "resident" not in {m["id"] for m in httpx.get(engine.url + "/v1/models").json()["data"]}:
                if time.monotonic() > deadline:
                    raise TimeoutError("the hot adapter was not loaded")
                time.sleep(0.2)
            for model in ("warm", MODEL, "resident"):  # warm up the engine and load "warm" once
                ttft(client, model)
            for i in range(args.repeats):
                results["cold"].append(ttft(client, cold[i]))
                ttft(client, "other-1")
                ttft(client, "other-2")
                results["warm"].append(ttft(client, "warm"))
                ttft(client, "resident")
                results["resident"].append(ttft(client, "resident"))
                results["base"].append(ttft(client, MODEL))
                print(
                    f"repeat {i + 1}/{args.repeats}: "
                    + ", ".join(f"{p} {results[p][-1] * 1e3:.1f} ms" for p in PHASES),
                    flush=True,
                )
            router_metrics = httpx.get(url + "/metrics").text
    finally:
        if router is not None:
            router.terminate()
            router.wait(10)
        engine.stop()
    loads = [line for line in router_metrics.splitlines() if line.startswith("vllm_stack_router_adapter_")]
    report = {
        "repeats": args.repeats,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "phases": {p: stats(v) for p, v in results.items()},
        "raw_ms": {p: [round(x * 1e3, 2) for x in v] for p, v in results.items()},
        "router_adapter_metrics": loads,
        "notes": (
            "cold includes the router's load (one POST /v1/load_lora_adapter; the engine reads the adapter "
            "from disk and adds it to its LoRA cache), and from the 5th cold adapter on, the unload of an "
            "idle cold one first (4 slots). warm and resident are both registered on the engine, so the "
            "router forwards at once; they differ only in whether vLLM must swap the adapter into its batch."
        ),
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(render(report))
    print()
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
