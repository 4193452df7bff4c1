"""Engine kinds: SGLang's kind read against what SGLang 0.5.23's own code produced (metrics exposition,
KV-event frames: ``sglang_fixtures/README.md`` says how), and the seam's other answers per kind.

vLLM's kind is proven by the rest of tests/router, unchanged: it holds what the router did before.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from kubernetes_asyncio.client import V1ObjectMeta, V1Pod, V1PodCondition, V1PodStatus

from tests.router.helpers import wait_for
from vllm_stack.api.priority import PriorityPolicy
from vllm_stack.app import Router
from vllm_stack.config import ConfigError, RouterConfig
from vllm_stack.engines.circuit import CircuitBreaker
from vllm_stack.engines.discovery.base import EndpointInfo
from vllm_stack.engines.discovery.kubernetes import pod_endpoint
from vllm_stack.engines.engine import Engine
from vllm_stack.engines.kinds import KIND_LABEL, kind_named
from vllm_stack.engines.kinds.base import EventSource
from vllm_stack.engines.kinds.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from vllm_stack.engines.registry import EngineRegistry
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.index.blocks import salt_of, token_block_keys
from vllm_stack.scheduling.index.feed import KvEventFeed
from vllm_stack.scheduling.index.kv_events import KvEventIndexer
from vllm_stack.scheduling.index.prefix_index import PrefixIndex
from vllm_stack.telemetry.scraper import EngineScraper

FIXTURES = Path(__file__).parent / "sglang_fixtures"
SGLANG = kind_named("sglang")
VLLM = kind_named("vllm")
MODEL = "tiny-llama"
PAGE = 4  # the page size the KV-event fixture's radix tree ran with


def frames() -> list[list[bytes]]:
    """The raw ZMQ messages SGLang's own publisher sent, in order (seq 0..4)."""
    lines = (FIXTURES / "kv_events.jsonl").read_text().splitlines()
    return [[base64.b64decode(f) for f in json.loads(line)["frames_b64"]] for line in lines]


# ---- metrics ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fixture", ["metrics.txt", "metrics_priority.txt"])
def test_sglang_metrics_as_sglang_exposes_them(fixture: str) -> None:
    t = SGLANG.parse_metrics((FIXTURES / fixture).read_text(), now=1.0)
    assert (t.running, t.waiting) == (3, 4)
    assert t.kv_cache_usage == 0.25
    # prefill_effective_tokens_total: input 100, device_hit 60, host_hit 0, storage_hit 0
    assert (t.prefix_cache_queries, t.prefix_cache_hits) == (160, 60)
    assert (t.block_size, t.num_blocks) == (16, 256)
    assert t.max_loras is None and t.running_adapters is None and t.scraped_at == 1.0


def test_the_priority_breakdown_is_not_counted_twice() -> None:
    """With priority scheduling SGLang repeats the queue gauges per priority beside the total under
    ``priority=""``: summing every series, as vLLM's series are summed, doubles them."""
    text = (FIXTURES / "metrics_priority.txt").read_text()
    naive = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("sglang:num_queue_reqs{")
    )
    assert naive == 8  # 4 under priority="", 3 + 1 under priority="0" / "5"
    assert SGLANG.parse_metrics(text).waiting == 4
    # a series without the label (priority scheduling off) counts; "None" (requests without one) does not
    extra = (
        text + 'sglang:num_queue_reqs{model_name="other"} 2.0\nsglang:num_queue_reqs{priority="None"} 7.0\n'
    )
    assert SGLANG.parse_metrics(extra).waiting == 6


def test_sglang_metrics_without_the_queue_gauges_are_unknown() -> None:
    with pytest.raises(ValueError, match="sglang:num_queue_reqs"):
        SGLANG.parse_metrics((FIXTURES / "metrics.txt").read_text().replace("sglang:num_queue_reqs", "x"))
    # and SGLang's text is no vLLM text, nor the other way round
    with pytest.raises(ValueError):
        VLLM.parse_metrics((FIXTURES / "metrics.txt").read_text())


