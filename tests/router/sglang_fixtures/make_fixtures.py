"""Produce SGLang 0.5.23 fixtures with SGLang's own code, no GPU, no server.

Run with the Python of an environment where `sglang==0.5.23` is installed from PyPI:

    venv/bin/python make_fixtures.py            # writes fixtures/ next to this file

Each part runs in its own subprocess (prometheus_client registers collectors in a process-global
registry, and SGLang's runtime context is process-global too):

  metrics  --priority     -> fixtures/metrics_priority.txt   (--enable-priority-scheduling)
  metrics  --no-priority  -> fixtures/metrics.txt            (plain server)
  kvevents                -> fixtures/kv_events.jsonl        (raw ZMQ frames, base64)
                             fixtures/kv_events_expected.json (the same batches, decoded)
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
MODEL = (
    HERE / "tiny-model"
)  # config.json + tokenizer only (vllm_stack_dev.testbed.models.build_model("tiny"))
SERVED = "tiny-llama"


# ----------------------------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------------------------


def _metrics(priority: bool, out: Path) -> None:
    # As the server does (srt/utils/common.py set_prometheus_multiproc_dir): the env var must be set
    # before prometheus_client is imported, gauges are multiprocess_mode="mostrecent".
    mp_dir = tempfile.mkdtemp(prefix="sglang-prom-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = mp_dir

    from sglang.srt.observability.metrics_collector import (
        QueueCount,
        SchedulerMetricsCollector,
        SchedulerStats,
        TokenizerMetricsCollector,
        tokenizer_metric_labels,
    )
    from sglang.srt.runtime_context import SpawnRanks, get_observability, publish
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=str(MODEL),
        served_model_name=SERVED,
        device="cpu",
        enable_metrics=True,
        enable_priority_scheduling=priority,
        page_size=16,
        load_format="dummy",
    )
    # --- scheduler process (tp rank 0, what srt/managers/scheduler.py publishes) ---
    publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0))
    ctx = SchedulerMetricsCollector.init_new(
        server_args=args,
        enable_priority_scheduling=priority,
        enable_lora=False,
        enable_hierarchical_cache=False,
    )
    col = ctx.collector
    assert col is not None
    col.emit_constants(
        max_total_num_tokens=4096,
        max_total_num_tokens_swa=None,
        weight_memory_usage_gb=0.01,
        kv_cache_memory_usage_gb=0.02,
        graph_memory_usage_gb={},
        max_running_requests_under_SLO=None,
        page_size=16,
        num_pages=256,
        context_len=4096,
        startup_available_gpu_memory_gb=20.0,
    )
    running = QueueCount(total=3, by_priority={0: 1, 5: 2} if priority else None)
    queued = QueueCount(total=4, by_priority={0: 3, 5: 1} if priority else None)
    stats = SchedulerStats(
        num_running_reqs=running,
        num_queue_reqs=queued,
        gen_throughput=12.5,
        cache_hit_rate=0.5,
        token_usage=0.25,
        full_token_usage=0.25,
        num_used_tokens=1024,
        kv_available_tokens=2560,
        kv_evictable_tokens=512,
        kv_used_tokens=1024,
        utilization=0.75,
        new_token_ratio=0.4,
    )
    col.log_stats(stats)
    # cumulative prefix-cache counters (scheduler_components/metrics_reporter.py:842)
    col.increment_effective_prefill_tokens(
        input_tokens=100, device_hit_tokens=60, host_hit_tokens=0, storage_hit_tokens=0
    )
    col.increment_realtime_tokens(None, prefill_compute_tokens=100, prefill_cache_tokens=60, decode_tokens=40)

    # --- tokenizer manager process (managers/tokenizer_manager.py:835-849) ---
    publish(args, role="tokenizer")
    labels = tokenizer_metric_labels()
    tok = TokenizerMetricsCollector(
        server_args=args,
        labels=labels,
        bucket_time_to_first_token=get_observability().bucket_time_to_first_token,
        bucket_e2e_request_latency=get_observability().bucket_e2e_request_latency,
        bucket_inter_token_latency=get_observability().bucket_inter_token_latency,
    )
    req_labels = dict(tok.labels)
    if priority:
        req_labels["priority"] = "5"  # tokenizer_manager.py:3230-3233: the request's own priority
    tok.observe_one_finished_request(
        req_labels,
        prompt_tokens=20,
        generation_tokens=8,
        cached_tokens=16,
        e2e_latency=0.3,
        has_grammar=False,
        cached_tokens_details={"device": 16, "host": 0},
        is_streaming=False,
    )
    tok.observe_time_to_first_token(req_labels, 0.05, stream=False)
    tok.observe_inter_token_latency(req_labels, 0.07, 7)

    # --- the HTTP server's /metrics (utils/common.py:2843-2853 add_prometheus_middleware) ---
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from sglang.srt.utils.common import add_prometheus_middleware

    app = FastAPI()
    add_prometheus_middleware(app)
    resp = TestClient(app).get("/metrics")
    resp.raise_for_status()
    out.write_text(resp.text)
    print(f"wrote {out} ({len(resp.text)} bytes, content-type {resp.headers.get('content-type')})")


# ----------------------------------------------------------------------------------------------
# KV events
# ----------------------------------------------------------------------------------------------


class _Allocator:
    """Stands in for the token-to-KV allocator: RadixCache.evict only calls free_segment."""

    device = "cpu"

    def free_segment(self, *a, **k):
        pass


def _kvevents(out_frames: Path, out_expected: Path) -> None:
    import msgspec
    import torch
    import zmq
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory, KVEventBatch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    page = 4
    tree = RadixCache.create_simulated(
        page_size=page, enable_kv_cache_events=True, mock_allocator=_Allocator()
    )

    def insert(tokens, salt=None):
        key = RadixKey(list(tokens), None, cache_salt=salt)
        tree.insert(InsertParams(key=key, value=torch.arange(len(tokens), dtype=torch.int64)))

    steps = []  # (description, events)
    # step 0: a 10-token prompt -> 2 full pages (page_aligned drops the partial 3rd page)
    insert(range(100, 110))
    steps.append(("insert [100..109] (10 tokens, page 4 -> 2 pages)", tree.take_events()))
    # step 1: shares the first page, diverges in the second -> tree split + a new branch
    insert([100, 101, 102, 103, 200, 201, 202, 203, 204, 205, 206, 207])
    steps.append(("insert [100..103, 200..207] (shares page 1)", tree.take_events()))
    # step 2: a salted prompt with the same tokens as step 0 (cache_salt set)
    insert(range(100, 108), salt="tenant-a")
    steps.append(("insert [100..107] with cache_salt='tenant-a'", tree.take_events()))
    # step 3: evict 8 tokens (LRU leaves)
    tree.evict(EvictParams(num_tokens=8))
    steps.append(("evict 8 tokens", tree.take_events()))
    # step 4: reset -> AllBlocksCleared (radix_cache.py:362, /flush_cache)
    tree.reset()
    steps.append(("reset (flush_cache)", tree.take_events()))

    # publisher, as the scheduler creates it (scheduler_components/kv_events_publisher.py:63-105)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    config = json.dumps(
        {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "bind": False, "topic": ""}
    )
    pub = EventPublisherFactory.create(config, attn_dp_rank=0)
    time.sleep(1.0)  # PUB/SUB slow joiner

    ts0 = 1767225600.0  # fixed timestamps so the fixture is reproducible
    for i, (_, events) in enumerate(steps):
        pub.publish(KVEventBatch(ts=ts0 + i, events=events))

    frames = []
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while len(frames) < len(steps):
        if not poller.poll(5000):
            raise SystemExit(f"timed out; got {len(frames)} of {len(steps)} batches")
        frames.append(sub.recv_multipart())
    pub.shutdown()
    sub.close(linger=0)

    dec = msgspec.msgpack.Decoder()  # untyped: exactly what is on the wire
    expected = []
    with out_frames.open("w") as f:
        for (desc, _), parts in zip(steps, frames, strict=True):
            f.write(
                json.dumps({"step": desc, "frames_b64": [base64.b64encode(p).decode() for p in parts]}) + "\n"
            )
            topic, seq, payload = parts
            expected.append(
                {
                    "step": desc,
                    "topic": topic.decode(),
                    "seq": int.from_bytes(seq, "big"),
                    "batch": dec.decode(payload),
                }
            )
    out_expected.write_text(json.dumps(expected, indent=1) + "\n")
    print(f"wrote {out_frames} and {out_expected} ({len(frames)} batches)")


# ----------------------------------------------------------------------------------------------


def main() -> None:
    if len(sys.argv) > 1:
        what = sys.argv[1]
        if what == "metrics":
            priority = sys.argv[2] == "--priority"
            _metrics(priority, FIXTURES / ("metrics_priority.txt" if priority else "metrics.txt"))
        elif what == "kvevents":
            _kvevents(FIXTURES / "kv_events.jsonl", FIXTURES / "kv_events_expected.json")
        return
    FIXTURES.mkdir(exist_ok=True)
    for part in (["metrics", "--priority"], ["metrics", "--no-priority"], ["kvevents"]):
        subprocess.run([sys.executable, __file__, *part], check=True)


if __name__ == "__main__":
    main()
