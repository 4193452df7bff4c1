"""Picker: send a request where its prompt's leading blocks were sent before, within a load bound.

The prompt is cut into blocks aligned with the engines' KV blocks (character mode: ``chars_per_token``
x the engine's ``block_size`` bytes of the raw prompt JSON; see :mod:`..index.blocks`) and keyed by a
chain of hashes that starts from the model (or adapter) name and ``cache_salt``. The router's index
(:class:`~..index.prefix_index.PrefixIndex`, in the plugin state, so it survives reloads) remembers
which engine was sent which blocks, bounded per engine by that engine's KV capacity.

Load guard (bounded loads, as the consistent-hash picker): only engines whose load (router in-flight
plus engine queue, :mod:`vllm_stack.engines.load`) is below ``ceil((1 + epsilon) * (total + 1) / n)``
may take the request, so a popular prefix never piles onto one engine; among them the longest match
wins, ties go to the less loaded, when it covers at least ``match_threshold`` of the prompt's blocks.
Below that (a new conversation that shares only, say, a system prompt) the request is treated as a
new prefix: it goes to the least loaded engine, and among equally loaded ones to the one holding the
fewest blocks, so what is new spreads over the engines' caches and a short shared prefix ends up
cached on several engines instead of pulling every conversation onto one.
A prompt shorter than one block (which no engine caches) is placed by bounded-load consistent hashing
of its first bytes, so equal short prompts still meet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from vllm_stack.config import ConfigError
from vllm_stack.engines.engine import Engine
from vllm_stack.engines.load import engine_loads
from vllm_stack.scheduling.framework import RequestContext
from vllm_stack.scheduling.index.blocks import char_block_keys, salt_of
from vllm_stack.scheduling.index.prefix_index import DEFAULT_MAX_BLOCKS, PrefixIndex
from vllm_stack.scheduling.plugins.consistent_hash_picker import ConsistentHashPicker, prefix_key
from vllm_stack.scheduling.registry import Parameters, PluginContext

DEFAULT_BLOCK_TOKENS = 128  # vLLM's CPU block size; engines report theirs in vllm:cache_config_info


class PrefixCachePicker:
    type_name = "prefix-cache-picker"
    mode = "characters"  # how prompts are cut into blocks (a tokenizer mode comes with the tokenizer)

    def __init__(
        self,
        name: str,
        index: PrefixIndex,
        epsilon: float = 0.25,
        chars_per_token: float = 4.0,
        match_threshold: float = 0.5,
    ) -> None:
        self.name = name
        self.index = index
        self.epsilon = epsilon
        self.chars_per_token = chars_per_token
        self.match_threshold = match_threshold
        self._turn = 0
        self._short = ConsistentHashPicker("prefix", prefix_key, epsilon)

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> PrefixCachePicker:
        epsilon = parameters.number("epsilon", 0.25)
        if epsilon <= 0:
            raise ConfigError(f"plugin {name!r}: epsilon must be > 0")
        chars = parameters.number("chars_per_token", 4.0, minimum=0.5)
        threshold = parameters.number("match_threshold", 0.5, minimum=0.0)
        max_blocks = int(parameters.number("max_blocks", DEFAULT_MAX_BLOCKS, minimum=1))
        index = context.state.get((cls.type_name, name), lambda: PrefixIndex(max_blocks))
        index.max_blocks = max_blocks
        return cls(name, index, epsilon, chars, threshold)

    def _keys(self, ctx: RequestContext, block_tokens: int) -> list[int]:
        cache = ctx.cycle.get(self.name)
        if cache is None:
            cache = ctx.cycle[self.name] = {}
        keys = cache.get(block_tokens)
        if keys is None:
            prompt = ctx.prompt
            block_chars = max(1, int(block_tokens * self.chars_per_token))
            keys = cache[block_tokens] = (
                char_block_keys(prompt, block_chars, salt_of(ctx.model, ctx.cache_salt)) if prompt else []
            )
        return keys

    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]:
        if not self._keys(ctx, engines[0].kv_block_size or DEFAULT_BLOCK_TOKENS):
            return self._short.pick(ctx, engines, scores)
        loads = engine_loads(engines)
        n = len(engines)
        cap = math.ceil((1.0 + self.epsilon) * (sum(loads) + 1) / n)
        index = self.index
        self._turn = (self._turn + 1) % (1 << 30)
        matches = []
        for e in engines:
            keys = self._keys(ctx, e.kv_block_size or DEFAULT_BLOCK_TOKENS)
            matches.append(index.match(e.name, keys) / len(keys) if keys else 0.0)
        best_anywhere = max(matches)
        use_match = best_anywhere >= self.match_threshold and best_anywhere > 0
        best: tuple[float, float, int, int] | None = None
        chosen = 0
        for i, e in enumerate(engines):
            if loads[i] >= cap and n > 1:
                continue
            match = matches[i] if use_match else 0.0
            rank = (-match, loads[i], index.blocks_of(e.name), (i + self._turn) % n)
            if best is None or rank < best:
                best, chosen = rank, i
        engine = engines[chosen]
        keys = self._keys(ctx, engine.kv_block_size or DEFAULT_BLOCK_TOKENS)
        index.record(engine.name, keys, engine.kv_blocks)
        match = matches[chosen]
        if use_match and match < best_anywhere:
            return engine, "prefix_overflow"  # the engine holding more was over the load bound
        if match == 0:
            return engine, "prefix_miss"
        if not use_match:
            return engine, "prefix_spread"  # a short shared part only: placed as a new prefix
        return engine, "prefix_hit" if match == 1.0 else "prefix_partial"

    def describe(self) -> dict[str, Any]:
        """For ``GET /engines``: the block mode and the index's size."""
        index = self.index
        return {
            "mode": self.mode,
            "chars_per_token": self.chars_per_token,
            "match_threshold": self.match_threshold,
            "indexed_blocks": len(index),
            "max_blocks": index.max_blocks,
            "blocks_per_engine": {name: index.blocks_of(name) for name in index.engines()},
        }
