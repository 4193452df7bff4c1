"""What prefix-cache routing costs the router: decision time by prompt length and index size, the
tokenizer's time apart, memory per indexed block, and KV-event ingestion speed.

Run: ``.venv/bin/python benchmarks/router/prefix_cost.py [--quick] [--out DIR]`` (``make bench-prefix``).
Everything runs in this process on in-memory engines (no HTTP): what is measured is the picker
(:mod:`vllm_stack.scheduling.plugins.prefix_cache_picker`), the index and the event indexer, as the
router runs them per request or per event batch.

- Decision: ``Scheduler.schedule`` for a chat request whose prompt is N tokens (about 4 characters
  each), 2 engines, with the index pre-filled to B blocks (other prompts). Character mode computes
  the keys in the decision; token mode's keys come from token ids the prepare stage made, so its
  tokenization is reported in its own column. Two cases: ``hit`` (the prompt was routed before: the
  follow-up turn of a conversation) and ``miss`` (a new prompt). Median of repeated runs, each on a
  fresh request context (nothing cached between them).
- Memory: tracemalloc's growth when 1M distinct blocks are indexed (all structures: the per-engine
  dicts and the key ints), and the same through KV events (the engine-hash map as well).
- Ingestion: vLLM-format ``BlockStored`` batches (msgpack, 16 blocks of 128 tokens each, chained as
  an engine sends them) decoded and applied on one core; blocks per second.

Targets (issue 11): character-mode decision <= 50 us at 8k tokens; <= 100 bytes per block;
ingestion >= 50,000 replayed blocks/s on one core.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from vllm_stack.config import RouterConfig
from vllm_stack.engines.circuit import CircuitBreaker
from vllm_stack.engines.engine import Engine
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.config import build_scheduling
from vllm_stack.scheduling.framework import RequestContext
from vllm_stack.scheduling.index.kv_events import KvEventIndexer, batch_decoder
from vllm_stack.scheduling.index.prefix_index import PrefixIndex
from vllm_stack.scheduling.plugins import builtin_registry
from vllm_stack.scheduling.profiles import scheduling_config
from vllm_stack.scheduling.registry import PluginState

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 128
CHARS_PER_TOKEN = 4
WORDS = "the of and to in is was for on that with as by at from his her an be this which or are".split()


def engines(n: int = 2) -> list[Engine]:
    out = []
    for i in range(n):
        e = Engine(f"e{i}", f"http://10.0.0.{i}:8000", CircuitBreaker(5, 10.0))
        e.healthy, e.kv_block_size, e.kv_blocks = True, BLOCK, 1 << 30
        e.model_cards = ({"id": "m", "parent": None},)
        out.append(e)
    return out


def text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        w = rng.choice(WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:chars]


def setup(max_blocks: int, tokenizer_dir: str | None = None) -> Any:  # noqa: ANN401 - SchedulingSetup
    config = RouterConfig(
        routing_logic="prefixaware",
        tokenizers={"m": tokenizer_dir} if tokenizer_dir else None,
        kv_events="off",
    )
    raw = scheduling_config(config)
    params = raw["plugins"][1]["parameters"]
    params["max_blocks"] = max_blocks
    params["inline_bytes"] = 1 << 30  # tokenize inline: its time is measured, not a worker thread's
    return build_scheduling(raw, builtin_registry(), PluginState(), RouterMetrics())


def fill(index: PrefixIndex, blocks: int, pool: list[Engine]) -> None:
    """``blocks`` distinct keys spread over the engines, as earlier unrelated prompts leave them."""
    chunk = 1024
    rng = random.Random(1)
    for start in range(0, blocks, chunk):
        keys = [rng.getrandbits(64) for _ in range(min(chunk, blocks - start))]
        index.record(pool[(start // chunk) % len(pool)].name, keys, 1 << 30)


def request(prompt_chars: int, rng: random.Random, shared: str | None = None) -> tuple[bytes, bytes]:
    content = shared if shared is not None else text(rng, prompt_chars)
    messages = [{"role": "user", "content": content}]
    body = json.dumps({"model": "m", "messages": messages}).encode()
    return body, json.dumps(messages).encode()


def time_decisions(
    sched: Any, pool: list[Engine], body: bytes, prompt: bytes, repeat: int, prepare: Any
) -> tuple[float, float]:  # noqa: ANN401
    """Median seconds of (prepare, schedule) over ``repeat`` fresh contexts of the same request."""
    prep: list[float] = []
    dec: list[float] = []
    for _ in range(repeat):
        ctx = RequestContext("m", body=body, prompt=prompt)
        t0 = time.perf_counter()
        for hook in prepare:
            hook(ctx)
        t1 = time.perf_counter()
        sched.schedule(ctx, pool)
        t2 = time.perf_counter()
        prep.append(t1 - t0)
        dec.append(t2 - t1)
    return statistics.median(prep), statistics.median(dec)


def decision_rows(
    lengths: list[int], sizes: list[int], repeat: int, tokenizer_dir: str | None
) -> list[dict[str, Any]]:
    rows = []
    for size in sizes:
        for mode, tdir in (("characters", None), ("tokens", tokenizer_dir)):
            if mode == "tokens" and tdir is None:
                continue
            s = setup(max(size + 100_000, 1_000_000), tdir)
            pool = engines()
            picker = s.plugins["prefix-cache-picker"]
            fill(picker.index, size, pool)
            rng = random.Random(7)
            for tokens in lengths:
                chars = tokens * CHARS_PER_TOKEN
                gc.collect()
                body, prompt = request(chars, rng)
                # miss: a new prompt each time (recorded after each decision, so every run is new)
                miss_prep, miss = [], []
                for _ in range(max(5, repeat // 2)):
                    b, p = request(chars, rng)
                    pr, d = time_decisions(s.scheduler, pool, b, p, 1, s.hooks.prepare)
                    miss_prep.append(pr)
                    miss.append(d)
                # hit: the same prompt again (the follow-up of a routed conversation)
                time_decisions(s.scheduler, pool, body, prompt, 1, s.hooks.prepare)
                hit_prep, hit = time_decisions(s.scheduler, pool, body, prompt, repeat, s.hooks.prepare)
                rows.append(
                    {
                        "mode": mode,
                        "prompt_tokens": tokens,
                        "indexed_blocks": size,
                        "decision_hit_us": hit * 1e6,
                        "decision_miss_us": statistics.median(miss) * 1e6,
                        "tokenize_us": hit_prep * 1e6 if mode == "tokens" else None,
                    }
                )
    return rows


def memory_per_block(blocks: int) -> dict[str, float]:
    """Bytes per block held: through routing (index only) and through KV events (index + hash map)."""
    pool = engines()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(blocks + 1)
    fill(index, blocks, pool)
    routed = (tracemalloc.get_traced_memory()[0] - before) / blocks
    tracemalloc.stop()
    del index
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    indexer = KvEventIndexer(PrefixIndex(blocks + 1))
    per_event = 16
    tokens = list(range(BLOCK * per_event))
    for n in range(blocks // per_event):
        hashes = [(n * per_event + i).to_bytes(32, "big") for i in range(per_event)]  # sha256-sized
        tokens[0] = n  # distinct content, so distinct keys
        batch = _encoded_batch([_stored(hashes, tokens, None)])
        indexer.apply(pool[n % 2].name, "m", batch_decoder.decode(batch), 1 << 30)
    evented = (tracemalloc.get_traced_memory()[0] - before) / blocks
    tracemalloc.stop()
    return {"routed_bytes_per_block": routed, "kv_event_bytes_per_block": evented}


def _stored(hashes: list[Any], tokens: list[int], parent: Any) -> dict[str, Any]:  # noqa: ANN401
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
    }


def _encoded_batch(events: list[dict[str, Any]]) -> bytes:
    return msgspec.msgpack.encode([time.time(), events, 0])


def ingestion(blocks: int) -> dict[str, float]:
    """Replayed blocks per second: decode + apply of chained 16-block BlockStored batches."""
    per_event = 16
    rng = random.Random(3)
    payloads = []
    parent = None
    for n in range(blocks // per_event):
        hashes = [rng.getrandbits(256).to_bytes(32, "big") for _ in range(per_event)]
        tokens = [rng.randrange(2048) for _ in range(BLOCK * per_event)]
        payloads.append(_encoded_batch([_stored(hashes, tokens, parent if n % 8 else None)]))
        parent = hashes[-1]
    indexer = KvEventIndexer(PrefixIndex(blocks + 1))
    gc.collect()
    t0 = time.process_time()
    for payload in payloads:
        indexer.apply("e0", "m", batch_decoder.decode(payload), 1 << 30)
    cpu = time.process_time() - t0
    applied = indexer.describe()["e0"]["stored"]
    return {"blocks": applied, "cpu_seconds": cpu, "blocks_per_second": applied / cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller index, fewer repeats")
    ap.add_argument(
        "--tokenizer", help="a model directory for the token-mode rows (default: the test bed's tiny model)"
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    tokenizer_dir = args.tokenizer
    if tokenizer_dir is None:
        from vllm_stack_dev.paths import cache_dir
        from vllm_stack_dev.testbed.models import build_model

        tokenizer_dir = str(build_model("tiny", cache_dir() / "models" / "tiny"))
    sizes = [0, 100_000] if args.quick else [0, 100_000, 1_000_000]
    repeat = 30 if args.quick else 200
    rows = decision_rows([1024, 8192, 32768], sizes, repeat, tokenizer_dir)
    memory = memory_per_block(200_000 if args.quick else 1_000_000)
    ingest = ingestion(50_000 if args.quick else 400_000)
    report = {"decisions": rows, "memory": memory, "ingestion": ingest, "quick": args.quick}

    console = Console()
    table = Table(title="prefix-cache decision cost (2 engines, median)")
    for col in ("mode", "prompt tokens", "indexed blocks", "hit us", "miss us", "tokenize us"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["mode"],
            f"{r['prompt_tokens']:,}",
            f"{r['indexed_blocks']:,}",
            f"{r['decision_hit_us']:.1f}",
            f"{r['decision_miss_us']:.1f}",
            "-" if r["tokenize_us"] is None else f"{r['tokenize_us']:.0f}",
        )
    console.print(table)
    console.print(
        f"memory: {memory['routed_bytes_per_block']:.0f} B/block routed, "
        f"{memory['kv_event_bytes_per_block']:.0f} B/block from KV events; "
        f"ingestion: {ingest['blocks_per_second']:,.0f} blocks/s ({ingest['blocks']:,} blocks)"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_cost.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        "# Prefix-cache routing cost" + (" (quick)" if args.quick else ""),
        "",
        "`benchmarks/router/prefix_cost.py`: in-process, 2 engines, median per decision.",
        "",
        "| mode | prompt tokens | indexed blocks | decision, hit (us) | decision, miss (us) | tokenize (us) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        tok = "-" if r["tokenize_us"] is None else f"{r['tokenize_us']:.0f}"
        lines.append(
            f"| {r['mode']} | {r['prompt_tokens']:,} | {r['indexed_blocks']:,} | {r['decision_hit_us']:.1f} "
            f"| {r['decision_miss_us']:.1f} | {tok} |"
        )
    lines += [
        "",
        f"Memory per indexed block (tracemalloc): {memory['routed_bytes_per_block']:.0f} bytes through routing, "
        f"{memory['kv_event_bytes_per_block']:.0f} bytes through KV events (index plus the engine-hash map).",
        "",
        f"KV-event ingestion: {ingest['blocks_per_second']:,.0f} blocks/s on one core "
        f"({ingest['blocks']:,} blocks in 16-block BlockStored batches, decode + apply).",
        "",
    ]
    (out / "prefix_cost.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
