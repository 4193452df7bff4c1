"""The KV-event wire format: msgpack batches of tagged event maps, as vLLM encodes them.

vLLM defined it; SGLang encodes its events the same way on purpose (``sglang/srt/disaggregation/
kv_events.py`` in 0.5.23 says so), with a field or two of its own. So the structs hold the union of
the fields the router reads; msgspec drops the fields a struct does not name. Which field carries what
(the salt, above all) is the kind's to say (:meth:`.base.EngineKind.event_salt`).
"""

from __future__ import annotations

from typing import Any

import msgspec


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    token_ids: list[int]
    block_size: int
    parent_block_hash: bytes | int | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None  # vLLM: the hash's extra keys (the salt among them)
    medium: str | None = None
    cache_salt: str | None = None  # SGLang: the request's cache_salt, a field of its own


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[bytes | int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None  # SGLang calls it attn_dp_rank; same place in the array


batch_decoder = msgspec.msgpack.Decoder(EventBatch)
