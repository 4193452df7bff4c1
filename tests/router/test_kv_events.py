"""KV events, without engines: the indexer keys blocks as requests are keyed, and the feed recovers
what its stream loses.

The feed is fed by ``tests/fakes/kv_publisher.py``, a stand-in for vLLM's ZMQ publisher (same wire
format, same replay protocol) that can drop a batch, restart its sequence or lose its buffer on cue,
which a real engine cannot be told to do. The real engines' streams are tested in
``test_kv_events_engine.py``.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from tests.fakes.kv_publisher import FakeKvPublisher, removed, stored
from vllm_stack.engines.circuit import CircuitBreaker
from vllm_stack.engines.engine import Engine
from vllm_stack.scheduling.index.blocks import salt_of, token_block_keys
from vllm_stack.scheduling.index.feed import KvEventFeed, sources_from_engine
from vllm_stack.scheduling.index.kv_events import EventBatch, KvEventIndexer, batch_decoder
from vllm_stack.scheduling.index.prefix_index import PrefixIndex

BS = 4
MODEL = "m"


def batch(*events: dict) -> EventBatch:
    return batch_decoder.decode(msgspec.msgpack.encode([0.0, list(events), 0]))


def test_indexer_keys_are_the_request_keys_and_follow_removals_and_clears() -> None:
    index = PrefixIndex()
    indexer = KvEventIndexer(index)
    ids = list(range(100, 100 + 5 * BS))
    want = token_block_keys(ids, BS, salt_of(MODEL, None))
    # Two events, chained by the engine's parent hash (bytes, as vLLM's sha256 hashes are).
    indexer.apply("e0", MODEL, batch(stored([b"h0", b"h1"], ids[: 2 * BS], BS)), None)
    indexer.apply("e0", MODEL, batch(stored([b"h2", b"h3", b"h4"], ids[2 * BS :], BS, parent=b"h1")), None)
    assert index.match("e0", want) == 5
    # An adapter's blocks are seeded with its name, a cache_salt with the salt (vLLM's extra keys).
    indexer.apply("e0", MODEL, batch(stored([7], ids[:BS], BS, lora_name="ad", extra_keys=[["ad"]])), None)
    indexer.apply("e0", MODEL, batch(stored([8], ids[:BS], BS, extra_keys=[["s1"]])), None)
    assert index.match("e0", token_block_keys(ids, BS, salt_of("ad", None))) == 1
    assert index.match("e0", token_block_keys(ids, BS, salt_of(MODEL, "s1"))) == 1
    # A block whose parent the router never saw cannot be keyed: counted, skipped.
    indexer.apply("e0", MODEL, batch(stored([b"x"], ids[:BS], BS, parent=b"unknown")), None)
    assert indexer.describe()["e0"]["orphans"] == 1
    # Offload tiers are not the engine's prefix cache.
    indexer.apply("e0", MODEL, batch(stored([b"c"], [1] * BS, BS, medium="CPU")), None)
    assert index.match("e0", token_block_keys([1] * BS, BS, salt_of(MODEL, None))) == 0
    indexer.apply("e0", MODEL, batch(removed([b"h3"])), None)
    assert index.match("e0", want) == 3
    indexer.apply("e0", MODEL, batch({"type": "AllBlocksCleared"}), None)
    assert index.match("e0", want) == 0 and index.blocks_of("e0") == 0
    # The hash map is bounded by the engine's capacity, as the index is.
    for i in range(50):
        indexer.apply("e1", MODEL, batch(stored([1000 + i], [i] * BS, BS)), 10)
    assert indexer.describe()["e1"]["mapped"] == 10 and index.blocks_of("e1") == 10
    indexer.forget_engine("e1")
    assert "e1" not in indexer.describe() and index.blocks_of("e1") == 0


def test_sources_from_engine_replace_the_wildcard_host() -> None:
    doc = {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": "tcp://*:5557",
            "replay_endpoint": "tcp://*:5558",
        },
        "1": {"enable_kv_cache_events": False, "publisher": "null"},
    }
    (src,) = sources_from_engine(doc, "http://10.1.2.3:8000")
    assert (src.endpoint, src.replay) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")
    assert sources_from_engine({}, "http://h:1") == [] and sources_from_engine(None, "http://h:1") == []


class Recorder:
    """A consumer that keeps what the feed hands it."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []  # the block hashes stored, per batch
        self.resets = 0

    def apply_events(self, engine: Engine, batch: EventBatch) -> None:
        self.batches.append([h for e in batch.events for h in getattr(e, "block_hashes", ())])

    def engine_reset(self, engine: Engine) -> None:
        self.resets += 1


