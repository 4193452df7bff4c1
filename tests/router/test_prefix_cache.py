"""Prefix-cache routing, character mode: block keys, the bounded index and the picker, tested alone
on in-memory engines (no HTTP; the routing-quality benchmark on real engines is separate)."""

from __future__ import annotations

import collections
import json

from vllm_stack.config import RouterConfig
from vllm_stack.engines.circuit import CircuitBreaker
from vllm_stack.engines.engine import Engine
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.config import build_scheduling
from vllm_stack.scheduling.framework import RequestContext
from vllm_stack.scheduling.index.blocks import char_block_keys, salt_of
from vllm_stack.scheduling.index.prefix_index import PrefixIndex
from vllm_stack.scheduling.plugins import builtin_registry
from vllm_stack.scheduling.profiles import scheduling_config
from vllm_stack.scheduling.registry import PluginState
from vllm_stack.telemetry.scraper import parse_engine_metrics


def engines(n: int, block_size: int = 16, blocks: int | None = None) -> list[Engine]:
    out = []
    for i in range(n):
        e = Engine(f"e{i}", f"http://10.0.0.{i}:8000", CircuitBreaker(5, 10.0))
        e.healthy = True
        e.kv_block_size = block_size
        e.kv_blocks = blocks
        out.append(e)
    return out


def conversation(user: int, turns: int) -> bytes:
    system = {"role": "system", "content": "You answer questions about the shared handbook. " * 2}
    messages = [system]
    for t in range(turns):
        messages.append({"role": "user", "content": f"user {user} asks question number {t} " * 12})
        messages.append({"role": "assistant", "content": f"answer {t} for user {user} " * 6})
    return json.dumps(messages[:-1]).encode()


def test_keys_chain_blocks_and_depend_on_model_and_salt() -> None:
    a = b"x" * 100 + b"y" * 100
    b = b"x" * 100 + b"z" * 100
    ka, kb = char_block_keys(a, 50, salt_of("m")), char_block_keys(b, 50, salt_of("m"))
    assert len(ka) == 4 and ka[:2] == kb[:2] and ka[2] != kb[2]
    assert char_block_keys(a[:149], 50, salt_of("m")) == ka[:2]  # only whole blocks
    assert char_block_keys(a, 50, salt_of("other"))[0] != ka[0]
    assert char_block_keys(a, 50, salt_of("m", "tenant-1"))[0] != ka[0]
    # equal blocks at different depths get different keys (the chain), and keys are process-stable
    assert len(set(char_block_keys(b"x" * 200, 50, salt_of("m")))) == 4
    assert char_block_keys(a, 50, salt_of("m")) == ka


def test_index_is_bounded_per_engine_and_globally_and_forgets_engines() -> None:
    index = PrefixIndex(max_blocks=250)
    index.record("a", list(range(100)), capacity=80)
    assert index.blocks_of("a") == 80 and index.match("a", [0]) == 0 and index.match("a", [20, 21]) == 2
    index.record("a", [20, 21], capacity=80)  # touched: now the most recent
    index.record("a", list(range(1000, 1078)), capacity=80)
    assert index.match("a", [20, 21]) == 2 and index.match("a", [22]) == 0
    index.record("b", list(range(2000, 2200)), capacity=1000)
    assert len(index) <= 250 and len(index) == index.blocks_of("a") + index.blocks_of("b")
    index.forget_engine("b")
    assert index.blocks_of("b") == 0 and len(index) == index.blocks_of("a")


def scheduler(config: RouterConfig | None = None, state: PluginState | None = None):  # noqa: ANN201
    config = config or RouterConfig(static_backends=("http://x:1",), routing_logic="prefixaware")
    return build_scheduling(
        scheduling_config(config),
        builtin_registry(),
        state if state is not None else PluginState(),
        RouterMetrics(),
    ).scheduler


