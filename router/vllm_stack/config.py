"""Router settings from the command line and a YAML file (production-stack flag names accepted).

Precedence: built-in defaults < YAML file < flags given on the command line. The YAML file uses the
flag names with ``-`` or ``_`` (``routing-logic: session`` or ``routing_logic: session``); lists may be
YAML lists or comma-separated strings. A ``scheduling`` mapping (plugins and profiles, see
:mod:`vllm_stack.scheduling.config`) is kept as given here and checked when the router builds it. :func:`load_config` is pure, so the hot-reload watcher can
call it again and swap the result in.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from vllm_stack.priority import served_models

DISCOVERY_KINDS = ("static", "k8s")
JSON_PARSERS = ("msgspec", "orjson")
ENGINE_ROLES = ("both", "prefill", "decode")  # an engine's role (vllm_stack.engines.engine.ROLES)
DISAGG_PROTOCOLS = ("vllm", "lmcache")  # vllm_stack.director.disagg
SWITCH_VALUES = ("auto", "on", "off")
TRACE_PROTOCOLS = ("grpc", "http/protobuf")  # OTLP exporters (vllm_stack.tracing.otel)
KV_EVENT_MODES = SWITCH_VALUES


def switch_value(value: Any) -> Any:  # noqa: ANN401 - checked by the caller
    """An auto/on/off setting as written: YAML reads an unquoted ``on``/``off`` as a boolean."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return value


