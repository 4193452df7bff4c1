"""vLLM's KV-cache events, decoded and applied to a prefix index: the precise mode of prefix routing.

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

Only the engine's primary KV pool counts (``medium`` unset or ``GPU``, which the CPU build reports
too); blocks in offload tiers are not prefix-cache hits of that engine's scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_stack.scheduling.index.blocks import salt_of, token_block_keys
from vllm_stack.scheduling.index.prefix_index import DEFAULT_ENGINE_BLOCKS, PrefixIndex, evict_oldest

PRIMARY_MEDIA = (None, "GPU")


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    token_ids: list[int]
    block_size: int
    parent_block_hash: bytes | int | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


batch_decoder = msgspec.msgpack.Decoder(EventBatch)


def first_block_salt(event: BlockStored, model: str) -> int:
    """The chain seed of a prefix's first block, as the request side computes it
    (:func:`..blocks.salt_of` of model or adapter name and ``cache_salt``).

    vLLM lists, per block, the extra keys of its hash untagged and in order: the adapter's name when
    there is one, multimodal ``(identifier, offset)`` pairs, then ``cache_salt`` (first block only)
    and prompt-embedding digests (bytes). So the first string after the adapter's name is the salt.
    """
    cache_salt = None
    extra = event.extra_keys[0] if event.extra_keys else None
    if extra:
        entries = list(extra)[1:] if event.lora_name is not None else list(extra)
        cache_salt = next((e for e in entries if isinstance(e, str)), None)
    return salt_of(event.lora_name or model, cache_salt)


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

    def apply(self, engine: str, model: str, batch: EventBatch, capacity: int | None) -> int:
        """Apply one batch from ``engine`` (serving base model ``model``); returns the blocks stored."""
        blocks = self._engines.get(engine)
        if blocks is None:
            blocks = self._engines[engine] = EngineBlocks()
        stored = 0
        for event in batch.events:
            if type(event) is BlockStored:
                stored += self._stored(engine, model, blocks, event, capacity)
            elif type(event) is BlockRemoved:
                self._removed(engine, blocks, event)
            else:
                self.forget_engine(engine)
                blocks = self._engines[engine] = EngineBlocks()
        return stored

    def _stored(
        self, engine: str, model: str, blocks: EngineBlocks, event: BlockStored, capacity: int | None
    ) -> int:
        if event.medium not in PRIMARY_MEDIA:
            return 0
        parent = event.parent_block_hash
        if parent is None:
            seed = first_block_salt(event, model)
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
