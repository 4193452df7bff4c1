"""The interface of an engine kind (:class:`EngineKind`) and the small records it is made of.

A kind is data plus four functions of its wire formats: the metrics parser, the KV-source reader, the
KV-event decoder and the salt rule. Everything is fixed per kind, so an engine resolves its kind once
when it joins and the request path reads plain attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from vllm_stack.engines.kinds.events import BlockStored, EventBatch, batch_decoder
from vllm_stack.engines.load import EngineTelemetry


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where one publisher of an engine's KV events is (one per data-parallel rank)."""

    endpoint: str
    replay: str | None = None


@dataclass(frozen=True, slots=True)
class AdapterApi:
    """An engine's LoRA adapter API: its paths and what its answers mean.

    ``load_ok``: the load succeeded, or the engine has the adapter already (a hot adapter, an earlier
    load): ``already_loaded`` in an answer of status ``already_loaded_status``. ``unload_ok``: it is
    gone, also when the engine did not have it (``unknown_status``, with ``unknown`` in the answer
    when that status means other failures too). ``by_name``: a request naming the adapter as its
    ``model`` is served with it (vLLM); False where the engine wants another name (SGLang:
    ``base:adapter``), which the router does not write yet, so such adapters are refused at start.
    """

    load_path: str
    unload_path: str
    already_loaded: bytes
    already_loaded_status: int = 400
    unknown_status: int = 404
    unknown: bytes = b""
    by_name: bool = True

    def load_ok(self, status: int, body: bytes) -> bool:
        return status == 200 or (status == self.already_loaded_status and self.already_loaded in body)

    def unload_ok(self, status: int, body: bytes) -> bool:
        return status == 200 or (status == self.unknown_status and self.unknown in body)


@dataclass(frozen=True, slots=True)
class HandOver:
    """How a prefill engine hands a prompt's KV to a decode engine (disaggregated serving).

    ``sequential``: the prefill leg first, with ``prefill_params`` as its ``kv_transfer_params``, then
    the decode leg with the prefill answer's ``kv_transfer_params`` (vLLM's KV connectors).
    ``concurrent``: the same body, with ``bootstrap_fields`` naming the prefill engine and the
    transfer, sent to both engines at once; the client gets the decode answer (SGLang).
    """

    mode: str  # sequential | concurrent
    prefill_params: Mapping[str, Any] = field(default_factory=dict)
    bootstrap_fields: tuple[str, ...] = ()
    bootstrap_port: int | None = None  # the prefill engine's default bootstrap port

    def prefill_request_params(self) -> dict[str, Any]:
        """A fresh copy of ``prefill_params`` (the caller may change it)."""
        return dict(self.prefill_params)


def reachable(endpoint: str, host: str) -> str:
    """``endpoint`` with a wildcard host (a bind address such as ``tcp://*:5557``) replaced by ``host``."""
    for wildcard in ("*", "0.0.0.0", "[::]"):
        endpoint = endpoint.replace(f"//{wildcard}:", f"//{host}:")
    return endpoint


def url_host(engine_url: str) -> str:
    """The engine URL's host as it goes into a ``tcp://`` address (IPv6 in brackets)."""
    host = urlsplit(engine_url).hostname or "127.0.0.1"
    return f"[{host}]" if ":" in host else host


class EngineKind:
    """One engine implementation as the router sees it. Subclasses set the attributes and implement
    the parser, the KV-source reader and the salt rule; instances are immutable after construction.

    ``metric_names`` documents the ``/metrics`` series the parser reads: name -> what it fills in
    :class:`~vllm_stack.engines.load.EngineTelemetry`. ``priority_sign``: the engine's ``priority``
    value is ``priority_sign`` times the router's (higher = more important, the Inference Extension's
    sense), so -1 for an engine that schedules lower values first. ``fixed_models``: the engine serves
    the names it was given (an external provider's configured models), not what its ``/v1/models``
    lists, which is then only its health probe.
    """

    name: str = ""
    models_path: str = "/v1/models"  # also the health probe
    metrics_path: str = "/metrics"
    kv_sources_path: str = ""
    metric_names: Mapping[str, str] = {}
    default_block_tokens: int = 16  # tokens per KV block until the engine reports its own
    priority_sign: int = -1
    fixed_models: bool = False
    adapters: AdapterApi
    handover: HandOver

    def parse_metrics(self, text: str, now: float | None = None) -> EngineTelemetry:
        """The load figures in a ``/metrics`` text; ``ValueError`` when the load series are absent."""
        raise NotImplementedError

    def kv_sources(self, doc: Any, engine_url: str) -> list[EventSource]:  # noqa: ANN401 - JSON
        """The KV-event publishers named in the answer of ``kv_sources_path`` (wildcards resolved)."""
        raise NotImplementedError

    def decode_events(self, payload: memoryview | bytes) -> EventBatch:
        """One KV-event batch (``msgspec.DecodeError`` when it is not one)."""
        return batch_decoder.decode(payload)

    def event_salt(self, event: BlockStored) -> str | None:
        """The ``cache_salt`` a stored prefix's first block was hashed with, or None."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<engine kind {self.name}>"
