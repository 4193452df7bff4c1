"""SGLang's kind, from the released ``sglang==0.5.23`` wheel's own source (paths inside the wheel).

- **Metrics** (``srt/observability/metrics_collector.py``, with ``--enable-metrics``, on the API port):
  ``sglang:num_running_reqs`` / ``sglang:num_queue_reqs`` (requests running / waiting),
  ``sglang:token_usage`` (KV pool usage 0..1), ``sglang:prefill_effective_tokens_total{mode}``
  (prompt tokens by where they came from: ``input`` computed, ``device_hit`` / ``host_hit`` /
  ``storage_hit`` cached; queries = all modes, hits of the engine's own cache = ``device_hit``),
  ``sglang:page_size`` and ``sglang:num_pages`` (tokens per KV block, blocks;
  ``sglang:max_total_num_tokens`` / page size when the page count is absent),
  ``sglang:lora_pool_slots_total`` (adapter slots, ``--max-loras-per-batch``; SGLang names no
  adapters running or waiting). **Pitfall:** with ``--enable-priority-scheduling`` the queue and
  running gauges carry the total under ``priority=""`` *and* one series per priority value
  (``_log_gauge_queue_count``): only series without a priority value are read, or they would count
  twice. The gauges are refreshed per prefill batch and every ``--decode-log-interval`` (40) decode
  steps, so coarser than vLLM's. ``--enable-metrics-for-all-schedulers`` would repeat them per
  attention-TP rank: leave it off.
- **KV events** (``srt/disaggregation/kv_events.py``): vLLM's framing and encoding on purpose, the
  salt in a ``cache_salt`` field of its own, ``medium`` ``GPU`` for the device pool. Where they are:
  ``GET /server_info``'s ``kv_events`` block (``srt/runtime_context.py``,
  ``describe_kv_events_publisher``): one publisher per data-parallel rank at
  ``endpoint_port_base + rank`` (replay: ``replay_endpoint_port_base + rank``), a wildcard host
  meaning the engine's own.
- **Adapters** (``srt/entrypoints/http_server.py``, ``srt/managers/io_struct.py``): ``POST
  /load_lora_adapter`` / ``/unload_lora_adapter`` (no ``/v1/``), 200 on success and 400 on any
  failure; "Failed to load LoRA adapter {name} because it is already loaded"
  (``srt/lora/lora_manager.py``), "LoRA with name {name} does not exist" (``srt/lora/lora_registry.py``).
  Not handled here: SGLang serves an adapter to a request whose ``model`` is ``base:adapter`` (or that
  has ``lora_path``), not one that names the adapter alone as vLLM does.
- **Disaggregation** (``srt/entrypoints/openai/protocol.py`` ``PDRoutingFields``): the same body with
  ``bootstrap_host``, ``bootstrap_port`` (the prefill engine's, default 8998) and ``bootstrap_room``
  (a random 63-bit integer) goes to the prefill and the decode engine at once. Declared as data; the
  router's director implements only the sequential hand-over, so not usable yet.
- **Priority** (``srt/arg_groups/fields/schedule.py``): higher values first by default
  (``--enable-priority-scheduling`` without ``--schedule-low-priority-values-first``), the router's
  own sense, so sent as is.
"""

from __future__ import annotations

import re
import time
from typing import Any

from vllm_stack.engines.kinds.base import AdapterApi, EngineKind, EventSource, HandOver, url_host
from vllm_stack.engines.kinds.events import BlockStored
from vllm_stack.engines.load import EngineTelemetry

_SERIES = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv",
    "sglang:page_size": "page",
    "sglang:num_pages": "pages",
    "sglang:max_total_num_tokens": "tokens",
    "sglang:lora_pool_slots_total": "loras",
}
_EFFECTIVE = "sglang:prefill_effective_tokens_total"
_HIT_MODE = "device_hit"
# Per data-parallel rank, one series each: counts add up; a ratio or a size is the largest rank's.
_LARGEST = frozenset({"kv", "page", "loras"})
_PRIORITY = re.compile(r'[{,]priority="([^"]*)"')
_MODE = re.compile(r'[{,]mode="([^"]*)"')
_WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})


