"""Which engine holds which prompt blocks, as the router last routed them: bounded, evicting, purgeable.

Per engine an LRU of block keys (a plain dict in recency order: a hit moves a key to the end, the
oldest is evicted first), sized to that engine's KV capacity in blocks (``vllm:cache_config_info``),
so the index forgets what the engine has had to evict; and a global cap on all entries, past which
the engine holding the most gives up its oldest. An engine that leaves is dropped whole.

Memory: a dict entry (about 40 bytes; the key's int object, about 32 bytes, is shared by every engine
holding that block), no other structure per block.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice, takewhile
from typing import Any

DEFAULT_ENGINE_BLOCKS = 16_384  # an engine whose KV capacity is not known yet
DEFAULT_MAX_BLOCKS = 1_000_000  # all engines together


def evict_oldest(entries: dict[Any, Any], count: int) -> None:
    """Drop the ``count`` oldest entries of a dict kept in recency order (a dict iterates oldest first)."""
    for key in list(islice(entries, count)):
        del entries[key]


class PrefixIndex:
    """Block keys per engine name, each engine's in recency order."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._by_engine: dict[str, dict[int, None]] = {}
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def engines(self) -> list[str]:
        return list(self._by_engine)

    def blocks_of(self, engine: str) -> int:
        return len(self._by_engine.get(engine, ()))

    def match(self, engine: str, keys: Sequence[int]) -> int:
        """How many leading blocks of ``keys`` the engine holds (a chain: the first miss ends it)."""
        held = self._by_engine.get(engine)
        if not held:
            return 0
        return len(list(takewhile(held.__contains__, keys)))  # the loop in C

    def record(self, engine: str, keys: Sequence[int], capacity: int | None = None) -> None:
        """The engine now holds ``keys`` (it was sent the request): most recent last; evict to bounds."""
        if not keys:
            return
        held = self._by_engine.get(engine)
        if held is None:
            held = self._by_engine[engine] = {}
        before = len(held)
        pop = held.pop
        for key in keys:
            pop(key, None)  # re-inserted: now the most recent
            held[key] = None
        limit = capacity or DEFAULT_ENGINE_BLOCKS
        if len(held) > limit:
            self._evict(held, len(held) - limit)
        self._size += len(held) - before
        while self._size > self.max_blocks:
            largest = max(self._by_engine.values(), key=len)
            excess = min(len(largest), self._size - self.max_blocks)
            self._evict(largest, excess)
            self._size -= excess

    def remove(self, engine: str, keys: Sequence[int]) -> None:
        """The engine evicted ``keys`` (a KV event said so)."""
        held = self._by_engine.get(engine)
        if not held:
            return
        before = len(held)
        for key in keys:
            held.pop(key, None)
        self._size -= before - len(held)

    @staticmethod
    def _evict(held: dict[int, None], count: int) -> None:
        evict_oldest(held, count)

    def forget_engine(self, name: str) -> None:
        """The engine left (or its cache was reset): drop everything it held."""
        held = self._by_engine.pop(name, None)
        if held is not None:
            self._size -= len(held)