def test_follow_up_turns_stay_and_new_conversations_spread() -> None:
    s = scheduler()
    pool = engines(3)
    first_engine = {}
    for user in range(6):
        first_engine[user] = s.schedule(RequestContext("m", prompt=conversation(user, 1)), pool).engine
    # a short shared system prompt does not pull new conversations onto one engine
    assert sorted(collections.Counter(e.name for e in first_engine.values()).values()) == [2, 2, 2]
    for turns in (2, 3, 4):
        for user in range(6):
            result = s.schedule(RequestContext("m", prompt=conversation(user, turns)), pool)
            assert result.engine is first_engine[user], (user, turns)
            assert result.reason == "prefix_partial"


def test_a_hit_never_goes_to_an_overloaded_engine() -> None:
    s = scheduler()
    pool = engines(2)
    prompt = conversation(0, 2)
    home = s.schedule(RequestContext("m", prompt=prompt), pool).engine
    # the other has none: ceil(1.25 * 9 / 2) + slack 2 = 8, and home is at 8
    home.in_flight = 8
    result = s.schedule(RequestContext("m", prompt=prompt), pool)
    assert result.engine is not home and result.reason == "prefix_overflow"
    home.in_flight = 0
    assert s.schedule(RequestContext("m", prompt=prompt), pool).reason == "prefix_hit"


def test_a_hit_stays_while_the_work_ahead_costs_less_than_prefilling_elsewhere() -> None:
    """The choice weighs the prefill a hit saves against the work queued ahead of it: requests in
    flight that are mostly cached do not push a long shared prompt onto an engine without it; a
    queue of uncached prefill larger than the saving plus the copy's cache space (``copy_cost``, two
    tokens per token copied) does, and the prefix then lives on both engines."""
    s = scheduler()
    pool = engines(2, block_size=16)
    document = json.dumps([{"role": "user", "content": "the long shared document " * 200}]).encode()
    ctx = RequestContext("m", prompt=document)
    home = s.schedule(ctx, pool).engine
    prompt_tokens = len(document) / 4
    assert ctx.prefill_tokens == int(prompt_tokens)  # nothing cached anywhere yet
    other = next(e for e in pool if e is not home)
    # four requests in flight on home, each with a short uncached question left to prefill
    home.in_flight, home.prefill_tokens = 4, 4 * 50
    ctx = RequestContext("m", prompt=document)
    result = s.schedule(ctx, pool)
    assert result.engine is home and result.reason == "prefix_hit"
    assert ctx.prefill_tokens < 16  # at most the partial last block
    # a queue of uncached prefill worth the whole prompt three times: still home (the copy costs
    # twice its size in cache on top of its prefill); past that, the idle engine prefills it too
    home.prefill_tokens = 3 * int(prompt_tokens) - 100
    assert s.schedule(RequestContext("m", prompt=document), pool).engine is home
    home.prefill_tokens = 3 * int(prompt_tokens) + 100
    result = s.schedule(RequestContext("m", prompt=document), pool)
    assert result.engine is other and result.reason == "prefix_replicate"
    home.in_flight, home.prefill_tokens = 0, 0
    again = s.schedule(RequestContext("m", prompt=document), pool)
    assert again.reason == "prefix_hit"


def test_a_hot_prefix_is_copied_before_its_engine_takes_more_than_its_share() -> None:
    """At low concurrency the holder of a hot prefix is always the cheapest engine; the bound on
    each engine's share of the recent decisions (``share_window``) copies the prefix to a second
    engine instead of letting one engine take all of that traffic."""
    s = scheduler()
    pool = engines(2, block_size=16)
    hot = json.dumps([{"role": "system", "content": "the hot tenant's long policy " * 100}])
    reasons = collections.Counter()
    per_engine = collections.Counter()
    for i in range(400):
        prompt = (hot[:-1] + json.dumps([{"role": "user", "content": f"question {i}"}])[1:]).encode()
        result = s.schedule(RequestContext("m", prompt=prompt), pool)
        reasons[result.reason] += 1
        per_engine[result.engine.name] += 1
    assert reasons["prefix_overflow"] >= 1  # the copy, once
    assert max(per_engine.values()) / (400 / 2) <= 1.3  # no engine above 1.3 x the mean