async def until(predicate, within: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.02)


def one(pub: FakeKvPublisher, n: int, send: bool = True) -> int:
    return pub.publish(stored([n], [n] * BS, BS), send=send)


@pytest.mark.parametrize("replay", [True, False])
async def test_feed_replays_what_it_missed_and_resets_when_it_cannot(replay: bool) -> None:
    pub = FakeKvPublisher(replay=replay, buffer_steps=5)
    engine = Engine("e0", "http://127.0.0.1:1", CircuitBreaker(5, 10.0))
    engine.healthy = True
    engine.kv_events_endpoint, engine.kv_replay_endpoint = pub.endpoint, pub.replay_endpoint
    rec = Recorder()

    async def no_sources(_engine: Engine) -> None:
        raise AssertionError("discovery gave the endpoint; the engine is not asked")

    feed = KvEventFeed(lambda: [engine], no_sources)
    feed.consumers = (rec,)
    task = asyncio.ensure_future(feed.run(interval=0.05))
    try:
        for n in range(3):  # published before the router subscribed
            one(pub, n)
        await until(lambda: "e0" in feed.stats)
        # Until the subscription is up, batches are lost on the wire (ZMQ's late joiner): keep
        # publishing until one arrives. With replay, everything from seq 0 is then applied in order.
        n = 3
        while not rec.batches:
            one(pub, n)
            n += 1
            await asyncio.sleep(0.05)
        await until(lambda: feed.stats["e0"][0].last_seq == n - 1)
        if replay:
            assert rec.batches == [[i] for i in range(n)] and rec.resets == 0
        else:
            assert rec.resets == 0 and rec.batches[-1] == [n - 1]
        stats = feed.stats["e0"][0]
        # One batch lost on the wire: replayed from the buffer, or (no replay) the engine reset.
        rec.batches.clear()
        one(pub, 100, send=False)
        one(pub, 101)
        await until(lambda: stats.last_seq == n + 1)
        assert stats.gaps == 1
        if replay:
            assert rec.batches == [[100], [101]] and rec.resets == 0
        else:
            assert rec.batches == [[101]] and rec.resets == 1
        # More lost than the engine's buffer holds: reset, then what the buffer still had.
        resets = rec.resets
        rec.batches.clear()
        for k in range(8):
            one(pub, 200 + k, send=False)
        one(pub, 300)
        await until(lambda: stats.last_seq == n + 10)
        assert rec.resets == resets + 1
        assert rec.batches == ([[204], [205], [206], [207], [300]] if replay else [[300]])
        # The engine restarted: its sequence starts again, its cache is empty.
        resets = rec.resets
        pub.restart()
        one(pub, 400)
        await until(lambda: stats.last_seq == 0)
        assert rec.resets == resets + 1 and rec.batches[-1] == [400]
        # The engine left: its subscription ends.
        feed_engines: list[Engine] = []
        feed._engines = lambda: feed_engines  # noqa: SLF001 - the registry's list, emptied
        await until(lambda: "e0" not in feed.stats)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close()


def events_setup(tokenizer_dir: str) -> object:
    from vllm_stack.config import RouterConfig
    from vllm_stack.metrics import RouterMetrics
    from vllm_stack.scheduling.config import build_scheduling
    from vllm_stack.scheduling.plugins import builtin_registry
    from vllm_stack.scheduling.profiles import scheduling_config
    from vllm_stack.scheduling.registry import PluginState

    config = RouterConfig(routing_logic="prefixaware", tokenizers={MODEL: tokenizer_dir})
    return build_scheduling(scheduling_config(config), builtin_registry(), PluginState(), RouterMetrics())


def pool(n: int, block_size: int) -> list[Engine]:
    out = []
    for i in range(n):
        e = Engine(f"e{i}", f"http://10.0.0.{i}:8000", CircuitBreaker(5, 10.0))
        e.healthy, e.kv_block_size, e.kv_blocks = True, block_size, 10_000
        e.model_cards = ({"id": MODEL, "parent": None},)
        out.append(e)
    return out