def test_capacity_from_tokens_when_the_page_count_is_absent() -> None:
    text = "\n".join(
        [
            "sglang:num_running_reqs 0",
            "sglang:num_queue_reqs 0",
            "sglang:page_size 16",
            "sglang:max_total_num_tokens 4096",
        ]
    )
    t = SGLANG.parse_metrics(text)
    assert (t.block_size, t.num_blocks, t.prefix_cache_queries) == (16, 256, None)


async def test_the_scraper_reads_each_engine_by_its_kind() -> None:
    sglang_engine = Engine("s", "http://s:30000", CircuitBreaker(5, 10.0), kind=SGLANG)
    text = (FIXTURES / "metrics_priority.txt").read_text()

    async def fetch(_engine: Engine) -> str:
        return text

    scraper = EngineScraper(lambda: [sglang_engine], fetch, RouterMetrics())
    await scraper.scrape_all()
    assert sglang_engine.telemetry is not None and sglang_engine.telemetry.waiting == 4
    assert (sglang_engine.kv_block_size, sglang_engine.kv_blocks) == (16, 256)
    assert sglang_engine.describe()["kind"] == "sglang"


# ---- KV events ----------------------------------------------------------------------------------------
def test_sglang_events_decode_as_sglang_encoded_them() -> None:
    expected = json.loads((FIXTURES / "kv_events_expected.json").read_text())
    for (topic, seq, payload), want in zip(frames(), expected, strict=True):
        assert (topic, int.from_bytes(seq, "big")) == (b"", want["seq"])
        batch = SGLANG.decode_events(payload)
        assert isinstance(batch, EventBatch) and batch.data_parallel_rank == want["batch"][2]
        assert [type(e).__name__ for e in batch.events] == [e["type"] for e in want["batch"][1]]
        for event, raw in zip(batch.events, want["batch"][1], strict=True):
            if isinstance(event, BlockStored):
                assert event.block_hashes == raw["block_hashes"] and event.token_ids == raw["token_ids"]
                assert event.parent_block_hash == raw["parent_block_hash"]
                assert (event.block_size, event.medium, event.cache_salt) == (
                    raw["block_size"],
                    raw["medium"],
                    raw.get("cache_salt"),
                )
            elif isinstance(event, BlockRemoved):
                assert event.block_hashes == raw["block_hashes"]
            else:
                assert isinstance(event, AllBlocksCleared)


def test_the_salt_is_where_each_kind_puts_it() -> None:
    (_, _, payload) = frames()[2]  # tokens 100..107 stored with cache_salt "tenant-a"
    (event,) = SGLANG.decode_events(payload).events
    assert isinstance(event, BlockStored)
    assert SGLANG.event_salt(event) == "tenant-a"
    assert VLLM.event_salt(event) is None  # vLLM's rule reads extra_keys, which SGLang does not send
    vllm_event = BlockStored([1], [1] * 4, 4, extra_keys=[["s1"]])
    assert VLLM.event_salt(vllm_event) == "s1" and SGLANG.event_salt(vllm_event) is None


def sglang_keys(tokens: list[int], salt: str | None = None) -> list[int]:
    return token_block_keys(tokens, PAGE, salt_of(MODEL, salt))