def test_when_each_engine_is_over_one_bound_the_load_bound_decides() -> None:
    """One engine over the in-flight bound, the other over its share of recent decisions: the request
    goes to the one under the in-flight bound (never, by default, to the first engine listed)."""
    s = scheduler()
    pool = engines(2, block_size=16)
    picker = s.profile.picker
    busy, recent = pool
    busy.in_flight = 20
    for _ in range(50):
        picker.shares_for("m").add(recent.name)
    prompt = json.dumps([{"role": "user", "content": "a prompt of several blocks " * 20}]).encode()
    assert s.schedule(RequestContext("m", prompt=prompt), pool).engine is recent


def test_the_share_bound_counts_each_model_apart() -> None:
    """Traffic of a model only one engine serves does not count against that engine for another model."""
    s = scheduler()
    pool = engines(2, block_size=16)
    document = json.dumps([{"role": "user", "content": "model x document " * 40}]).encode()
    first = s.schedule(RequestContext("x", prompt=document), pool).engine
    for i in range(40):  # model y, on the same engine only
        other = json.dumps([{"role": "user", "content": f"model y prompt {i} " * 20}]).encode()
        s.schedule(RequestContext("y", prompt=other), [first])
    again = s.schedule(RequestContext("x", prompt=document), pool)
    assert again.engine is first and again.reason == "prefix_hit"


def test_the_index_survives_a_rebuild_and_engines_leaving() -> None:
    state = PluginState()
    pool = engines(2)
    prompt = conversation(1, 2)
    home = scheduler(state=state).schedule(RequestContext("m", prompt=prompt), pool).engine
    again = scheduler(state=state).schedule(RequestContext("m", prompt=prompt), pool)  # a reload
    assert again.engine is home and again.reason == "prefix_hit"
    state.forget_engine(home.name)
    assert scheduler(state=state).schedule(RequestContext("m", prompt=prompt), pool).reason == "prefix_miss"


def test_kv_geometry_is_read_from_cache_config_info() -> None:
    text = (
        'vllm:num_requests_running{model_name="m"} 1\nvllm:num_requests_waiting{model_name="m"} 0\n'
        'vllm:cache_config_info{block_size="128",cache_dtype="auto",num_gpu_blocks="64",'
        'kv_cache_size_tokens="8192"} 1.0\n'
    )
    t = parse_engine_metrics(text)
    assert (t.block_size, t.num_blocks) == (128, 64)


async def test_token_mode_keys_follow_the_engines_token_blocks(tiny_model_dir) -> None:  # noqa: ANN001
    """With the model's tokenizer, keys come from token ids (tokenized on a worker thread past
    ``inline_bytes``), and a follow-up turn shares its leading keys with the turn before."""
    from vllm_stack.scheduling.index.blocks import token_block_keys
    from vllm_stack.scheduling.index.tokens import ChatTokenizer

    raw = {
        "plugins": [
            {
                "type": "prefix-cache-picker",
                "parameters": {"tokenizers": {"m": str(tiny_model_dir)}, "inline_bytes": 0},
            }
        ],
        "schedulingProfiles": [{"name": "p", "plugins": ["prefix-cache-picker"]}],
    }
    setup = build_scheduling(raw, builtin_registry(), PluginState(), RouterMetrics())
    picker = setup.plugins["prefix-cache-picker"]
    assert picker.describe()["token_mode_models"] == ["m"]
    pool = engines(2, block_size=16)
    chosen = []
    for turns in (2, 3):
        messages = json.loads(conversation(7, turns))
        body = json.dumps({"model": "m", "messages": messages}).encode()
        ctx = RequestContext("m", body=body, prompt=json.dumps(messages).encode())
        (hook,) = setup.hooks.prepare
        pending = hook(ctx)
        assert pending is not None  # past inline_bytes: a worker thread tokenizes
        await pending
        ids = list(ctx.cycle["prefix-cache-picker/ids"])
        assert ids == ChatTokenizer(tiny_model_dir).chat_ids({"messages": messages})
        result = setup.scheduler.schedule(ctx, pool)
        chosen.append(result)
        expected = token_block_keys(ids, 16, salt_of("m", None))
        assert picker.index.match(result.engine.name, expected) == len(expected)
    assert chosen[1].engine is chosen[0].engine and chosen[1].reason == "prefix_partial"
