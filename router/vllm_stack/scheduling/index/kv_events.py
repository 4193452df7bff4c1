"""Engines' KV-cache events (vLLM's format, which SGLang shares), decoded and applied to a prefix index: the precise mode of prefix routing.

An engine publishes, for every block it caches or evicts, a ``BlockStored`` (its own block hashes,
the parent's hash, the blocks' token ids, the LoRA adapter's name) or a ``BlockRemoved`` (hashes
only), and ``AllBlocksCleared`` when its prefix cache is reset. The router keys blocks itself, from
the events' token ids, with the same chained function it applies to a request's tokens
(:func:`..blocks.token_block_keys`), so nothing depends on vLLM's hash algorithm or seed, and engines
that number adapters differently still agree (the adapter's *name* seeds the chain).

Removals name only the engine's hashes, so each engine has a map from its hashes to the router's
keys, bounded like the index (the oldest entries go first). Blocks whose parent the router never saw
(it subscribed late, or missed a batch) cannot be keyed: a chain needs its parent. They are counted
and skipped; the feed recovers such gaps (:mod:`.feed`).

Only the engine's primary KV pool counts (``medium`` unset or ``GPU``, which vLLM's CPU build and
SGLang's device pool report too; their offload tiers are ``CPU``/``STORAGE`` and ``CPU_PINNED``/``DISK``); blocks in offload tiers are not prefix-cache hits of that engine's scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_stack.engines.kinds.base import EngineKind
from vllm_stack.engines.kinds.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    batch_decoder,
)
from vllm_stack.engines.kinds.vllm import KIND as VLLM
from vllm_stack.scheduling.index.blocks import salt_of, token_block_keys
from vllm_stack.scheduling.index.prefix_index import DEFAULT_ENGINE_BLOCKS, PrefixIndex, evict_oldest

PRIMARY_MEDIA = (None, "GPU")


def first_block_salt(event: BlockStored, model: str, kind: EngineKind = VLLM) -> int:
    """The chain seed of a prefix's first block, as the request side computes it
    (:func:`..blocks.salt_of` of model or adapter name and ``cache_salt``, which the engine's kind finds
    in the event: vLLM among the block's extra keys, SGLang in a field of its own)."""
    return salt_of(event.lora_name or model, kind.event_salt(event))


@dataclass
class EngineBlocks:
    """One engine's map from its block hashes to the router's keys, oldest first."""

    keys: dict[bytes | int, int] = field(default_factory=dict)
    orphans: int = 0  # blocks skipped because their parent was unknown
    stored: int = 0
    removed: int = 0


class KvEventIndexer:
    """Applies engines' event batches to a :class:`PrefixIndex` (the same one requests are matched on)."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._engines: dict[str, EngineBlocks] = {}

    def follows(self, engine: str) -> bool:
        """Whether the engine's events have come (since it joined, was cleared or lost events): its
        index entry is then what the engine said it caches (plus the router's own recent sends)."""
        return engine in self._engines

    def apply(
        self, engine: str, model: str, batch: EventBatch, capacity: int | None, kind: EngineKind = VLLM
    ) -> int:
        """Apply one batch from ``engine`` (serving base model ``model``, of ``kind``); returns the
        blocks stored."""
        blocks = self._engines.get(engine)
        if blocks is None:
            blocks = self._engines[engine] = EngineBlocks()
        stored = 0
        for event in batch.events:
            if type(event) is BlockStored:
                stored += self._stored(engine, model, blocks, event, capacity, kind)
            elif type(event) is BlockRemoved:
                self._removed(engine, blocks, event)
            else:
                self.forget_engine(engine)
                blocks = self._engines[engine] = EngineBlocks()
        return stored

    def _stored(
        self,
        engine: str,
        model: str,
        blocks: EngineBlocks,
        event: BlockStored,
        capacity: int | None,
        kind: EngineKind,
    ) -> int:
        if event.medium not in PRIMARY_MEDIA:
            return 0
        parent = event.parent_block_hash
        if parent is None:
            seed = first_block_salt(event, model, kind)
        else:
            seed = blocks.keys.get(parent)
            if seed is None:
                blocks.orphans += len(event.block_hashes)
                return 0
        keys = token_block_keys(event.token_ids, event.block_size, seed, len(event.block_hashes))
        mapping = blocks.keys
        for engine_hash, key in zip(event.block_hashes, keys, strict=False):
            mapping.pop(engine_hash, None)  # re-inserted: now the most recent
            mapping[engine_hash] = key
        self.index.record(engine, keys, capacity)
        limit = max(capacity or DEFAULT_ENGINE_BLOCKS, len(keys))
        if len(mapping) > limit:
            evict_oldest(mapping, len(mapping) - limit)
        blocks.stored += len(keys)
        return len(keys)

    def _removed(self, engine: str, blocks: EngineBlocks, event: BlockRemoved) -> None:
        if event.medium not in PRIMARY_MEDIA:
            return
        mapping = blocks.keys
        gone = [k for k in (mapping.pop(h, None) for h in event.block_hashes) if k is not None]
        self.index.remove(engine, gone)
        blocks.removed += len(gone)

    def forget_engine(self, engine: str) -> None:
        """The engine left, cleared its cache, or its stream lost events that cannot be replayed."""
        self._engines.pop(engine, None)
        self.index.forget_engine(engine)

    def describe(self) -> dict[str, Any]:
        return {
            name: {"mapped": len(b.keys), "stored": b.stored, "removed": b.removed, "orphans": b.orphans}
            for name, b in self._engines.items()
        }


__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KvEventIndexer",
    "batch_decoder",
    "first_block_salt",
]
