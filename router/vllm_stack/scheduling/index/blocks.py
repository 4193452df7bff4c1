"""Block keys of a prompt: chained 64-bit hashes, one per whole block, so a key names a prefix.

Key ``i`` hashes block ``i`` seeded with key ``i - 1`` (the first seeded with the request's salt: model
or adapter name and ``cache_salt``), so equal keys mean equal prefixes up to that block, as vLLM's
own block hashes do. Only whole blocks get a key: an engine caches whole blocks only.

Character mode (no tokenizer): blocks of ``block_chars`` bytes of the raw prompt JSON (messages,
prompt or input as the client sent them), an approximation of the engine's token blocks; a client
that sends the same conversation prefix sends the same bytes. xxh3 is used for speed and because it
is the same in every process (router replicas agree; Python's ``hash`` is salted per process).

Token mode: whole blocks of the engine's token ids (4-byte little-endian each), the same chain.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

_xxh3 = xxhash.xxh3_64_intdigest


def salt_of(*parts: str | None) -> int:
    """The seed of a request's first block: what else must match for a cached prefix to be reusable."""
    return _xxh3("\0".join(p or "" for p in parts).encode())


def char_block_keys(data: bytes | memoryview, block_chars: int, salt: int, limit: int = 1 << 16) -> list[int]:
    """Keys of the whole ``block_chars``-byte blocks of ``data`` (at most ``limit`` of them)."""
    view = memoryview(data)
    return _chain(view, block_chars, min(len(view) // block_chars, limit), salt)


def token_block_keys(ids: Sequence[int], block_size: int, salt: int, limit: int = 1 << 16) -> list[int]:
    """Chained keys of the whole ``block_size``-token blocks of ``ids`` (at most ``limit``): the
    token-mode keys, from the router's own tokenization or from an engine's KV events alike."""
    whole = min(len(ids) // block_size, limit)
    if whole <= 0:
        return []
    if isinstance(ids, array) and ids.typecode == "I":  # the router's own tokens: no copy
        view = memoryview(ids).cast("B")
    else:
        view = memoryview(array("I", ids[: whole * block_size]).tobytes())
    return _chain(view, 4 * block_size, whole, salt)


def _chain(view: memoryview, step: int, count: int, salt: int) -> list[int]:
    """The chain over ``count`` blocks of ``step`` bytes (one comprehension: the loop is the cost)."""
    hash_ = _xxh3
    key = salt
    return [key := hash_(view[i : i + step], key) for i in range(0, count * step, step)]