def test_sglang_events_keep_the_index_as_sglang_s_radix_tree_holds_its_pages() -> None:
    index = PrefixIndex()
    indexer = KvEventIndexer(index)
    steps = [SGLANG.decode_events(payload) for _, _, payload in frames()]
    first, shared, salted = (
        list(range(100, 108)),
        [100, 101, 102, 103, *range(200, 208)],
        list(range(100, 108)),
    )
    indexer.apply("s", MODEL, steps[0], None, SGLANG)
    indexer.apply("s", MODEL, steps[1], None, SGLANG)
    indexer.apply("s", MODEL, steps[2], None, SGLANG)
    assert index.match("s", sglang_keys(first)) == 2
    assert index.match("s", sglang_keys(shared)) == 3
    assert index.match("s", sglang_keys(salted, "tenant-a")) == 2
    assert indexer.describe()["s"]["orphans"] == 0
    indexer.apply("s", MODEL, steps[3], None, SGLANG)  # the two LRU leaves evicted: 3 pages
    assert index.match("s", sglang_keys(first)) == 1 and index.match("s", sglang_keys(shared)) == 1
    assert index.match("s", sglang_keys(salted, "tenant-a")) == 2
    indexer.apply("s", MODEL, steps[4], None, SGLANG)  # flush_cache
    assert index.blocks_of("s") == 0
    # Read with vLLM's salt rule, the salted prefix would be keyed as unsalted: the rule is the kind's.
    other = PrefixIndex()
    KvEventIndexer(other).apply("v", MODEL, steps[2], None, VLLM)
    assert (
        other.match("v", sglang_keys(salted, "tenant-a")) == 0 and other.match("v", sglang_keys(salted)) == 2
    )


def test_sglang_sources_come_from_server_info() -> None:
    """``GET /server_info``'s ``kv_events`` block as ``describe_kv_events_publisher`` writes it
    (``sglang/srt/runtime_context.py``, 0.5.23): one publisher per DP rank at base + rank."""
    block = {
        "publisher": "zmq",
        "endpoint_host": "*",
        "endpoint_port_base": 5557,
        "topic": "",
        "block_size": 16,
        "dp_size": 2,
        "replay_endpoint_port_base": 5600,
    }
    assert SGLANG.kv_sources({"kv_events": block}, "http://10.1.2.3:30000") == [
        EventSource("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5600"),
        EventSource("tcp://10.1.2.3:5558", "tcp://10.1.2.3:5601"),
    ]
    no_replay = {k: v for k, v in block.items() if k != "replay_endpoint_port_base"}
    assert SGLANG.kv_sources(
        {"kv_events": no_replay | {"endpoint_host": "10.9.9.9", "dp_size": 1}}, "http://h:1"
    ) == [EventSource("tcp://10.9.9.9:5557", None)]
    assert SGLANG.kv_sources({"kv_events": block | {"endpoint_host": "::"}}, "http://[fd00::1]:1")[
        0
    ].endpoint == ("tcp://[fd00::1]:5557")
    for doc in ({"kv_events": None}, {}, None, {"kv_events": block | {"publisher": "null"}}):
        assert SGLANG.kv_sources(doc, "http://h:1") == []
    assert (SGLANG.kv_sources_path, VLLM.kv_sources_path) == ("/server_info", "/kv_event_sources")


class IndexConsumer:
    """The prefix picker's part of the feed's contract: apply with the engine's kind, forget on reset."""

    def __init__(self) -> None:
        self.index = PrefixIndex()
        self.indexer = KvEventIndexer(self.index)

    def apply_events(self, engine: Engine, batch: EventBatch) -> None:
        self.indexer.apply(engine.name, MODEL, batch, None, engine.kind)

    def engine_reset(self, engine: Engine) -> None:
        self.indexer.forget_engine(engine.name)


