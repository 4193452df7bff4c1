"""How an engine is chosen: the strategy (or plugins and profiles) and the settings of its pickers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_stack.settings.declare import ConfigError, setting

#: The built-in strategies (vllm_stack.scheduling.profiles builds each). prefixaware: the best by the
#: routing-quality benchmark (benchmarks/routing) on every workload, so the default.
ROUTING_LOGICS = (
    "roundrobin",
    "random",
    "leastloaded",
    "p2c",
    "session",
    "prefixaware",
    "kvaware",
    "disaggregated_prefill",
    "priority",
)
SWITCH_VALUES = ("auto", "on", "off")
KV_EVENT_MODES = SWITCH_VALUES


def switch_value(value: Any) -> Any:  # noqa: ANN401 - checked by the caller
    """An auto/on/off setting as written: YAML reads an unquoted ``on``/``off`` as a boolean."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


def _tokenizers(value: Any) -> dict[str, str]:  # noqa: ANN401 - YAML or a flag's string
    """A YAML mapping, or ``model=dir,model2=dir2`` from the command line."""
    if isinstance(value, str):
        pairs = [item.split("=", 1) for item in value.split(",") if item.strip()]
        if any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
            raise ValueError("expected model=directory[,model=directory...]")
        return {k.strip(): v.strip() for k, v in pairs}
    if not isinstance(value, Mapping):
        raise ValueError("expected a mapping of model name to tokenizer directory")
    return {str(k): str(v) for k, v in value.items()}


@dataclass(frozen=True)
class SchedulingGroup:
    """The strategy and its pickers' settings. ``scheduling`` (plugins and profiles, see
    :mod:`vllm_stack.scheduling.config`) is kept as given here and checked when the router builds it."""

    __slots__ = ()

    routing_logic: str = setting(
        "prefixaware",
        doc="the built-in strategy (docs/scheduling.md; default prefixaware)",
        choices=ROUTING_LOGICS,
        chart="routerSpec.routingLogic",
    )
    scheduling: Mapping[str, Any] | None = setting(
        None, compare=False, doc="plugins and schedulingProfiles (docs/scheduling.md)", flag=""
    )
    session_key: str = setting(
        "x-session-id",
        doc="header holding the session id (falls back to the body's 'user')",
        chart="routerSpec.sessionKey",
    )
    session_balance_epsilon: float = setting(
        0.25, doc="bounded-load factor e of session affinity: no engine above (1 + e) x mean load"
    )
    # production-stack's priority logic (scheduling/plugins/priority_threshold_profile_handler.py), in its
    # sense of a priority: vLLM's, lower is served first
    priority_threshold: int = setting(
        0,
        doc="routing logic priority: requests of this vLLM priority or lower (more urgent) go to the "
        "least-loaded engine, the rest round-robin (default 0)",
    )
    priority_default: int = setting(
        0,
        doc="routing logic priority: the vLLM priority of a request that names none (default 0)",
    )
    # production-stack's --prefix-min-match-length, in its unit (characters of the prompt); the picker
    # measures a match in tokens and converts at its chars_per_token (4), a match being whole KV blocks
    prefix_min_match_length: int = setting(
        0,
        doc="prefixaware: a prompt whose longest cached match is shorter than this many characters (at 4 "
        "per token; matches are whole KV blocks) is placed as a new prefix, by load (default 0: off)",
        chart="routerSpec.prefixMinMatchLength",
    )
    prefix_chars: int = setting(256, doc="prefixaware: characters of the prompt hashed for affinity", flag="")
    # prefixaware in token mode: model name -> directory with tokenizer.json and tokenizer_config.json
    tokenizers: Mapping[str, str] | None = setting(
        None,
        compare=False,
        doc="prefixaware in token mode: model=DIR or model=hf:ORG/NAME[@REV], comma-separated (DIR holds "
        "tokenizer.json, tokenizer_config.json; hf: fetches them from $HF_ENDPOINT)",
        chart="routerSpec.tokenizers",
        parse=_tokenizers,
    )
    kv_events: str = setting(
        "auto",
        doc="prefixaware: follow the engines' KV events (auto, the default: for models with a tokenizer)",
        choices=KV_EVENT_MODES,
        parse=switch_value,
    )
    # kvaware (LMCache's controller says where a prompt's KV is)
    lmcache_controller_url: str | None = setting(
        None,
        doc="kvaware: the HTTP API of LMCache's controller (lmcache_controller --port), e.g. http://HOST:9010",
    )
    kv_aware_threshold: int = setting(
        2000,
        doc="kvaware: the most prompt tokens the LMCache holder may lack and still get the request (2000)",
        chart="routerSpec.kvAwareThreshold",
    )
    lmcache_lookup_timeout: float = setting(
        0.2,
        doc="kvaware: seconds one controller lookup may take before the cache-aware fallback decides (0.2)",
    )

    def check(self) -> None:
        """Raise :class:`ConfigError` on scheduling settings that cannot work (the strategy's name is
        checked as the scheduling is built)."""
        if self.kv_events not in KV_EVENT_MODES:
            raise ConfigError(f"kv_events must be one of {KV_EVENT_MODES}")
        if self.scheduling is not None and not isinstance(self.scheduling, Mapping):
            raise ConfigError("scheduling must be a mapping (plugins and schedulingProfiles)")
        if self.routing_logic == "kvaware" and not (self.lmcache_controller_url or "").startswith(
            ("http://", "https://")
        ):
            raise ConfigError(
                "routing_logic kvaware needs lmcache_controller_url (the controller's http(s):// URL)"
            )
        if self.kv_aware_threshold < 0 or self.lmcache_lookup_timeout <= 0:
            raise ConfigError("kv_aware_threshold must be >= 0 and lmcache_lookup_timeout > 0")
        if self.prefix_min_match_length < 0:
            raise ConfigError("prefix_min_match_length must be >= 0")
        if self.session_balance_epsilon <= 0:
            raise ConfigError("session_balance_epsilon must be > 0")