log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """Invalid router configuration (reported to the operator, never to API clients)."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """Every router setting. Immutable: a reload builds a new one and swaps it in."""

    host: str = "0.0.0.0"
    port: int = 8000
    config_file: str | None = None
    service_discovery: str = "static"
    static_backends: tuple[str, ...] = ()
    static_models: tuple[str, ...] = ()
    static_roles: tuple[str, ...] = ()  # prefill / decode / both, one per static backend (optional)
    # production-stack's names: engine pods whose ``model`` label is one of these are prefill / decode
    # engines (k8s discovery; the chart's pods carry vllm-stack.io/role, which wins)
    prefill_model_labels: tuple[str, ...] = ()
    decode_model_labels: tuple[str, ...] = ()
    k8s_namespace: str = "default"
    k8s_label_selector: str = ""
    k8s_port: int = 8000
    # A built-in strategy (vllm_stack.scheduling.profiles), checked there. prefixaware: the best by the
    # routing-quality benchmark (benchmarks/routing) on every workload, so the default.
    routing_logic: str = "prefixaware"
    scheduling: Mapping[str, Any] | None = field(default=None, compare=False)  # plugins and profiles (YAML)
    session_key: str = "x-session-id"
    session_balance_epsilon: float = 0.25  # bounded loads: no engine above (1 + e) x mean load
    prefix_chars: int = 256  # prefixaware: characters of the prompt hashed for affinity
    # prefixaware in token mode: model name -> directory with tokenizer.json and tokenizer_config.json
    tokenizers: Mapping[str, str] | None = field(default=None, compare=False)
    # prefixaware: follow the engines' KV events (auto: when a tokenizer makes request keys match them)
    kv_events: str = "auto"
    # kvaware (LMCache's controller says where a prompt's KV is): the controller's HTTP API, the most
    # prompt tokens the holder may lack and still get the request (production-stack's
    # --kv-aware-threshold), and how long one lookup may take on the request path
    lmcache_controller_url: str | None = None
    kv_aware_threshold: int = 2000
    lmcache_lookup_timeout: float = 0.2
    # Answers carry x-vllm-stack-route (the profile, the picker's reason, the engine and the picker's
    # note): off by default, since it names internal engines to clients
    debug_headers: bool = False
    # LoRA adapters (vllm_stack.engines.adapters): [{name, source, base_model, tier}], checked there
    lora_adapters: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)
    # weighted model names: {name: [{model, weight}, ...]} (canary / blue-green splits)
    weighted_models: Mapping[str, Any] | None = field(default=None, compare=False)
    lora_load_timeout: float = 120.0  # seconds one POST /v1/load_lora_adapter may take
    # The models this router serves: [name | {name, criticality, engine_priority, engine_kind}]
    # (vllm_stack.priority; engine_kind: vllm_stack.engines.kinds, default vllm).
    # A request for one with no ready engine waits in its queue (scale from zero) instead of a 404.
    models: tuple[Any, ...] = field(default=(), compare=False)
    # Request priority (README "Request priority"): the built-in strategies get the criticality chains
    priority_scheduling: bool = True
    priority_header: str = "x-request-priority"
    # Keys that may raise a request's priority above its model's (others may only lower it)
    priority_api_keys_file: str | None = None
    priority_api_keys: frozenset[str] = field(default_factory=frozenset, repr=False)
    # The saturation rule (vllm_stack.engines.load): queue >= max_waiting or KV usage >= max_kv
    saturation_max_waiting: float = 5.0
    saturation_max_kv_cache_usage: float = 0.8
    critical_max_waiting: float = 50.0  # critical requests keep engines whose queue is below this
    critical_reserve_slots: int = 0  # running slots per engine kept free of non-critical work (0: none)
    # Disaggregated prefill (vllm_stack.director.disagg): models with prefill-role engines send each
    # request's prefill there first. On with routing_logic disaggregated_prefill or prefill roles.
    disaggregation: bool = False
    disagg_protocol: str = "vllm"  # vllm: vLLM's kv_transfer_params; lmcache: LMCache's disagg_spec
    disagg_min_uncached_tokens: int = 256  # shorter uncached prompt parts are served decode-only
    # lmcache protocol: where decode engines' LMCache receivers listen (engine host, these ports), where
    # the router takes the prefill engines' "KV sent" notifications (ZMQ PULL), and how long it waits
    disagg_receiver_init_port: int = 7300
    disagg_receiver_alloc_port: int = 7400
    disagg_notify_port: int = 7500
    disagg_notify_timeout: float = 10.0
    # The router's per-model queue: requests wait there while every engine is saturated (or none is
    # ready yet); 0 turns it off (such requests are answered at once)
    queue_max_per_model: int = 1000
    queue_timeout: float = 120.0  # seconds a request may wait there before its 503
    engine_scrape_interval: float = 1.0
    health_check_interval: float = 5.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    circuit_failure_threshold: int = 5
    circuit_open_seconds: float = 10.0
    request_timeout: float = 600.0
    connect_timeout: float = 5.0
    # seconds a client's request head may take to arrive whole (slowloris); then 408 and close.
    # Well-kept proxies close within 60 s (nginx's client_header_timeout); a real client's head
    # takes milliseconds.
    request_head_timeout: float = 30.0
    # seconds a request body (buffered, or an upload streamed to disk) may send no byte; then 408 and
    # close, so a silent client gives back what its body holds of max_buffered_body_bytes. nginx's
    # client_body_timeout, with its default
    request_body_timeout: float = 60.0
    engine_ca_file: str | None = None  # CA bundle that signs https engines' certificates (default: system)
    max_body_bytes: int = 32 * 1024 * 1024
    # request bodies all client connections together may hold (arriving, queued or being answered);
    # a request whose body would pass it gets 503 with Retry-After (server/http1.py)
    max_buffered_body_bytes: int = 256 * 1024 * 1024
    # with client keys: the part of max_buffered_body_bytes the bodies of one key's requests may hold
    # together (at least one max_body_bytes body); past it 429 with Retry-After (server/budget.py)
    max_body_share_per_key: float = 0.25
    max_connections: int = 10_000  # client connections held at once; more are answered 503 and closed
    retries: int = 2  # extra attempts on another engine before any byte reached the client
    api_keys_file: str | None = None
    api_keys: frozenset[str] = field(default_factory=frozenset, repr=False)
    # Keys that may load and unload adapters through the router (none: those endpoints are refused)
    admin_api_keys_file: str | None = None
    admin_api_keys: frozenset[str] = field(default_factory=frozenset, repr=False)
    # Tracing (vllm_stack.tracing): off unless an OTLP endpoint is given; host:port for gRPC (as
    # production-stack's --otel-endpoint), a URL for HTTP/protobuf
    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: str = "grpc"
    otel_service_name: str = "vllm-stack-router"
    otel_secure: bool = False  # gRPC with TLS
    trace_sample_ratio: float = 1.0  # of new traces; a client's traceparent decides for its own
    # The Inference Extension (docs/inference-extension.md). Endpoint picker: an ext_proc server on this
    # port (0: none) scheduling for a gateway; its engines the pods of this InferencePool (k8s discovery)
    ext_proc_port: int = 0
    inference_pool: str = ""
    # The endpoint picker's bounds on what a gateway holds (docs/inference-extension.md "Bounds"): seconds
    # a stream waiting for its request (headers, body chunks), a connection with no stream, or one not
    # past its HTTP/2 preface may send nothing before it is ended (a gateway's request arrives in
    # milliseconds, as a router's head does: the same 30 s as request_head_timeout); seconds a picked
    # request's answer may send nothing before its engine booking is released (the router's
    # request_timeout for an engine's silence); gateway connections held at once (each holds a file
    # descriptor of the process the router's own port shares)
    ext_proc_idle_timeout: float = 30.0
    ext_proc_answer_timeout: float = 600.0
    ext_proc_max_connections: int = 256
    # Gateway mode: each request's engine asked of this endpoint picker (grpc://host:port; empty: ours)
    endpoint_picker: str = ""
    endpoint_picker_timeout: float = 1.0  # seconds for its answer, after the request body was sent
    endpoint_picker_fail_open: bool = True  # it is down or slow: schedule here (False: 503)
    # The Batch API (vllm_stack.batch, docs/batch.md): /v1/files and /v1/batches, lines run at sheddable
    # priority. Files (and the SQLite database) in batch_dir; with a PostgreSQL URL (environment
    # VLLM_STACK_BATCH_DATABASE_URL: it holds a password) replicas share the batches, and batch_dir must
    # be one volume they all mount (ReadWriteMany)
    batch_api: bool = False
    batch_dir: str = "vllm-stack-batch"
    batch_database_url: str | None = field(default=None, repr=False)
    batch_completion_window: float = 86400.0  # seconds OpenAI's "24h" window lasts here (tests: seconds)
    batch_max_file_bytes: int = 200 * 1024 * 1024  # an uploaded file, at most (OpenAI's batch input limit)
    batch_concurrency: int = 8  # batch lines in flight from this router, at most
    # running slots per engine batch lines leave free for interactive requests (vllm_stack.engines.load.
    # background_room: vLLM does not preempt a running request for a more urgent one)
    batch_reserve_slots: int = 2
    batch_lease_seconds: float = 30.0  # a dead router's lines and batches are taken again after this
    shutdown_grace: float = 30.0  # seconds answers under way may take to finish after SIGTERM
    json_parser: str = "msgspec"
    log_level: str = "info"
    access_log: bool = False

    @property
    def disaggregated(self) -> bool:
        """Whether prefill-role engines are used: asked for, or implied by the strategy or the roles."""
        return (
            self.disaggregation
            or self.routing_logic == "disaggregated_prefill"
            or "prefill" in self.static_roles
            or bool(self.prefill_model_labels)
        )

    def validate(self) -> RouterConfig:
        """Raise :class:`ConfigError` on settings that cannot work; return self for chaining."""
        if self.service_discovery not in DISCOVERY_KINDS:
            raise ConfigError(f"service_discovery must be one of {DISCOVERY_KINDS}")
        if self.kv_events not in KV_EVENT_MODES:
            raise ConfigError(f"kv_events must be one of {KV_EVENT_MODES}")
        if self.scheduling is not None and not isinstance(self.scheduling, Mapping):
            raise ConfigError("scheduling must be a mapping (plugins and schedulingProfiles)")
        if self.json_parser not in JSON_PARSERS:
            raise ConfigError(f"json_parser must be one of {JSON_PARSERS}")
        if self.service_discovery == "static" and not self.static_backends:
            raise ConfigError("static discovery needs static_backends")
        if self.static_models and len(self.static_models) != len(self.static_backends):
            raise ConfigError("static_models must have one entry per static backend")
        if self.static_roles and len(self.static_roles) != len(self.static_backends):
            raise ConfigError("static_roles must have one entry per static backend")
        for role in self.static_roles:
            if role not in ENGINE_ROLES:
                raise ConfigError(f"static_roles: {role!r} is not one of {ENGINE_ROLES}")
        if set(self.prefill_model_labels) & set(self.decode_model_labels):
            raise ConfigError("a model label cannot be both in prefill_model_labels and decode_model_labels")
        if self.routing_logic == "kvaware" and not (self.lmcache_controller_url or "").startswith(
            ("http://", "https://")
        ):
            raise ConfigError(
                "routing_logic kvaware needs lmcache_controller_url (the controller's http(s):// URL)"
            )
        if self.kv_aware_threshold < 0 or self.lmcache_lookup_timeout <= 0:
            raise ConfigError("kv_aware_threshold must be >= 0 and lmcache_lookup_timeout > 0")
        if self.disagg_protocol not in DISAGG_PROTOCOLS:
            raise ConfigError(f"disagg_protocol must be one of {DISAGG_PROTOCOLS}")
        if self.disagg_min_uncached_tokens < 0:
            raise ConfigError("disagg_min_uncached_tokens must be >= 0")
        ports = (self.disagg_receiver_init_port, self.disagg_receiver_alloc_port, self.disagg_notify_port)
        if not all(0 < port < 65536 for port in ports) or self.disagg_notify_timeout <= 0:
            raise ConfigError("the disagg_* ports must be in 1..65535 and disagg_notify_timeout > 0")
        for backend in self.static_backends:
            if not backend.startswith(("http://", "https://")):
                raise ConfigError(f"static backend {backend!r} must be an http(s):// URL")
        if self.request_head_timeout <= 0 or self.request_body_timeout <= 0:
            raise ConfigError("request_head_timeout and request_body_timeout must be > 0")
        if self.retries < 0 or self.max_body_bytes <= 0 or self.request_timeout <= 0:
            raise ConfigError("retries must be >= 0; max_body_bytes and request_timeout > 0")
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ConfigError("max_buffered_body_bytes must be >= max_body_bytes (one largest body must fit)")
        if not 0 < self.max_body_share_per_key <= 1:
            raise ConfigError("max_body_share_per_key must be in (0, 1]")
        if self.max_connections <= 0:
            raise ConfigError("max_connections must be > 0")
        if self.engine_scrape_interval <= 0 or self.health_check_interval <= 0:
            raise ConfigError("scrape and health-check intervals must be > 0")
        if self.session_balance_epsilon <= 0:
            raise ConfigError("session_balance_epsilon must be > 0")
        if self.lora_load_timeout <= 0:
            raise ConfigError("lora_load_timeout must be > 0")
        try:
            served_models(self.models)
        except ValueError as exc:
            raise ConfigError(f"models: {exc}") from None
        if (
            self.saturation_max_waiting < 0
            or self.critical_max_waiting < 0
            or self.critical_reserve_slots < 0
        ):
            raise ConfigError(
                "saturation_max_waiting, critical_max_waiting and critical_reserve_slots must be >= 0"
            )
        if not 0 < self.saturation_max_kv_cache_usage <= 1:
            raise ConfigError("saturation_max_kv_cache_usage must be in (0, 1]")
        if self.queue_max_per_model < 0 or self.queue_timeout <= 0:
            raise ConfigError("queue_max_per_model must be >= 0 and queue_timeout > 0")
        if not self.priority_header or self.priority_header.lower() != self.priority_header.strip().lower():
            raise ConfigError("priority_header must be a header name")
        if self.otlp_traces_protocol not in TRACE_PROTOCOLS:
            raise ConfigError(f"otlp_traces_protocol must be one of {', '.join(TRACE_PROTOCOLS)}")
        if not 0 <= self.trace_sample_ratio <= 1:
            raise ConfigError("trace_sample_ratio must be in [0, 1]")
        if not 0 <= self.ext_proc_port <= 65535:
            raise ConfigError("ext_proc_port must be a port number (0: no endpoint picker)")
        if self.ext_proc_idle_timeout <= 0 or self.ext_proc_answer_timeout <= 0:
            raise ConfigError("ext_proc_idle_timeout and ext_proc_answer_timeout must be > 0")
        if self.ext_proc_max_connections <= 0:
            raise ConfigError("ext_proc_max_connections must be > 0")
        if self.inference_pool and self.service_discovery != "k8s":
            raise ConfigError("inference_pool needs service_discovery k8s (its pods are the engines)")
        if self.endpoint_picker:
            if not self.endpoint_picker.startswith("grpc://") or ":" not in self.endpoint_picker[7:]:
                raise ConfigError("endpoint_picker must be grpc://HOST:PORT")
            if self.ext_proc_port:
                raise ConfigError(
                    "endpoint_picker (gateway mode) and ext_proc_port (endpoint picker) exclude each other"
                )
        if self.batch_completion_window <= 0 or self.batch_lease_seconds <= 0:
            raise ConfigError("batch_completion_window and batch_lease_seconds must be > 0")
        if self.batch_reserve_slots < 0:
            raise ConfigError("batch_reserve_slots must be >= 0")
        if self.batch_max_file_bytes <= 0 or self.batch_concurrency <= 0:
            raise ConfigError("batch_max_file_bytes and batch_concurrency must be > 0")
        if self.batch_database_url and not self.batch_database_url.startswith(
            ("postgresql://", "postgres://")
        ):
            raise ConfigError("the batch database URL must be a postgresql:// URL")
        if self.endpoint_picker_timeout <= 0:
            raise ConfigError("endpoint_picker_timeout must be > 0")
        return self


_FIELD_TYPES = {f.name: f.type for f in fields(RouterConfig)}
_TUPLE_FIELDS = {
    "static_backends",
    "static_models",
    "static_roles",
    "prefill_model_labels",
    "decode_model_labels",
}


def _coerce(name: str, value: Any) -> Any:
    """Convert a YAML/CLI value to the field's type."""
    if name == "tokenizers":  # a YAML mapping, or "model=dir,model2=dir2" from the command line
        if isinstance(value, str):
            pairs = [item.split("=", 1) for item in value.split(",") if item.strip()]
            if any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
                raise ValueError("expected model=directory[,model=directory...]")
            return {k.strip(): v.strip() for k, v in pairs}
        if not isinstance(value, Mapping):
            raise ValueError("expected a mapping of model name to tokenizer directory")
        return {str(k): str(v) for k, v in value.items()}
    if name == "kv_events":
        return switch_value(value)
    if name == "lora_adapters":  # checked by vllm_stack.engines.adapters
        if not isinstance(value, list | tuple):
            raise ValueError("expected a list of {name, source, base_model, tier}")
        return tuple(value)
    if name == "models":  # checked by vllm_stack.priority.served_models
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        if not isinstance(value, list | tuple):
            raise ValueError(
                "expected a list of model names or {name, criticality, engine_priority, engine_kind}"
            )
        return tuple(value)
    if name == "weighted_models":
        if not isinstance(value, Mapping):
            raise ValueError("expected a mapping of model name to [{model, weight}, ...]")
        return dict(value)
    if name in _TUPLE_FIELDS:
        if isinstance(value, str):
            return tuple(v.strip() for v in value.split(",") if v.strip())
        return tuple(str(v) for v in value)
    kind = _FIELD_TYPES[name]
    if value is None:
        return None
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    if kind == "bool":
        return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
    if kind.startswith("str"):
        return str(value)
    return value