def parse_metrics(text: str, now: float | None = None) -> EngineTelemetry:
    """The load figures in SGLang's ``/metrics``; ``ValueError`` when the queue gauges are absent."""
    values: dict[str, float] = {}
    queries = hits = None
    for line in text.splitlines():
        if not line.startswith("sglang:"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if brace != -1 and (space == -1 or brace < space) else space
        name = line[:end]
        key = _SERIES.get(name)
        if key is None and name != _EFFECTIVE:
            continue
        if brace == end and brace != -1:
            labels_end = line.rfind("}")
            labels, rest = line[brace : labels_end + 1], line[labels_end + 1 :]
        else:
            labels, rest = "", line[end:]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        priority = _PRIORITY.search(labels)
        if priority is not None and priority.group(1):
            continue  # a per-priority breakdown of the total under priority=""
        if key is None:
            mode = _MODE.search(labels)
            queries = (queries or 0.0) + value
            if mode is not None and mode.group(1) == _HIT_MODE:
                hits = (hits or 0.0) + value
            continue
        if key in _LARGEST:
            values[key] = max(values.get(key, value), value)
        else:
            values[key] = values.get(key, 0.0) + value
    if "running" not in values or "waiting" not in values:
        raise ValueError("engine /metrics lacks sglang:num_running_reqs / sglang:num_queue_reqs")
    page = int(values["page"]) if values.get("page", 0) >= 1 else None
    blocks = int(values["pages"]) if values.get("pages", 0) >= 1 else None
    if blocks is None and page is not None and values.get("tokens", 0) >= 1:
        blocks = int(values["tokens"]) // page
    loras = int(values["loras"]) if "loras" in values else None
    return EngineTelemetry(
        running=values["running"],
        waiting=values["waiting"],
        kv_cache_usage=values.get("kv"),
        prefix_cache_queries=queries,
        prefix_cache_hits=(hits or 0.0) if queries is not None else None,
        scraped_at=time.monotonic() if now is None else now,
        block_size=page,
        num_blocks=blocks,
        max_loras=loras,
    )


def kv_sources(doc: Any, engine_url: str) -> list[EventSource]:  # noqa: ANN401 - JSON
    """The ZMQ publishers in ``GET /server_info``'s ``kv_events`` block, one per data-parallel rank."""
    info = doc.get("kv_events") if isinstance(doc, dict) else None
    if not isinstance(info, dict) or info.get("publisher", "zmq") != "zmq":
        return []
    base, replay = info.get("endpoint_port_base"), info.get("replay_endpoint_port_base")
    if not isinstance(base, int) or isinstance(base, bool):
        return []
    host = info.get("endpoint_host")
    host = url_host(engine_url) if not isinstance(host, str) or host in _WILDCARDS else host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    ranks = info.get("dp_size")
    ranks = ranks if isinstance(ranks, int) and ranks > 0 else 1
    has_replay = isinstance(replay, int) and not isinstance(replay, bool)
    return [
        EventSource(f"tcp://{host}:{base + r}", f"tcp://{host}:{replay + r}" if has_replay else None)
        for r in range(ranks)
    ]


class SglangKind(EngineKind):
    """SGLang 0.5.23: see the module docstring."""

    name = "sglang"
    kv_sources_path = "/server_info"
    metric_names = {
        **_SERIES,
        _EFFECTIVE + "{mode}": "prefix cache queries (all modes), hits (device_hit)",
    }
    default_block_tokens = 1  # SGLang's default --page-size; engines report theirs in sglang:page_size
    priority_sign = 1
    adapters = AdapterApi(
        load_path="/load_lora_adapter",
        unload_path="/unload_lora_adapter",
        already_loaded=b"because it is already loaded",
        already_loaded_status=400,
        unknown_status=400,
        unknown=b"does not exist",
        by_name=False,  # it serves an adapter as model "base:adapter" (or with lora_path), not by its name
    )
    handover = HandOver(
        "concurrent",
        bootstrap_fields=("bootstrap_host", "bootstrap_port", "bootstrap_room"),
        bootstrap_port=8998,
    )

    def parse_metrics(self, text: str, now: float | None = None) -> EngineTelemetry:
        return parse_metrics(text, now)

    def kv_sources(self, doc: Any, engine_url: str) -> list[EventSource]:  # noqa: ANN401 - JSON
        return kv_sources(doc, engine_url)

    def event_salt(self, event: BlockStored) -> str | None:
        return event.cache_salt


KIND = SglangKind()
