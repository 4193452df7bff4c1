"""vLLM's kind (vLLM 0.32): the series of its ``/metrics``, ``GET /kv_event_sources``, the salt inside
a block's extra keys, ``/v1/load_lora_adapter``, ``kv_transfer_params`` and lower-is-first priority."""

from __future__ import annotations

import re
import time
from typing import Any

from vllm_stack.engines.kinds.base import AdapterApi, EngineKind, EventSource, HandOver, reachable, url_host
from vllm_stack.engines.kinds.events import BlockStored
from vllm_stack.engines.load import EngineTelemetry

_WANTED = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:prefix_cache_queries_total": "pq",
    "vllm:prefix_cache_hits_total": "ph",
}
_CACHE_CONFIG = "vllm:cache_config_info{"
_LABEL = re.compile(r'(block_size|num_gpu_blocks)="(\d+)"')
# vLLM sets this gauge to the current time under a new label set whenever the running or waiting
# adapters change, and the old label sets stay in the exposition: the latest (largest value) is now.
_LORA_INFO = "vllm:lora_requests_info{"
# vLLM's sleep gauge, one series per state: awake 1 or 0, weights_offloaded (level 1), discard_all (level 2).
_SLEEP_STATE = "vllm:engine_sleep_state{"
_SLEEP_LEVELS = {'sleep_state="weights_offloaded"': 1, 'sleep_state="discard_all"': 2}
_LORA_LABEL = re.compile(r'(max_lora|running_lora_adapters|waiting_lora_adapters)="([^"]*)"')

#: The prefill request's hand-over request in vLLM's protocol (its toy proxy's and NixlConnector's).
_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def _adapter_set(value: str) -> frozenset[str]:
    return frozenset(name for name in value.split(",") if name)


def parse_metrics(text: str, now: float | None = None) -> EngineTelemetry:
    """Sum the wanted series over their labels (only the few routing needs are parsed, a line-prefix
    test before any split). Raises ``ValueError`` when the load series are absent."""
    sums: dict[str, float] = {}
    geometry: dict[str, int] = {}
    lora: dict[str, str] | None = None
    lora_at = float("-inf")
    awake: bool | None = None
    sleep_level = 0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        if line.startswith(_SLEEP_STATE):
            try:
                on = float(line.rsplit("}", 1)[1].split()[0]) > 0
            except (IndexError, ValueError):
                continue
            if 'sleep_state="awake"' in line:
                awake = on if awake is None else awake and on  # data-parallel ranks: awake when all are
            elif on:
                sleep_level = max(sleep_level, next((v for k, v in _SLEEP_LEVELS.items() if k in line), 1))
            continue
        if line.startswith(_CACHE_CONFIG):
            geometry.update((k, int(v)) for k, v in _LABEL.findall(line))
            continue
        if line.startswith(_LORA_INFO):
            try:
                at = float(line.rsplit("}", 1)[1].split()[0])
            except (IndexError, ValueError):
                continue
            if at > lora_at:
                lora_at, lora = at, dict(_LORA_LABEL.findall(line))
            continue
        name_end = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if i != -1 and i < name_end:
                name_end = i
        key = _WANTED.get(line[:name_end])
        if key is None:
            continue
        try:
            value = (
                float(line.rsplit(" ", 1)[1]) if "}" not in line else float(line.rsplit("}", 1)[1].split()[0])
            )
        except (IndexError, ValueError):
            continue
        sums[key] = sums.get(key, 0.0) + value
    if "running" not in sums or "waiting" not in sums:
        raise ValueError("engine /metrics lacks vllm:num_requests_running / vllm:num_requests_waiting")
    max_loras: int | None = None
    if lora is not None and lora.get("max_lora", "").isdigit():
        max_loras = int(lora["max_lora"])
    return EngineTelemetry(
        running=sums["running"],
        waiting=sums["waiting"],
        kv_cache_usage=sums.get("kv"),
        prefix_cache_queries=sums.get("pq"),
        prefix_cache_hits=sums.get("ph"),
        scraped_at=time.monotonic() if now is None else now,
        block_size=geometry.get("block_size"),
        num_blocks=geometry.get("num_gpu_blocks"),
        max_loras=max_loras,
        running_adapters=None if lora is None else _adapter_set(lora.get("running_lora_adapters", "")),
        waiting_adapters=None if lora is None else _adapter_set(lora.get("waiting_lora_adapters", "")),
        sleep_level=None if awake is None else 0 if awake else max(sleep_level, 1),
    )


def sources_from_engine(doc: Any, engine_url: str) -> list[EventSource]:  # noqa: ANN401 - JSON
    """The ZMQ sources in an engine's ``GET /kv_event_sources`` answer (one per data-parallel rank),
    with a wildcard host replaced by the engine's own."""
    host = url_host(engine_url)
    found = []
    for config in (doc or {}).values() if isinstance(doc, dict) else ():
        if not isinstance(config, dict) or not config.get("enable_kv_cache_events"):
            continue
        if config.get("publisher", "zmq") != "zmq" or not isinstance(config.get("endpoint"), str):
            continue
        replay = config.get("replay_endpoint")
        found.append(
            EventSource(reachable(config["endpoint"], host), reachable(replay, host) if replay else None)
        )
    return found


class VllmKind(EngineKind):
    """vLLM: see the module docstring; every value here is what the router assumed before kinds."""

    name = "vllm"
    kv_sources_path = "/kv_event_sources"
    metric_names = {
        **_WANTED,
        "vllm:cache_config_info{block_size,num_gpu_blocks}": "block_size, num_blocks",
        "vllm:lora_requests_info{max_lora,running_lora_adapters,waiting_lora_adapters}": "LoRA slots, adapters",
        "vllm:engine_sleep_state{sleep_state}": "asleep or awake, and the sleep level",
    }
    default_block_tokens = 128  # vLLM's CPU block size; engines report theirs in vllm:cache_config_info
    priority_sign = -1  # vLLM schedules lower values first (--scheduling-policy priority)
    adapters = AdapterApi(
        load_path="/v1/load_lora_adapter",
        unload_path="/v1/unload_lora_adapter",
        already_loaded=b"has already been loaded",  # "The lora adapter '{name}' has already been loaded."
        already_loaded_status=400,
        unknown_status=404,  # "The lora adapter '{name}' cannot be found."
    )
    handover = HandOver("sequential", _PREFILL_PARAMS)

    def parse_metrics(self, text: str, now: float | None = None) -> EngineTelemetry:
        return parse_metrics(text, now)

    def kv_sources(self, doc: Any, engine_url: str) -> list[EventSource]:  # noqa: ANN401 - JSON
        return sources_from_engine(doc, engine_url)

    def event_salt(self, event: BlockStored) -> str | None:
        """vLLM lists, per block, the extra keys of its hash untagged and in order: the adapter's name
        when there is one, multimodal ``(identifier, offset)`` pairs, then ``cache_salt`` (first block
        only) and prompt-embedding digests (bytes). So the first string after the adapter's name."""
        extra = event.extra_keys[0] if event.extra_keys else None
        if not extra:
            return None
        entries = list(extra)[1:] if event.lora_name is not None else list(extra)
        return next((e for e in entries if isinstance(e, str)), None)


KIND = VllmKind()
