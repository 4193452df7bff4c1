"""An external OpenAI-compatible API (OpenAI, or any service that speaks its API) as an engine kind.

The router knows nothing of such an engine's load: it publishes no ``/metrics`` the router reads and
no KV events (empty paths: the scraper and the KV-event feed leave it alone), and its ``/v1/models``
is only its health probe: the models it serves are the ones the external providers file names
(``fixed_models``), never the provider's whole catalogue. It loads no LoRA adapters and takes no part
in disaggregated serving (the router refuses neither, since nothing routes such requests to it).
"""

from __future__ import annotations

from typing import Any

from vllm_stack.engines.kinds.base import AdapterApi, EngineKind, EventSource, HandOver
from vllm_stack.engines.kinds.events import BlockStored
from vllm_stack.engines.load import EngineTelemetry


class OpenAiKind(EngineKind):
    """A provider answering OpenAI's API; see the module docstring."""

    name = "openai"
    metrics_path = ""  # nothing to scrape
    kv_sources_path = ""  # no KV events
    fixed_models = True
    adapters = AdapterApi(load_path="", unload_path="", already_loaded=b"")
    handover = HandOver("sequential")

    def parse_metrics(self, text: str, now: float | None = None) -> EngineTelemetry:
        raise ValueError("an external provider publishes no metrics")

    def kv_sources(self, doc: Any, engine_url: str) -> list[EventSource]:  # noqa: ANN401 - JSON
        return []

    def event_salt(self, event: BlockStored) -> str | None:
        return None


KIND = OpenAiKind()