async def test_the_feed_follows_an_sglang_engine_from_its_server_info() -> None:
    """SGLang's recorded frames sent over ZMQ to the feed, which found the publisher where SGLang says."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    engine = Engine("s", "http://127.0.0.1:1", CircuitBreaker(5, 10.0), kind=SGLANG)
    engine.healthy = True
    asked: list[Engine] = []

    async def server_info(e: Engine) -> dict[str, Any]:
        asked.append(e)
        return {
            "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": port, "dp_size": 1}
        }

    consumer = IndexConsumer()
    feed = KvEventFeed(lambda: [engine], server_info)
    feed.consumers = (consumer,)
    task = asyncio.ensure_future(feed.run(interval=0.05))
    recorded = frames()
    try:
        await wait_for(lambda: "s" in feed.stats, what="the feed subscribing to the SGLang engine")
        # ZMQ's late joiner: the first message is sent again until one arrives (each repeat looks
        # like a restart to the feed, which forgets and applies it again: the same state).
        while consumer.index.blocks_of("s") == 0:
            await pub.send_multipart(recorded[0])
            await asyncio.sleep(0.05)
        for message in recorded[1:3]:
            await pub.send_multipart(message)
        await wait_for(lambda: feed.stats["s"][0].last_seq == 2, what="SGLang's batches 1 and 2")
        assert consumer.index.match("s", sglang_keys([100, 101, 102, 103, *range(200, 208)])) == 3
        assert consumer.index.match("s", sglang_keys(list(range(100, 108)), "tenant-a")) == 2
        await pub.send_multipart(recorded[3])
        await pub.send_multipart(recorded[4])
        await wait_for(lambda: feed.stats["s"][0].last_seq == 4, what="SGLang's batches 3 and 4")
        assert consumer.index.blocks_of("s") == 0 and feed.stats["s"][0].decode_errors == 0
        assert asked and asked[0] is engine
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close(linger=0)
        ctx.destroy(linger=0)


# ---- adapters, priority, hand-over ----------------------------------------------------------------------
def test_each_kind_reads_its_engines_adapter_answers() -> None:
    v, s = VLLM.adapters, SGLANG.adapters
    assert (v.load_path, v.unload_path) == ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
    assert (s.load_path, s.unload_path) == ("/load_lora_adapter", "/unload_lora_adapter")
    # SGLang's texts (sglang/srt/lora/lora_manager.py, lora_registry.py, managers/tokenizer_control_mixin.py)
    assert s.load_ok(200, b'{"success":true}')
    assert s.load_ok(
        400, b'{"success":false,"error_message":"Failed to load LoRA adapter a because it is already loaded"}'
    )
    assert not s.load_ok(400, b"LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
    assert s.unload_ok(400, b"LoRA with name a does not exist. Loaded LoRAs: dict_keys([])")
    assert not s.unload_ok(400, b"LoRA is not enabled. Please set `--enable-lora` to enable LoRA.")
    # vLLM's, as the router read them before kinds
    assert v.load_ok(400, b"The lora adapter 'a' has already been loaded.") and not v.load_ok(400, b"other")
    assert v.unload_ok(404, b"The lora adapter 'a' cannot be found.") and not v.unload_ok(
        400, b"does not exist"
    )


def test_the_priority_field_in_each_kinds_sense() -> None:
    config = RouterConfig(
        models=(
            {"name": "v", "engine_priority": True},
            {"name": "s", "engine_priority": True, "engine_kind": "sglang"},
            {"name": "plain", "engine_kind": "sglang"},
        )
    )
    policy = PriorityPolicy(config)
    body = b'{"model":"x"}'
    # router priority 2 (more important): vLLM gets -2 (lower first), SGLang 2 (higher first)
    assert json.loads(policy.engine_body("v", 2, body, None))["priority"] == -2
    assert json.loads(policy.engine_body("s", 2, body, None))["priority"] == 2
    # a client's body priority is in vLLM's sense: kept for vLLM, turned round for SGLang
    client = b'{"model":"x","priority":-2}'
    assert policy.engine_body("v", 2, client, -2) is client
    assert json.loads(policy.engine_body("s", 2, client, -2))["priority"] == 2
    assert policy.engine_body("plain", 2, body, None) is body  # engines that do not schedule by it


def test_the_hand_over_each_kind_declares() -> None:
    assert VLLM.handover.mode == "sequential"
    params = VLLM.handover.prefill_request_params()
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    params["x"] = 1  # a copy: the kind's own stays as declared
    assert "x" not in VLLM.handover.prefill_request_params()
    assert SGLANG.handover.mode == "concurrent"
    assert SGLANG.handover.bootstrap_fields == ("bootstrap_host", "bootstrap_port", "bootstrap_room")
    assert SGLANG.handover.bootstrap_port == 8998 and SGLANG.handover.prefill_request_params() == {}


# ---- which kind an engine has ----------------------------------------------------------------------------
def test_unknown_kinds_are_refused() -> None:
    for name in ("nope", "base", "events", "Vllm", "../x"):
        with pytest.raises(ValueError, match="unknown engine kind"):
            kind_named(name)
    assert kind_named(None) is VLLM and kind_named("vllm") is VLLM
    with pytest.raises(ConfigError, match="unknown engine kind"):
        Router(RouterConfig(static_backends=("http://a:1",), models=({"name": "m", "engine_kind": "nope"},)))


def test_an_adapter_of_an_sglang_model_is_refused_at_start() -> None:
    """SGLang serves an adapter only as model ``base:adapter``; the router relays the adapter's own name,
    so a registered adapter of an SGLang model would be answered by the base model: refused by name."""
    adapter = {"name": "sql", "source": "/adapters/sql", "base_model": "m"}
    sglang = ({"name": "m", "engine_kind": "sglang"},)
    with pytest.raises(
        ConfigError, match="'sql': the engines of 'm' are sglang, which serves an adapter only as 'm:sql'"
    ):
        Router(RouterConfig(static_backends=("http://a:1",), models=sglang, lora_adapters=(adapter,)))
    Router(RouterConfig(static_backends=("http://a:1",), models=({"name": "m"},), lora_adapters=(adapter,)))


async def test_static_engines_take_their_models_kind() -> None:
    config = RouterConfig(
        static_backends=("http://a:1", "http://b:2", "http://c:3"),
        static_models=("m-sglang", "m-vllm", "m-unlisted"),
        models=({"name": "m-sglang", "engine_kind": "sglang"}, "m-vllm"),
    )
    router = Router(config)
    snapshot: list[EndpointInfo] = []

    async def sink(endpoints: list[EndpointInfo]) -> None:
        snapshot[:] = endpoints

    task = asyncio.ensure_future(router.discovery.run(sink))
    try:
        await wait_for(lambda: len(snapshot) == 3, what="the static snapshot")
        assert [e.kind for e in snapshot] == ["sglang", "vllm", None]
        registry = EngineRegistry(lambda _e: asyncio.sleep(0, []), RouterMetrics())
        await registry.apply_snapshot(snapshot)
        assert [registry.get(n).kind for n in ("a:1", "b:2", "c:3")] == [SGLANG, VLLM, VLLM]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _pod(labels: dict[str, str]) -> V1Pod:
    return V1Pod(
        metadata=V1ObjectMeta(name="engine-0", labels=labels),
        status=V1PodStatus(
            phase="Running", pod_ip="10.0.0.9", conditions=[V1PodCondition(type="Ready", status="True")]
        ),
    )


async def test_pods_say_their_kind_with_a_label(caplog: pytest.LogCaptureFixture) -> None:
    assert KIND_LABEL == "vllm-stack.io/engine-kind"
    labeled = pod_endpoint(_pod({KIND_LABEL: "sglang"}), 30000)
    plain = pod_endpoint(_pod({}), 8000)
    odd = pod_endpoint(_pod({KIND_LABEL: "tgi"}), 8000)
    assert labeled is not None and plain is not None and odd is not None
    assert (labeled.kind, plain.kind, odd.kind) == ("sglang", None, "tgi")
    registry = EngineRegistry(lambda _e: asyncio.sleep(0, []), RouterMetrics())
    with caplog.at_level(logging.WARNING):
        await registry.apply_snapshot([odd])
    assert registry.get("engine-0").kind is VLLM and "unknown engine kind 'tgi'" in caplog.text
    registry_2 = EngineRegistry(lambda _e: asyncio.sleep(0, []), RouterMetrics())
    await registry_2.apply_snapshot([labeled])
    engine = registry_2.get("engine-0")
    assert engine.kind is SGLANG
    assert msgspec.json.decode(msgspec.json.encode(engine.describe()["kind"])) == "sglang"