#: Settings earlier versions had: accepted with a warning so an old file still loads.
RETIRED = {
    "upstream_client": "the router has one upstream client, its own relay (benchmarks/router/README.md)",
}


def _normalise(raw: Mapping[str, Any], source: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name in RETIRED:
            log.warning("%s: %r is ignored: %s", source, key, RETIRED[name])
            continue
        if name in ("api_keys", "admin_api_keys", "priority_api_keys", "config_file", "batch_database_url"):
            raise ConfigError(
                f"{source}: {key!r} cannot be set here (use api_keys_file / admin_api_keys_file / "
                "priority_api_keys_file / --config / the environment's VLLM_STACK_BATCH_DATABASE_URL)"
            )
        if name not in _FIELD_TYPES:
            raise ConfigError(f"{source}: unknown setting {key!r}")
        try:
            out[name] = _coerce(name, value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: bad value for {key!r}: {exc}") from exc
    return out


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML config file into normalised settings (``ConfigError`` when unreadable)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} must be a mapping")
    data = data.get("router", data) if isinstance(data.get("router"), dict) else data
    return _normalise(data, str(path))


def load_api_keys(
    path: str | None, environ: Mapping[str, str], variable: str = "VLLM_STACK_API_KEYS"
) -> frozenset[str]:
    """API keys from a file (one per line, ``#`` comments) plus the comma list in ``variable``."""
    keys: set[str] = set()
    if path:
        try:
            for line in Path(path).read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.add(line)
        except OSError as exc:
            raise ConfigError(f"cannot read api keys file {path}: {exc}") from exc
    keys.update(k.strip() for k in environ.get(variable, "").split(",") if k.strip())
    return frozenset(keys)


def load_config(
    cli: Mapping[str, Any] | None = None,
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> RouterConfig:
    """Build a validated config: defaults < YAML ``config_file`` < explicit ``cli`` settings."""
    environ = os.environ if environ is None else environ
    settings: dict[str, Any] = {}
    if config_file:
        settings.update(read_yaml(config_file))
    settings.update(_normalise({k: v for k, v in (cli or {}).items() if v is not None}, "command line"))
    config = replace(RouterConfig(), **settings, config_file=config_file)
    config = replace(
        config,
        api_keys=load_api_keys(config.api_keys_file, environ),
        admin_api_keys=load_api_keys(config.admin_api_keys_file, environ, "VLLM_STACK_ADMIN_API_KEYS"),
        priority_api_keys=load_api_keys(
            config.priority_api_keys_file, environ, "VLLM_STACK_PRIORITY_API_KEYS"
        ),
        batch_database_url=environ.get("VLLM_STACK_BATCH_DATABASE_URL") or None,
    )
    return config.validate()
