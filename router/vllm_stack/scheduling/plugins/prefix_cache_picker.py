"""Picker: send a request where its prompt's leading blocks were sent before, within a load bound.

The prompt is cut into blocks aligned with the engines' KV blocks and keyed by a chain of hashes that
starts from the model (or adapter) name and ``cache_salt``. Two modes, per model:
- tokens, when the plugin has the model's tokenizer (``tokenizers``: model name -> directory with
  ``tokenizer.json`` and ``tokenizer_config.json``): the engine's own token ids (the chat template
  rendered as vLLM renders it, :mod:`..index.tokens`), cut into the engine's ``block_size``, so an
  index hit is an engine cache hit. Tokenizing runs in the prepare-data stage; a prompt over
  ``inline_bytes`` is tokenized on a worker thread (the event loop goes on meanwhile);
- characters otherwise: ``chars_per_token`` x ``block_size`` bytes of the raw prompt JSON
  (:mod:`..index.blocks`), an approximation. The router's index
(:class:`~..index.prefix_index.PrefixIndex`, in the plugin state, so it survives reloads) remembers
which engine was sent which blocks, bounded per engine by that engine's KV capacity.

The choice is a cost in prompt tokens: what a hit saves against the work queued ahead of it.
- Work ahead on an engine: the prompt tokens the router's requests there still have to prefill
  (``Engine.prefill_tokens``, booked from ``ctx.prefill_tokens`` when a request is sent, released at
  its first token), plus ``request_tokens`` per request in flight (their decoding).
- A prompt with at least ``match_threshold`` of its blocks on some engine: each engine costs the
  work ahead + the prompt tokens it lacks + ``copy_cost`` (2) x the tokens another engine holds and
  it would hold again (the copy's cache space, and the dead copy a conversation leaves behind when
  it moves). The cheapest wins: a hit stays while its queue costs
  less than prefilling elsewhere, and a hot prefix is copied to a second engine when its holder's
  queue is worth more than that (``prefix_replicate``).
- Below that (a new conversation that shares only, say, a system prompt), or where the longest match
  is shorter than ``min_match_chars`` characters of prompt (production-stack's
  ``--prefix-min-match-length``, converted at ``chars_per_token``; 0: no minimum), the request is a new
  prefix: it goes to the engine holding the fewest blocks, then the one with the least work ahead,
  so what is new spreads over the engines' caches and a short shared prefix ends up cached on
  several engines instead of pulling every conversation onto one.
- Where every candidate's index comes from its KV events, router replicas hold the same fills but each
  knows only its own requests in flight, so the choice rests on what they all read alike: a new prefix
  goes by the fill and then a hash of the prompt, and the work ahead is left out of the cost (the two
  bounds below still keep a hot prefix from piling onto one engine).
- Two bounds first, so a popular prefix never piles onto one engine: the in-flight bound (requests
  in flight plus engine queue below ``ceil((1 + epsilon) * (total + 1) / n) + slack``) and the share
  bound (an engine's share of the model's last ``share_window`` decisions below
  ``max(ceil((1 + epsilon) * (decisions + 1) / n), 4)``; see :class:`RecentShares`). A holder over
  either loses the request (``prefix_overflow``); when every engine is over one of them, the
  in-flight bound alone decides.
A prompt shorter than one block (which no engine caches) is placed by bounded-load consistent hashing
of its first bytes, so equal short prompts still meet.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
from collections.abc import Sequence
from typing import Any

import orjson
import xxhash

from vllm_stack.config import ConfigError
from vllm_stack.engines.engine import Engine
from vllm_stack.engines.load import bounded_capacity, engine_loads
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.framework import Completion, RequestContext, Role
from vllm_stack.scheduling.index.blocks import char_block_keys, salt_of, token_block_keys
from vllm_stack.scheduling.index.kv_events import EventBatch, KvEventIndexer
from vllm_stack.scheduling.index.prefix_index import DEFAULT_MAX_BLOCKS, PrefixIndex
from vllm_stack.scheduling.index.tokenizer_source import HubTokenizer, is_hub
from vllm_stack.scheduling.plugins.consistent_hash_picker import ConsistentHashPicker, prefix_key
from vllm_stack.scheduling.registry import Parameters, PluginContext

log = logging.getLogger(__name__)
_xxh3 = xxhash.xxh3_64_intdigest
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')

MAX_ADAPTERS = 10_000  # adapters whose base model is remembered
MIN_SHARE = 4  # decisions in a row one engine may always take (a few are no lack of balance)


class PrefixCachePicker:
    type_name = "prefix-cache-picker"
    roles = (Role.PREPARE_DATA, Role.PICKER, Role.RESPONSE_COMPLETE)

    def __init__(
        self,
        name: str,
        index: PrefixIndex,
        epsilon: float = 0.25,
        chars_per_token: float = 4.0,
        match_threshold: float = 0.5,
        request_tokens: float = 16.0,
        slack: int = 2,
        copy_cost: float = 2.0,
        share_window: int = 256,
        tokenizers: dict[str, Any] | None = None,
        inline_bytes: int = 16_384,
        kv_events: KvEventIndexer | None = None,
        metrics: RouterMetrics | None = None,
        min_match_chars: float = 0.0,
    ) -> None:
        self.name = name
        self.index = index
        self.epsilon = epsilon
        self.chars_per_token = chars_per_token
        self.match_threshold = match_threshold
        self.request_tokens = request_tokens
        self.slack = slack
        self.copy_cost = copy_cost
        self.share_window = share_window
        # a match below this many prompt tokens counts as none (production-stack's minimum, in tokens)
        self.min_match_tokens = min_match_chars / chars_per_token
        self._shares: dict[str, RecentShares] = {}  # per model: models may be served by different engines
        self.tokenizers = tokenizers or {}  # model name -> ChatTokenizer
        self.inline_bytes = inline_bytes
        self.kv_events = kv_events
        self.metrics = metrics
        self._ids_key = name + "/ids"
        self._predicted_key = name + "/predicted"
        # adapter name -> its base model (from the engines' model cards), whose tokenizer it uses
        self._bases: dict[str, str] = {}
        self._short = ConsistentHashPicker("prefix", prefix_key, epsilon)

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> PrefixCachePicker:
        epsilon = parameters.number("epsilon", 0.25)
        if epsilon <= 0:
            raise ConfigError(f"plugin {name!r}: epsilon must be > 0")
        chars = parameters.number("chars_per_token", 4.0, minimum=0.5)
        threshold = parameters.number("match_threshold", 0.5, minimum=0.0)
        per_request = parameters.number("request_tokens", 16.0, minimum=0.0)
        slack = int(parameters.number("slack", 2, minimum=0))
        copy_cost = parameters.number("copy_cost", 2.0, minimum=0.0)
        window = int(parameters.number("share_window", 256, minimum=0))
        max_blocks = int(parameters.number("max_blocks", DEFAULT_MAX_BLOCKS, minimum=1))
        index = context.state.get((cls.type_name, name), lambda: PrefixIndex(max_blocks))
        index.max_blocks = max_blocks
        tokenizers: dict[str, Any] = {}
        for model, source in parameters.mapping("tokenizers").items():
            from vllm_stack.scheduling.index.tokens import ChatTokenizer  # only when one is configured

            # Loaded once per source and kept across reloads (a tokenizer takes a while to load);
            # a Hub repository is fetched in the background (character blocks until it is there).
            tokenizers[model] = context.state.get(
                ("tokenizer", source),
                lambda s=source: HubTokenizer(s) if is_hub(s) else ChatTokenizer(s),
            )
        inline = int(parameters.number("inline_bytes", 16_384, minimum=0))
        min_match = parameters.number("min_match_chars", 0.0, minimum=0.0)
        mode = parameters.switch("kv_events", "auto")
        # Event keys come from token ids: without a tokenizer no request key would ever match them.
        events = None
        if mode == "on" or (mode == "auto" and tokenizers):
            events = context.state.get((cls.type_name, name, "kv_events"), lambda: KvEventIndexer(index))
        return cls(
            name,
            index,
            epsilon,
            chars,
            threshold,
            per_request,
            slack,
            copy_cost,
            window,
            tokenizers,
            inline,
            events,
            context.metrics,
            min_match,
        )

    # ---- KV events (vllm_stack.scheduling.index.feed.KvEventConsumer) ---------------------------------
    @property
    def wants_kv_events(self) -> bool:
        return self.kv_events is not None

    def apply_events(self, engine: Engine, batch: EventBatch) -> None:
        if self.kv_events is not None:
            self.kv_events.apply(engine.name, base_model(engine), batch, engine.kv_blocks, engine.kind)

    def engine_reset(self, engine: Engine) -> None:
        if self.kv_events is not None:
            self.kv_events.forget_engine(engine.name)

    # ---- prepare-data: token ids, when the model's tokenizer is known ----------------------------------
    def prepare(self, ctx: RequestContext) -> asyncio.Future[None] | None:
        ctx.keep_answer_end = self.metrics is not None  # the engine's usage: see response_complete
        tokenizer = self.tokenizers.get(ctx.model)
        if tokenizer is None:
            base = self._bases.get(ctx.model)
            tokenizer = self.tokenizers.get(base) if base else None
        if tokenizer is None or ctx.prompt is None:
            return None
        if type(tokenizer) is HubTokenizer:
            tokenizer = tokenizer.ready()
            if tokenizer is None:
                return None
        if len(ctx.body) <= self.inline_bytes:
            self._tokenize(ctx, tokenizer)
            return None
        return asyncio.get_running_loop().run_in_executor(None, self._tokenize, ctx, tokenizer)

    def _tokenize(self, ctx: RequestContext, tokenizer: Any) -> None:  # noqa: ANN401 - a ChatTokenizer
        """Token ids into the cycle state; on any failure none, and the request uses character blocks."""
        try:
            doc = orjson.loads(ctx.body)
            if isinstance(doc.get("messages"), list):
                ids = tokenizer.chat_id_array(doc)
            elif isinstance(doc.get("prompt"), str):
                ids = tokenizer.prompt_ids(doc["prompt"])
            else:
                return
        except Exception as exc:  # noqa: BLE001 - a template or tokenizer refusal: fall back, never fail
            log.debug("tokenizing for %s failed, character blocks instead: %s", ctx.model, exc)
            return
        ctx.cycle[self._ids_key] = ids
        ctx.prompt_tokens = len(ids)

    def _keys(self, ctx: RequestContext, block_tokens: int) -> list[int]:
        cache = ctx.cycle.get(self.name)
        if cache is None:
            cache = ctx.cycle[self.name] = {}
        keys = cache.get(block_tokens)
        if keys is None:
            salt = salt_of(ctx.model, ctx.cache_salt)
            ids = ctx.cycle.get(self._ids_key)
            if ids is not None:
                keys = token_block_keys(ids, block_tokens, salt)
            elif ctx.prompt:
                keys = char_block_keys(ctx.prompt, max(1, int(block_tokens * self.chars_per_token)), salt)
            else:
                keys = []
            cache[block_tokens] = keys
        return keys

    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]:
        placed = self._place(ctx, engines)
        if placed is None:
            return self._short.pick(ctx, engines, scores)
        engine, reason, cached, prompt, keys, recent = placed
        ctx.prefill_tokens = max(1, int(prompt - cached))
        ctx.predicted_cached = cached
        ctx.cycle[self._predicted_key] = (cached, engine.kv_block_size or engine.kind.default_block_tokens)
        self.index.record(engine.name, keys, engine.kv_blocks)
        recent.add(engine.name)
        return engine, reason

    def uncached_tokens(self, ctx: RequestContext, engines: Sequence[Engine]) -> int:
        """The prompt tokens the engine :meth:`pick` would choose among ``engines`` lacks (what it
        would set ``ctx.prefill_tokens`` to; 0 for a prompt shorter than a block), without placing
        the request: nothing recorded (disaggregation's decider, before the prefill profile picks)."""
        placed = self._place(ctx, engines)
        return 0 if placed is None else max(1, int(placed[3] - placed[2]))

    def _place(
        self, ctx: RequestContext, engines: Sequence[Engine]
    ) -> tuple[Engine, str, int, float, list[int], RecentShares] | None:
        """Where the request goes by its blocks, and why: (engine, reason, prompt tokens cached there,
        prompt tokens, its block keys there, the model's recent shares); None for a prompt shorter
        than one block. Reads the index and the shares, changes neither."""
        if self.tokenizers and ctx.model not in self.tokenizers and ctx.model not in self._bases:
            self._learn_base(ctx.model, engines[0])
        first = self._keys(ctx, engines[0].kv_block_size or engines[0].kind.default_block_tokens)
        if not first:
            return None
        loads = engine_loads(engines)
        n = len(engines)
        cap = bounded_capacity(loads, self.epsilon) + self.slack
        recent = self.shares_for(ctx.model)
        shares = recent.counts(engines)
        share_cap = max(bounded_capacity(shares, self.epsilon), MIN_SHARE)
        over = [n > 1 and (loads[i] >= cap or shares[i] >= share_cap) for i in range(n)]
        if all(over):  # each over one bound or the other: the in-flight bound alone decides
            over = [load >= cap for load in loads]
        index = self.index
        seed = first[0]
        prompt = self._prompt_tokens(ctx)
        matched = []
        cached = []  # prompt tokens found in each engine's cache
        share = 0.0  # the largest share of the prompt's blocks found on one engine
        for e in engines:
            block_tokens = e.kv_block_size or e.kind.default_block_tokens
            keys = self._keys(ctx, block_tokens)
            blocks = index.match(e.name, keys)
            matched.append(blocks)
            cached.append(blocks * block_tokens)
            if blocks and blocks / len(keys) > share:
                share = blocks / len(keys)
        most = max(cached)
        new_prefix = most == 0 or share < self.match_threshold or most < self.min_match_tokens
        # Where every candidate's index entry comes from its KV events, every router replica holds the
        # same fills: the choice then rests only on what they all read alike (see _shared_view).
        shared = self._shared_view(engines)
        agreed = first[min(max(matched), len(first) - 1)] if shared and new_prefix else None
        per_request = self.request_tokens
        best: tuple[float, ...] | None = None
        chosen = 0
        for i, e in enumerate(engines):
            if over[i]:
                continue
            # Work ahead of this request there, in prompt tokens: what this router's requests still have
            # to prefill, plus a share per request in flight (their decoding). Exact for one router; each
            # of several replicas sees only its own part, so it is left out with a shared view.
            ahead = 0.0 if shared else e.prefill_tokens + per_request * e.in_flight
            # Ties go by a hash of the prompt's first block and the engine's name: different prompts
            # spread, and every router replica given the same state makes the same choice.
            if agreed is not None:
                rank: tuple[float, ...] = (index.blocks_of(e.name), tie_break(e.name, agreed))
            elif new_prefix:
                rank = (index.blocks_of(e.name), ahead, tie_break(e.name, seed))
            else:
                # Prefilling a part another engine holds also costs cache space: the copy, and for a
                # conversation that then follows it, the dead copy it leaves behind (copy_cost 2).
                cost = ahead + max(0.0, prompt - cached[i]) + self.copy_cost * (most - cached[i])
                rank = (cost, -cached[i], index.blocks_of(e.name), tie_break(e.name, seed))
            if best is None or rank < best:
                best, chosen = rank, i
        engine = engines[chosen]
        keys = self._keys(ctx, engine.kv_block_size or engine.kind.default_block_tokens)
        here = cached[chosen]
        if new_prefix:
            reason = "prefix_miss" if most == 0 else "prefix_spread"
        elif here < most:
            holders = [i for i, c in enumerate(cached) if c == most]
            # every engine holding more was over a bound; else less work there, even prefilling
            reason = "prefix_overflow" if all(over[i] for i in holders) else "prefix_replicate"
        else:
            reason = "prefix_hit" if matched[chosen] == len(keys) else "prefix_partial"
        return engine, reason, here, prompt, keys, recent

    def _shared_view(self, engines: Sequence[Engine]) -> bool:
        """Whether every candidate's index comes from its KV events, so that every router replica
        following them holds the same fills.

        Why it matters: each replica counts only its own requests in flight. A document's next
        question that reaches another replica before the engine has published the last one's blocks
        is a new prefix there too; ranked by each replica's own work ahead, two replicas placed it on
        different engines (issue 50's routing benchmark, two pickers: one document cached on both
        engines, with the fills equal in both replicas' views). Under cache pressure (workload e) the
        same held for matched prefixes: where a holder's cost and another engine's were close, each
        replica's own work ahead tipped the choice, and two pickers hit 33.3% of prompt tokens against
        one's 37.9% (``picker_replicas_e_check.md``). So with a shared view a new prefix goes by the fill
        and then a hash of its first block past the longest match (prompts that share only a system
        prompt spread), and the work ahead is left out: on e two pickers then hit 39.5% against one's
        40.4%, and one picker stays within the spreads of the run before, or above them, on a-e
        (``routing_shared_view_ab.md``). The engines' scraped running and waiting, which every replica
        reads alike, were tried in its place and were no better than before on d, and lower for one
        router on e: between two scrapes every decision reads the same figures."""
        events = self.kv_events
        return events is not None and all(events.follows(e.name) for e in engines)

    def claim(self, ctx: RequestContext, engine: Engine, keys: list[int]) -> None:
        """Remember that ``engine`` was sent these blocks and took one of the model's decisions."""
        self.index.record(engine.name, keys, engine.kv_blocks)
        self.shares_for(ctx.model).add(engine.name)

    def shares_for(self, model: str) -> RecentShares:
        """The model's recent decisions (bounded: models come from the engines' cards, few)."""
        shares = self._shares.get(model)
        if shares is None:
            if len(self._shares) >= MAX_ADAPTERS:
                self._shares.clear()
            shares = self._shares[model] = RecentShares(self.share_window)
        return shares

    def _prompt_tokens(self, ctx: RequestContext) -> float:
        """The prompt's length in tokens: counted in token mode, estimated from bytes otherwise."""
        ids = ctx.cycle.get(self._ids_key)
        if ids is not None:
            return float(len(ids))
        return len(ctx.prompt or b"") / self.chars_per_token

    def _learn_base(self, model: str, engine: Engine) -> None:
        """Note an adapter's base model, so its next requests are tokenized with the base's tokenizer
        (this one goes by character blocks). Bounded: adapters are bounded per engine by the registry."""
        if len(self._bases) >= MAX_ADAPTERS:
            return
        for card in engine.model_cards:
            if card.get("id") == model:
                parent = card.get("parent")
                # "" for a model without a tokenizer of its own or of its base: not looked up again
                self._bases[model] = parent if isinstance(parent, str) and parent in self.tokenizers else ""
                return

    # ---- response-complete: predicted against actual cached tokens -----------------------------------
    def response_complete(self, ctx: RequestContext, completion: Completion) -> None:
        if self.metrics is None or not completion.ok:
            return
        predicted = ctx.cycle.get(self._predicted_key)
        if predicted is None:  # not placed by the index (a short prompt), or no engine was picked
            return
        tokens, block = predicted
        found = _CACHED_TOKENS.findall(completion.answer_end or b"")
        mode = "tokens" if self._ids_key in ctx.cycle else "characters"
        self.metrics.observe_prefix_prediction(mode, tokens, int(found[-1]) if found else None, block)

    def describe(self) -> dict[str, Any]:
        """For ``GET /engines``: the block mode and the index's size."""
        index = self.index
        return {
            # Per model: token blocks for token_mode_models, character blocks for every other model.
            "mode": "tokens" if self.tokenizers else "characters",
            "index": "kv_events" if self.kv_events is not None else "routed",
            "token_mode_models": sorted(
                m
                for m, t in self.tokenizers.items()
                if type(t) is not HubTokenizer or t.tokenizer is not None
            ),
            "tokenizers": {
                m: t.describe()
                if type(t) is HubTokenizer
                else {"source": str(t.directory), "state": "loaded"}
                for m, t in self.tokenizers.items()
            },
            "chars_per_token": self.chars_per_token,
            "match_threshold": self.match_threshold,
            "request_tokens": self.request_tokens,
            "slack": self.slack,
            "copy_cost": self.copy_cost,
            "share_window": self.share_window,
            "min_match_tokens": self.min_match_tokens,
            "indexed_blocks": len(index),
            "max_blocks": index.max_blocks,
            "blocks_per_engine": {name: index.blocks_of(name) for name in index.engines()},
            **({"kv_events": self.kv_events.describe()} if self.kv_events is not None else {}),
        }


class RecentShares:
    """How many of the last ``window`` decisions went to each engine (0: no window, no bound).

    The long-run balance the in-flight bound cannot see: at low concurrency a hot prefix's holder is
    always the cheapest engine, so without this bound one engine would take all of that prefix's
    traffic. Past ``(1 + epsilon)`` times its fair share of the window, an engine takes no more
    requests until its share falls, and a hot prefix is copied to another engine.
    """

    __slots__ = ("window", "_recent", "_counts")

    def __init__(self, window: int) -> None:
        self.window = window
        self._recent: collections.deque[str] = collections.deque()
        self._counts: dict[str, int] = {}

    def add(self, engine: str) -> None:
        if self.window <= 0:
            return
        counts = self._counts
        recent = self._recent
        if len(recent) >= self.window:
            old = recent.popleft()
            left = counts[old] - 1
            if left:
                counts[old] = left
            else:
                del counts[old]
        recent.append(engine)
        counts[engine] = counts.get(engine, 0) + 1

    def counts(self, engines: Sequence[Engine]) -> list[int]:
        """Each candidate's count (an engine that left keeps its old entries until they age out)."""
        get = self._counts.get
        return [get(e.name, 0) for e in engines]


def tie_break(engine: str, seed: int) -> int:
    return _xxh3(engine.encode(), seed)


def base_model(engine: Engine) -> str:
    """The engine's base model name (the chain seed of its blocks that no adapter computed)."""
    for card in engine.model_cards:
        if card.get("parent") is None and isinstance(card.get("id"), str):
            return card["id"]
    return min(engine.models) if engine.models else ""