def chat(user: int, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": "You answer from the shared handbook. " * 4}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"user {user} question {t} " * 10})
        messages.append({"role": "assistant", "content": f"answer {t} to {user} " * 5})
    return messages[:-1]


async def test_two_replicas_fed_the_same_events_make_the_same_decisions(tiny_model_dir) -> None:  # noqa: ANN001
    """Two routers (separate processes in production: separate plugin state here) that see the same
    events and the same engine loads choose the same engine for every request: follow-up turns where
    the events say their conversation is, new conversations by the same deterministic tie-break."""
    import json

    from vllm_stack.scheduling.framework import RequestContext
    from vllm_stack.scheduling.index.tokens import ChatTokenizer

    bs = 16
    tokenizer = ChatTokenizer(tiny_model_dir)
    replicas = [events_setup(str(tiny_model_dir)) for _ in range(2)]
    pools = [pool(3, bs), pool(3, bs)]
    # Conversations 0..5 were prefilled (by some other router) on engine u % 3, as its events say.
    for u in range(6):
        ids = tokenizer.chat_ids({"messages": chat(u, 2)})
        whole = len(ids) // bs
        event = stored([u * 1000 + b for b in range(whole)], ids[: whole * bs], bs)
        for setup, engines in zip(replicas, pools, strict=True):
            setup.plugins["prefix-cache-picker"].apply_events(engines[u % 3], batch(event))
    # The second replica has routed other traffic (to other engines) before: what it decides for these
    # requests must not depend on its own history.
    other = pool(3, bs)
    for o in other:
        o.name = "x" + o.name
    for user in range(100, 102):
        messages = chat(user, 1)
        body = json.dumps({"model": MODEL, "messages": messages}).encode()
        replicas[1].scheduler.schedule(RequestContext(MODEL, body=body, prompt=body), other)
    decisions: list[list[tuple[str, str]]] = [[], []]
    for user, turns in [(u, 3) for u in range(6)] + [(u, 1) for u in range(10, 22)]:
        messages = chat(user, turns)
        body = json.dumps({"model": MODEL, "messages": messages}).encode()
        for k, (setup, engines) in enumerate(zip(replicas, pools, strict=True)):
            ctx = RequestContext(MODEL, body=body, prompt=json.dumps(messages).encode())
            for hook in setup.hooks.prepare:
                pending = hook(ctx)
                if pending is not None:
                    await pending
            result = setup.scheduler.schedule(ctx, engines)
            decisions[k].append((result.engine.name, result.reason))
    assert decisions[0] == decisions[1]
    follow_ups, new = decisions[0][:6], decisions[0][6:]
    assert [name for name, _ in follow_ups] == [f"e{u % 3}" for u in range(6)]
    assert {reason for _, reason in follow_ups} <= {"prefix_hit", "prefix_partial"}
    assert len({name for name, _ in new}) == 3  # new conversations spread over the engines


async def test_an_adapter_uses_its_base_models_tokenizer_and_meets_its_events(tiny_model_dir) -> None:  # noqa: ANN001
    """An adapter's requests are tokenized with its base model's tokenizer (learnt from the engines'
    model cards after its first request) and keyed with the adapter's name, as the engine's events
    for that adapter are."""
    import json

    from vllm_stack.scheduling.framework import RequestContext
    from vllm_stack.scheduling.index.tokens import ChatTokenizer

    bs = 16
    setup = events_setup(str(tiny_model_dir))
    picker = setup.plugins["prefix-cache-picker"]
    engines = pool(2, bs)
    for e in engines:
        e.model_cards = ({"id": MODEL, "parent": None}, {"id": "ad", "parent": MODEL})
    messages = chat(1, 2)
    body = json.dumps({"model": "ad", "messages": messages}).encode()
    ids = ChatTokenizer(tiny_model_dir).chat_ids({"messages": messages})
    whole = len(ids) // bs
    event = stored(list(range(whole)), ids[: whole * bs], bs, lora_name="ad", extra_keys=[["ad"]] * whole)
    picker.apply_events(engines[1], batch(event))

    def route() -> tuple[RequestContext, str, str]:
        ctx = RequestContext("ad", body=body, prompt=json.dumps(messages).encode())
        for hook in setup.hooks.prepare:
            assert hook(ctx) is None
        result = setup.scheduler.schedule(ctx, engines)
        return ctx, result.engine.name, result.reason

    ctx, _, _ = route()  # the first: character blocks, and the base model is learnt
    assert "prefix-cache-picker/ids" not in ctx.cycle
    ctx, name, reason = route()
    assert list(ctx.cycle["prefix-cache-picker/ids"]) == ids
    assert (name, reason) == ("e1", "prefix_hit")  # where the adapter's events said its blocks are


async def test_feed_follows_an_engine_as_soon_as_it_turns_healthy_and_says_when_it_does() -> None:
    """A router replica that takes requests before it follows an engine's events places them without
    knowing what that engine caches, and without a replay endpoint it never learns what was published
    before it subscribed (issue 50: in the routing benchmark the second of two pickers subscribed about
    a second into the run, and the pair lost a tenth of the hits one picker had). So the feed subscribes
    the moment an engine turns healthy (kick), not at its next round, and says whether it follows
    every healthy engine (readiness waits for it)."""
    pub = FakeKvPublisher(replay=False)
    engine = Engine("e0", "http://127.0.0.1:1", CircuitBreaker(5, 10.0))
    engine.kv_events_endpoint = pub.endpoint
    rec = Recorder()
    rounds: list[int] = []
    joined: list[Engine] = []

    def engines() -> list[Engine]:
        rounds.append(1)
        return [engine, *joined]

    async def no_sources(_engine: Engine) -> None:
        raise AssertionError("discovery gave the endpoint; the engine is not asked")

    feed = KvEventFeed(engines, no_sources)
    assert feed.following()  # no consumer: nothing to follow
    feed.consumers = (rec,)
    task = asyncio.ensure_future(feed.run(interval=3600))  # no second round within the test
    try:
        await until(lambda: rounds)  # the first round ran, while the engine was not healthy
        assert feed.following()  # nothing healthy to follow
        engine.healthy = True
        assert not feed.following()
        feed.kick()
        await until(feed.following, within=5)
        other = Engine("e1", "http://127.0.0.1:2", CircuitBreaker(5, 10.0))
        other.healthy, other.kv_events_endpoint = True, pub.endpoint
        joined.append(other)
        assert feed.following()  # a router already serving stays ready while it subscribes to a newcomer
        n = 0

        def published() -> bool:
            nonlocal n
            n += 1
            one(pub, n)  # until the subscription has taken (ZMQ drops what comes before it)
            return bool(rec.batches)

        await until(published, within=5)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        pub.close()


async def test_the_registry_tells_when_an_engine_turns_healthy() -> None:
    from vllm_stack.engines.discovery.base import EndpointInfo
    from vllm_stack.engines.registry import EngineRegistry
    from vllm_stack.metrics import RouterMetrics

    registry = EngineRegistry(lambda _e: asyncio.sleep(0, []), RouterMetrics())
    told: list[str] = []
    registry.on_engine_healthy.append(lambda e: told.append(e.name))
    await registry.apply_snapshot([EndpointInfo("e0", "http://127.0.0.1:1")])
    engine = registry.get("e0")
    registry.record_check(engine, ok=True)
    await until(lambda: engine.healthy)
    registry.record_check(engine, ok=True)  # already healthy: told once
    assert told == ["e0"]


async def test_replicas_place_a_new_prefix_alike_whatever_each_has_in_flight(tiny_model_dir) -> None:  # noqa: ANN001
    """A document's second question that reaches another router replica before the engine has
    published the first one's blocks is a new prefix there too. Each replica counts only its own
    requests in flight; ranked by that work ahead, two replicas placed such a document on different
    engines (issue 50's routing benchmark, two pickers: one document cached on both engines in 3 of 3
    runs, the fills equal in both views). Where every engine's index comes from its events, a new
    prefix goes by fill and a hash of the prompt, so both replicas place it alike."""
    import json

    from vllm_stack.scheduling.framework import RequestContext

    bs = 16
    replicas = [events_setup(str(tiny_model_dir)) for _ in range(2)]
    pools = [pool(2, bs), pool(2, bs)]
    for setup, engines in zip(replicas, pools, strict=True):
        for engine in engines:  # both engines publish (their caches were reset)
            setup.plugins["prefix-cache-picker"].apply_events(engine, batch({"type": "AllBlocksCleared"}))
    # Each replica has its own requests in flight, on the other engine.
    pools[0][1].in_flight, pools[1][0].in_flight = 3, 3
    placed: list[list[str]] = [[], []]
    for doc in range(12):
        messages = [
            {"role": "system", "content": "Answer from the document."},
            {
                "role": "user",
                "content": f"Document {doc}. " + " ".join(f"line {i} of {doc}" for i in range(60)),
            },
        ]
        body = json.dumps({"model": MODEL, "messages": messages}).encode()
        for k, (setup, engines) in enumerate(zip(replicas, pools, strict=True)):
            ctx = RequestContext(MODEL, body=body, prompt=json.dumps(messages).encode())
            for hook in setup.hooks.prepare:
                assert hook(ctx) is None
            result = setup.scheduler.schedule(ctx, engines)
            assert result.reason in ("prefix_miss", "prefix_spread")
            placed[k].append(result.engine.name)
    assert placed[0] == placed[1]
    assert set(placed[0]) == {"e0", "e1"}  # new documents spread over the engines


def document(doc: int) -> list[dict]:
    return [
        {"role": "system", "content": "Answer from the document."},
        {"role": "user", "content": f"Document {doc}. " + " ".join(f"line {i} of {doc}" for i in range(60))},
    ]


async def place_on_both(
    replicas: list, pools: list[list[Engine]], messages: list[dict]
) -> list[tuple[str, str]]:
    """Each replica's (engine, reason) for the same request, each with its own engines' view."""
    import json

    from vllm_stack.scheduling.framework import RequestContext

    body = json.dumps({"model": MODEL, "messages": messages}).encode()
    out = []
    for setup, engines in zip(replicas, pools, strict=True):
        ctx = RequestContext(MODEL, body=body, prompt=json.dumps(messages).encode())
        for hook in setup.hooks.prepare:
            assert hook(ctx) is None
        result = setup.scheduler.schedule(ctx, engines)
        out.append((result.engine.name, result.reason))
    return out


async def test_replicas_keep_a_cached_prefix_alike_whatever_each_has_in_flight(tiny_model_dir) -> None:  # noqa: ANN001
    """Under cache pressure (issue 50's workload e) two picker replicas hit fewer prompt tokens than one
    (33.3% against 37.9%): for a prefix an engine holds, each replica's cost counted its own requests'
    prefill still ahead there, so one kept the document on its holder and the other copied it. Where
    every engine's index comes from its events, the work ahead is what the engines publish, the same
    for both: a replica with a long prefill of its own queued on the holder keeps the hit too."""
    from vllm_stack.scheduling.index.tokens import ChatTokenizer

    bs = 16
    replicas = [events_setup(str(tiny_model_dir)) for _ in range(2)]
    pools = [pool(2, bs), pool(2, bs)]
    ids = ChatTokenizer(tiny_model_dir).chat_ids({"messages": document(7)})
    whole = len(ids) // bs
    held = stored(list(range(whole)), ids[: whole * bs], bs)
    for setup, engines in zip(replicas, pools, strict=True):
        picker = setup.plugins["prefix-cache-picker"]
        picker.apply_events(engines[0], batch(held))
        picker.apply_events(engines[1], batch({"type": "AllBlocksCleared"}))
    # Replica 0 has sent e0 prompts it has yet to prefill, worth many times this document.
    pools[0][0].prefill_tokens, pools[0][0].in_flight = 100_000, 2
    assert await place_on_both(replicas, pools, document(7)) == [("e0", "prefix_hit")] * 2


async def test_replicas_choose_alike_between_two_holders_whatever_each_has_in_flight(tiny_model_dir) -> None:  # noqa: ANN001
    """Of two engines holding a document, each replica's own work ahead would send it to the engine where
    that replica has less queued, which differs between replicas; with a shared view both choose alike."""
    from vllm_stack.scheduling.index.tokens import ChatTokenizer

    bs = 16
    replicas = [events_setup(str(tiny_model_dir)) for _ in range(2)]
    pools = [pool(2, bs), pool(2, bs)]
    for doc in range(8):
        ids = ChatTokenizer(tiny_model_dir).chat_ids({"messages": document(doc)})
        whole = len(ids) // bs
        held = stored([doc * 1000 + b for b in range(whole)], ids[: whole * bs], bs)
        for setup, engines in zip(replicas, pools, strict=True):
            for engine in engines:
                setup.plugins["prefix-cache-picker"].apply_events(engine, batch(held))
    # Each replica has prompts of its own queued on a different engine.
    pools[0][0].prefill_tokens, pools[0][0].in_flight = 100_000, 2
    pools[1][1].prefill_tokens, pools[1][1].in_flight = 100_000, 2
    for doc in range(8):
        first, second = await place_on_both(replicas, pools, document(doc))
        assert first == second and first[1] == "prefix_hit"
