"""The router's view of one engine: where it is, what it serves, whether it is usable, how loaded.

Its scraped load figures (:class:`~vllm_stack.engines.load.EngineTelemetry`) and the rules that read them
live in :mod:`vllm_stack.engines.load`, the module below this one.
"""

from __future__ import annotations

import uuid
from typing import Any

from vllm_stack.config import ENGINE_ROLES
from vllm_stack.engines import load
from vllm_stack.engines.circuit import CircuitBreaker
from vllm_stack.engines.kinds.base import EngineKind
from vllm_stack.engines.kinds.vllm import KIND as VLLM
from vllm_stack.engines.load import EngineTelemetry

#: An engine's part in disaggregated serving: ``both`` serves whole requests (the default); a
#: ``prefill`` engine only computes prompts' KV for ``decode`` engines, which generate from it.
#: Defined once, with the settings that name them (config is the layer below).
ROLES = ENGINE_ROLES
ROLE_BOTH, ROLE_PREFILL, ROLE_DECODE = ROLES


class Engine:
    """Mutable state of one engine; owned by the :class:`~vllm_stack.engines.registry.EngineRegistry`.

    ``in_flight`` is the router's own count of requests it sent there and has not finished; it is
    exact and instant, while the scraped queue length lags by up to one scrape interval.
    ``prefill_tokens`` is the router's estimate of the prompt tokens those requests still have to
    prefill there (what a picker that estimates it, the prefix-cache picker, booked; 0 otherwise):
    booked when the request is sent, released at its first streamed token or its end.
    """

    __slots__ = (
        "name",
        "url",
        "ready",
        "healthy",
        "ever_healthy",
        "ejected_reason",
        "models",
        "model_cards",
        "static_models",
        "failures",
        "successes",
        "breaker",
        "in_flight",
        "prefill_tokens",
        "telemetry",
        "stale_after",
        "last_check",
        "last_error",
        "silent_scrapes",
        "completions",
        "kv_block_size",
        "kv_blocks",
        "kv_events_endpoint",
        "kv_replay_endpoint",
        "max_loras",
        "running_slots",
        "models_changed",
        "role",
        "kind",
        "engine_id",
        "sleeping",
        "sleep_level",
        "head_lines",
        "owner",
    )

    def __init__(
        self,
        name: str,
        url: str,
        breaker: CircuitBreaker,
        static_models: tuple[str, ...] = (),
        stale_after: float = 3.0,
        role: str = ROLE_BOTH,
        kind: EngineKind = VLLM,
    ) -> None:
        self.name = name
        self.role = role
        # What it is (vLLM, SGLang, ...): its paths, metrics, events and APIs. Fixed while it runs.
        self.kind = kind
        # Header lines every proxied request to it carries (an external provider's key); never shown.
        self.head_lines = b""
        self.owner = "vllm"  # its /v1/models cards' owned_by for the names it was given
        self.url = url
        self.ready = True
        self.healthy = False
        self.ever_healthy = False
        self.ejected_reason: str | None = None
        self.static_models = static_models
        self.models: frozenset[str] = frozenset(static_models)
        self.model_cards: tuple[dict[str, Any], ...] = ()
        self.failures = 0
        self.successes = 0
        self.breaker = breaker
        self.in_flight = 0
        self.prefill_tokens = 0
        self.telemetry: EngineTelemetry | None = None
        self.stale_after = stale_after
        self.last_check = 0.0
        self.last_error: str | None = None
        self.silent_scrapes = 0  # consecutive scrapes that timed out (see EngineRegistry.engine_silent)
        self.completions = load.CompletionStats()  # fed by the request-tracker plugin
        # The engine's KV geometry, from its last scrape that had it (it does not change while it runs).
        self.kv_block_size: int | None = None
        self.kv_blocks: int | None = None
        # KV events (vllm_stack.scheduling.index.feed): from discovery; None means ask the engine.
        self.kv_events_endpoint: str | None = None
        self.kv_replay_endpoint: str | None = None
        # LoRA adapter slots (--max-loras), from its last scrape that had vllm:lora_requests_info.
        self.max_loras: int | None = None
        # Requests it runs at once (its --max-num-seqs, or what its KV cache allows): the most it ran at a
        # scrape where others waited. None until it was seen queuing.
        self.running_slots: int | None = None
        # Bumped when the router itself loads or unloads an adapter there: a /v1/models answer to a
        # probe sent before that is older than what the router knows, and is not learned.
        self.models_changed = 0
        # production-stack's engine id (its ``/engines`` ``engine_id``, the ``id`` of ``/sleep``, ``/wake_up``
        # and ``/is_sleeping``): uuid5 of the engine's name in the DNS namespace, as its Kubernetes discovery
        # makes it of the pod's name, so the ids in users' scripts stay the same after a switch.
        self.engine_id = engine_id(name)
        # Asleep (vLLM's sleep mode): not a candidate, yet healthy (no breaker, no ejection). Set from its
        # scrape (vllm:engine_sleep_state) and from its answers to the router's sleep and wake-up calls.
        self.sleeping = False
        self.sleep_level = 0  # vLLM's level while asleep (1: weights offloaded, 2: discarded); 0 awake

    def fresh_telemetry(self, now: float | None = None) -> EngineTelemetry | None:
        """Scraped figures under the stale rule of :mod:`vllm_stack.engines.load` (unknown is not zero)."""
        return load.fresh_telemetry(self, now)

    def adapters(self) -> list[str]:
        """The LoRA adapters it serves now (its ``/v1/models`` cards that have a parent)."""
        return [c["id"] for c in self.model_cards if c.get("parent")]

    def routable(self) -> bool:
        """A candidate: ready, healthy and awake (read when the index is rebuilt, never per request)."""
        return self.ready and self.healthy and not self.sleeping

    @property
    def address(self) -> str:
        """``host:port`` of its URL: how a gateway and an endpoint picker name it."""
        return self.url.partition("://")[2].split("/", 1)[0]

    def describe(self) -> dict[str, Any]:
        """JSON view for ``GET /engines``."""
        t = self.fresh_telemetry()
        return {
            "name": self.name,
            "engine_id": self.engine_id,
            "url": self.url,
            "role": self.role,
            "kind": self.kind.name,
            "ready": self.ready,
            "healthy": self.healthy,
            "sleeping": self.sleeping,
            "sleep_level": self.sleep_level,
            "ejected_reason": self.ejected_reason,
            "models": sorted(self.models),
            "circuit_breaker": self.breaker.state.name.lower(),
            "in_flight": self.in_flight,
            "prefill_tokens": self.prefill_tokens,
            "load": None
            if t is None
            else {
                "num_requests_running": t.running,
                "num_requests_waiting": t.waiting,
                "kv_cache_usage_perc": t.kv_cache_usage,
                "age_seconds": round(load.age(t), 3),
            },
            "running_slots": self.running_slots,
            "completions": self.completions.describe(),
            "kv_cache": {"block_size": self.kv_block_size, "blocks": self.kv_blocks},
            "lora": {
                "max_loras": self.max_loras,  # None until the engine published it (its first request)
                "adapters": sorted(self.adapters()),
                "running": None if t is None or t.running_adapters is None else sorted(t.running_adapters),
                "waiting": None if t is None or t.waiting_adapters is None else sorted(t.waiting_adapters),
            },
            "last_error": self.last_error,
        }


def engine_id(name: str) -> str:
    """production-stack's id of an engine named ``name`` (a pod's name under Kubernetes discovery):
    ``uuid5(NAMESPACE_DNS, name)``. Under static discovery the name is ``host:port``; production-stack
    draws a random uuid4 per start there, so no script can have kept one."""
    return str(uuid.uuid5(uuid.NAMESPACE_DNS, name))
