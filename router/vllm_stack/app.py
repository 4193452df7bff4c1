"""Assembles one router: its state objects, background tasks, and what the server dispatches to.

Assembly only: everything a router needs lives on a :class:`Router` instance (registry, metrics,
director, plugin registry and plugin state, engine connection pools, tasks); nothing is
module-global, so several routers can run in one process. The server hands each request to
:meth:`Router.dispatch`: proxied paths go to the hot path (:mod:`vllm_stack.api.proxied`, then the
director), everything else to this object as an ASGI app (:mod:`vllm_stack.api.routes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import operator
import os
import ssl
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from vllm_stack.api import head, proxied, routes
from vllm_stack.api.auth import ApiKeyAuth
from vllm_stack.api.http import Receive, Send
from vllm_stack.api.parsing import BodyParser, make_parser
from vllm_stack.api.priority import PriorityPolicy
from vllm_stack.batch import api as batch_api
from vllm_stack.batch.files import MULTIPART_SLACK
from vllm_stack.batch.runner import BatchRunner, BatchSettings
from vllm_stack.config import DECLARED, ConfigError, RouterConfig, load_config, read_yaml
from vllm_stack.director.director import Director, ProxySettings
from vllm_stack.director.disagg import DisaggSettings
from vllm_stack.director.pd_notify import PdNotifications
from vllm_stack.director.queue import RequestQueue
from vllm_stack.director.rate_gate import RateLimitGate, with_gate
from vllm_stack.endpoint_table import ENDPOINTS, EndpointTable
from vllm_stack.engines.adapter_placement import AdapterPlacement
from vllm_stack.engines.adapters import AdapterCatalog
from vllm_stack.engines.discovery.base import Discovery
from vllm_stack.engines.discovery.collector import DiscoveryCollector
from vllm_stack.engines.discovery.external import with_providers
from vllm_stack.engines.discovery.static import StaticDiscovery
from vllm_stack.engines.engine import Engine
from vllm_stack.engines.external import ExternalProviders, load_providers
from vllm_stack.engines.kinds import kind_named
from vllm_stack.engines.load import SaturationLimits
from vllm_stack.engines.registry import EngineRegistry
from vllm_stack.engines.sleep import SleepControl
from vllm_stack.metrics import RouterMetrics
from vllm_stack.priority import served_models
from vllm_stack.relay.headers import REQUEST_DROP
from vllm_stack.relay.pool import EnginePools
from vllm_stack.scheduling.config import SchedulingSetup, build_scheduling
from vllm_stack.scheduling.framework import Scheduler
from vllm_stack.scheduling.index.feed import KvEventFeed
from vllm_stack.scheduling.plugins import builtin_registry
from vllm_stack.scheduling.profiles import scheduling_config
from vllm_stack.scheduling.registry import PluginRegistry, PluginState
from vllm_stack.server.asgi_bridge import AsgiCall
from vllm_stack.server.body_stream import STREAM_HOLD
from vllm_stack.server.http1 import HttpConnection, HttpRequest
from vllm_stack.telemetry.scraper import EngineScraper
from vllm_stack.tenants.identity import TenantIdentity
from vllm_stack.tenants.limiter import RateLimiter, declared_limits
from vllm_stack.tenants.shares import TenantShares
from vllm_stack.tracing import TRACE_HEADERS

if TYPE_CHECKING:
    from vllm_stack.tracing.otel import RequestTracer

log = logging.getLogger(__name__)

#: Settings a running router does not change: a reload that changes one says so (and why); the
#: router keeps running with the value it started with. Every other setting takes effect on reload
#: (tests/router/test_reload.py holds every RouterConfig field to one or the other). Declared with each
#: setting (``restart=`` in vllm_stack.settings).
RESTART_ONLY: Mapping[str, str] = {
    name: item.setting.restart for name, item in DECLARED.items() if item.setting.restart is not None
}


def _static_models(config: RouterConfig) -> dict[str, tuple[str, ...]]:
    if not config.static_models:
        return {}
    return {b.rstrip("/"): (m,) for b, m in zip(config.static_backends, config.static_models, strict=True)}


def _model_kinds(config: RouterConfig) -> dict[str, str]:
    """Model -> the kind of its engines (``models[].engine_kind``, vllm_stack.engines.kinds); a
    ``ConfigError`` names an unknown kind."""
    kinds: dict[str, str] = {}
    for name, served in served_models(config.models).items():
        try:
            kinds[name] = kind_named(served.engine_kind).name
        except ValueError as exc:
            raise ConfigError(f"models: {name!r}: {exc}") from None
    return kinds


def _static_kinds(config: RouterConfig) -> tuple[str | None, ...]:
    """The kind of each static backend: that of the model ``static_models`` lists for it (none listed,
    or a model without an ``engine_kind``: the default)."""
    kinds = _model_kinds(config)
    if not config.static_models:
        return ()
    return tuple(kinds.get(m) for m in config.static_models)


class Router:
    """One router instance. ``discovery`` may be injected (tests); otherwise built from the config.
    ``plugins`` is the registry of plugin types the scheduling configuration may name (default: the
    built-ins); ``endpoints`` the paths it serves (default: :data:`~vllm_stack.endpoint_table.ENDPOINTS`)."""

    def __init__(
        self,
        config: RouterConfig,
        discovery: Discovery | None = None,
        environ: Mapping[str, str] | None = None,
        cli_settings: Mapping[str, Any] | None = None,
        plugins: PluginRegistry | None = None,
        span_exporter: Any = None,  # noqa: ANN401 - an OpenTelemetry SpanExporter (tests: in memory)
        endpoints: EndpointTable = ENDPOINTS,
    ) -> None:
        environ = os.environ if environ is None else environ
        self.config = config
        self.endpoints = endpoints
        self.proxied_paths = endpoints.proxied  # dispatch's one lookup, bound once
        self.reserved_paths = endpoints.probes  # the server answers these past its connection limit
        self.root_path = _root_path(config.root_path, endpoints)  # served under it, and without it
        self.plugins = plugins if plugins is not None else builtin_registry()
        self.plugin_state = PluginState()  # outlives reloads: indexes and positions plugins keep
        self._cli_settings = dict(cli_settings or {})
        self.engine_api_key = environ.get("VLLM_API_KEY") or None
        # External OpenAI-compatible providers: engines of the openai kind, their keys from ``environ``
        self.external = _external_providers(config, environ)
        self.external_aliases = self.external.aliases  # the hot path's check: empty when none is set
        self.external_models = self.external.models
        self.metrics = RouterMetrics()
        self.registry = EngineRegistry(
            self._fetch_models,
            self.metrics,
            static_models=self._static_models(config),
            **_registry_limits(config),
        )
        self.registry.on_engine_joined.append(self._engine_joined)
        _model_kinds(config)  # an unknown engine kind is a configuration error, whatever the discovery
        self.discovery: Discovery = discovery if discovery is not None else self._build_discovery(config)
        self.metrics.registry.register(DiscoveryCollector(self.discovery.status))
        self.scraper = EngineScraper(
            self._scraped_engines,
            self._fetch_metrics,
            self.metrics,
            liveness=self.registry,
            interval=config.engine_scrape_interval,
        )
        # https engines: verified against the system's CAs, or against engine_ca_file when given.
        self.engine_tls = (
            ssl.create_default_context(cafile=config.engine_ca_file) if config.engine_ca_file else None
        )
        self.pools = EnginePools(config.connect_timeout, self.engine_tls, self.external.tls)
        self.registry.on_engine_left.append(lambda engine: self.pools.forget(engine.url))
        self.registry.on_engine_left.append(lambda engine: self.plugin_state.forget_engine(engine.name))
        self.kv_feed = KvEventFeed(self._kv_event_engines, self._fetch_kv_sources)
        self.registry.on_engine_healthy.append(lambda _engine: self.kv_feed.kick())
        self.adapters = AdapterPlacement(
            self.registry, self._post_engine, self.metrics, self._catalog(config), config.lora_load_timeout
        )
        setup = self._build_scheduling(config)
        # each tenant's requests on engines (tenant headroom): the director counts and asks
        self.shares = TenantShares(config.tenants)
        self.queue = RequestQueue(
            self.metrics, config.queue_max_per_model, config.queue_max_per_band, config.tenants
        )
        # LMCache's PD hand-over: the prefill engines notify the router here (bound at start)
        self.pd_notifications = (
            PdNotifications(config.disagg_notify_port)
            if config.disaggregated and config.disagg_protocol == "lmcache"
            else None
        )
        self.tracer = _build_tracer(config, span_exporter, endpoints)
        # Request headers not sent upstream: with tracing on, each leg sends its own traceparent
        self.request_drop = REQUEST_DROP | TRACE_HEADERS if self.tracer is not None else REQUEST_DROP
        self.director = Director(
            self.registry,
            self.pools,
            self.metrics,
            setup,
            self._proxy_settings(config),
            self.queue,
            self.pd_notifications,
            self.tracer,
            _build_endpoint_picker(config, self.metrics),
            self.shares,
        )
        # Sleeping engines: /sleep, /wake_up, /is_sleeping through the router, and waking one for a request
        self.sleep = SleepControl(self.registry, self.metrics, self._call_engine)
        self.director.waker = self.sleep.wake_for
        self.picker_server: Any = None  # the endpoint picker's gRPC server (ext_proc_port), built at start
        self.batch: BatchRunner | None = _build_batch(self, config)
        self.batch_endpoints = batch_api.BatchEndpoints(self.batch, self) if self.batch is not None else None
        # Bodies the server hands over as they arrive: uploads (asked on these paths only, off the hot path)
        self.stream_paths = endpoints.streamed if self.batch is not None else frozenset()
        # Room may have appeared for requests waiting in the queue: new figures, a changed index.
        self.scraper.on_scraped.append(lambda engine: self.queue.kick_models(engine.models))
        self.registry.on_rebuilt.append(self.queue.kick_all)
        # The tenants' rate limits: built once (its buckets outlive reloads), limits set by _apply_runtime
        self.rate_limiter = RateLimiter(
            {},
            shared=_rate_limit_store(config.rate_limit_redis_url, config.rate_limit_store_timeout),
            on_store_error=self.metrics.rate_limit_store_errors.inc,
        )
        self._apply_runtime(config, setup)
        # What the server asks of each request's head (api.head.refusal), bound once: a call less
        self.check_head = functools.partial(head.refusal, self)
        # The hot path's check: None when no adapter or weighted name is configured.
        self.catalog: AdapterCatalog | None = self.adapters.catalog if self.adapters.catalog else None
        self.control_session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._discovery_task: asyncio.Task[None] | None = None

    # ---- configuration ---------------------------------------------------------------------------
    def _build_scheduling(self, config: RouterConfig) -> SchedulingSetup:
        """Plugins, profiles and hooks for ``config`` (``ConfigError`` when they cannot be built)."""
        return build_scheduling(
            scheduling_config(config),
            self.plugins,
            self.plugin_state,
            self.metrics,
            self.adapters,
            SaturationLimits(
                config.saturation_max_waiting,
                config.saturation_max_kv_cache_usage,
                config.critical_reserve_slots,
                config.tenant_headroom_slots,
            ),
        )

    @staticmethod
    def _catalog(config: RouterConfig) -> AdapterCatalog:
        """The adapter registry; an adapter of a model whose engine kind does not serve adapters by
        their name (SGLang) is a ``ConfigError``: its requests would get the base model."""
        catalog = AdapterCatalog.from_settings(config.lora_adapters, config.weighted_models)
        kinds = _model_kinds(config)
        for spec in catalog.adapters.values():
            kind = kind_named(kinds.get(spec.base_model, "vllm"))
            if not kind.adapters.by_name:
                raise ConfigError(
                    f"lora_adapters: {spec.name!r}: the engines of {spec.base_model!r} are {kind.name}, which "
                    f"serves an adapter only as '{spec.base_model}:{spec.name}'; the router does not rename "
                    "adapter requests for it yet"
                )
        return catalog

    def _proxy_settings(self, config: RouterConfig) -> ProxySettings:
        return ProxySettings(
            config.retries,
            config.request_timeout,
            b"Bearer " + self.engine_api_key.encode() if self.engine_api_key else None,
            config.access_log,
            config.queue_timeout,
            config.queue_max_per_model > 0,
            frozenset(served_models(config.models)),
            DisaggSettings(
                config.disagg_protocol,
                config.disagg_receiver_init_port,
                config.disagg_receiver_alloc_port,
                config.disagg_notify_timeout,
                self.endpoints.disaggregable,
            )
            if config.disaggregated
            else None,
            config.debug_headers,
            config.eviction_after if config.eviction_enabled else None,
            config.wake_sleeping_engines,
            config.stream_continuation,
            config.tenant_headroom_slots > 0,
        )

    def _with_rate_limits(self, config: RouterConfig, setup: SchedulingSetup) -> SchedulingSetup:
        """``setup`` with the rate gate's hooks when a declared tenant has a limit; unchanged otherwise,
        so a router without limits runs the request path it ran before."""
        limits = declared_limits(config.tenants)
        self.rate_limiter.configure(limits)
        if not limits:
            return setup
        tenants = config.tenants
        metrics = self.metrics
        gate = RateLimitGate(
            self.rate_limiter,
            operator.attrgetter("tenant"),
            self.registry.candidates,
            lambda tenant: metrics.tenant_rejected(tenants.label(tenant), "rate_limited"),
            lambda tenant, used: metrics.tenant_tokens_child(tenants.label(tenant)).set(used),
        )
        return dataclasses.replace(setup, hooks=with_gate(setup.hooks, gate))

    def _apply_runtime(self, config: RouterConfig, setup: SchedulingSetup) -> None:
        """Settings that can change while running (hot reload): swapped as whole objects."""
        self.config = config
        self.shares.set_tenants(config.tenants)
        self.shares.share_seconds = config.tenant_share_seconds
        if not config.tenant_headroom_slots:
            self.shares.clear()  # nothing is counted while it is off: a later reload starts from none
        setup = self._with_rate_limits(config, setup)
        self._scheduling = setup
        self.director.configure(setup, self._proxy_settings(config))
        self.kv_feed.consumers = tuple(
            p for p in setup.plugins.values() if getattr(p, "wants_kv_events", False)
        )
        self.parser: BodyParser = make_parser(config.json_parser, config.prefix_chars)
        self.priority = PriorityPolicy(config)
        self.auth = ApiKeyAuth(config.api_keys)
        self.admin_auth = ApiKeyAuth(config.admin_api_keys)
        # who sent each request (api.proxied), and what the declared tenants are given
        self.identity = TenantIdentity(config.api_key_names, self.auth.enabled, config.tenant_header)
        self.tenants = config.tenants
        self.max_body_bytes = config.max_body_bytes
        # what the server's body budget reads (server.budget.BudgetLimits): attributes, no call per body
        self.buffered_body_limit = config.max_buffered_body_bytes
        share = int(config.max_buffered_body_bytes * config.max_body_share_per_key)
        # at least one largest body per key (a key may always send one), and one upload's stream when the
        # Batch API takes uploads
        self.key_body_limit = max(share, config.max_body_bytes, STREAM_HOLD if config.batch_api else 0)
        self.session_header = config.session_key.lower().encode("latin-1")

    @property
    def scheduler(self) -> Scheduler:
        return self.director.scheduler

    def scheduling_description(self) -> Mapping[str, Any]:
        """Plugins and profiles in use, and what plugins with state say of it, for ``GET /engines``."""
        setup = self._scheduling
        state = {name: p.describe() for name, p in setup.plugins.items() if hasattr(p, "describe")}
        if self.kv_feed.consumers:
            state["kv_event_streams"] = self.kv_feed.describe()
        if self.adapters.catalog:
            state["lora_adapters"] = self.adapters.describe()
        if self.queue.length:
            state["queue"] = self.queue.describe()
        return {**setup.description, "state": state} if state else setup.description

    # ---- what the server asks (vllm_stack.server.serve.ServedApp) --------------------------------------
    def body_limit(self) -> int:
        return self.max_body_bytes

    def buffer_limit(self) -> int:
        return self.buffered_body_limit

    def body_share_limit(self) -> int:
        """One client key's share of the body budget (at least one largest body: a key may always
        send one)."""
        return self.key_body_limit

    def body_holder(self, path: str, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """Whose share of the body budget a request's body counts against (api.head.body_holder);
        with client keys off, None in this one call."""
        return head.body_holder(self, path, headers) if self.auth.enabled else None

    def body_stream_limit(self, method: str, path: str) -> int:
        """A batch file upload's body is written to disk as it arrives (up to the file limit and the
        form around it); every other body is buffered within ``max_body_bytes``."""
        if self.batch is not None and method == "POST" and path in self.stream_paths:
            return self.batch.settings.max_file_bytes + MULTIPART_SLACK
        return 0

    def connection_limit(self) -> int:
        return self.config.max_connections

    def request_timeout(self) -> float:
        return self.director.settings.request_timeout

    def head_timeout(self) -> float:
        return self.config.request_head_timeout

    def body_timeout(self) -> float:
        return self.config.request_body_timeout

    def dispatch(self, conn: HttpConnection, request: HttpRequest) -> None:
        """Proxied paths to the hot path; everything else to the control endpoints' ASGI app."""
        if request.method == "POST" and request.path in self.proxied_paths:
            proxied.handle(self, conn, request)
        else:
            AsgiCall(self, conn, request).start()

    def _static_models(self, config: RouterConfig) -> dict[str, tuple[str, ...]]:
        """Engine URL -> the models it is given: ``--static-models``' and the external providers'."""
        return {**_static_models(config), **self.external.static_models()}

    def _engine_joined(self, engine: Engine) -> None:
        """An external provider's engine gets its key's header lines and its owner's name."""
        provider = self.external.by_url.get(engine.url)
        if provider is not None:
            engine.head_lines = provider.head_lines
            engine.owner = provider.owned_by

    def _scraped_engines(self) -> list[Engine]:
        """The engines that publish metrics (not external providers)."""
        return [e for e in self.registry.engines() if e.kind.metrics_path]

    def _kv_event_engines(self) -> list[Engine]:
        """The engines that publish KV events (not external providers)."""
        return [e for e in self.registry.engines() if e.kind.kv_sources_path]

    @staticmethod
    def _build_discovery(config: RouterConfig) -> Discovery:
        if config.service_discovery == "k8s":
            from vllm_stack.engines.discovery.kubernetes import (
                KubernetesDiscovery,  # lazy: optional heavy import
            )

            roles = {label: "prefill" for label in config.prefill_model_labels}
            roles |= {label: "decode" for label in config.decode_model_labels}
            return KubernetesDiscovery(
                namespace=config.k8s_namespace,
                label_selector=config.k8s_label_selector,
                port=config.k8s_port,
                roles_by_model_label=roles,
            )
        if config.service_discovery == "external-only":  # no engine of its own: the providers only
            discovery = StaticDiscovery(())
            discovery.status.source = "external-only"
            return discovery
        return StaticDiscovery(config.static_backends, config.static_roles, _static_kinds(config))

    def reload(self, config: RouterConfig) -> None:
        """Apply a new configuration without dropping requests (in-flight ones keep the old objects).

        The scheduling is built first: a configuration whose plugins cannot be built (or whose
        log level is unknown) raises ``ConfigError`` and changes nothing. Plugin state (indexes)
        carries over to the new plugins. Every setting takes effect (the intervals from the next
        round, the thresholds and the connect timeout from the next outcome or connection) but those
        in :data:`RESTART_ONLY`, whose change is logged as a warning naming it.
        """
        catalog = self._catalog(config)
        static_kinds = _static_kinds(config)
        setup = self._build_scheduling(config)
        level = _log_level(config)
        old = self.config
        for name, why in RESTART_ONLY.items():
            if getattr(old, name) != getattr(config, name):
                log.warning("config: %s changed; it takes effect after a restart (%s)", name, why)
        if config.disaggregated and config.disagg_protocol == "lmcache" and self.pd_notifications is None:
            log.warning(
                "config: disaggregation with the lmcache protocol takes effect after a restart "
                "(its notification socket is bound at start); until then requests are served decode-only"
            )
        self._apply_runtime(config, setup)
        self.adapters.load_timeout = config.lora_load_timeout
        self.queue.max_per_model = config.queue_max_per_model
        self.queue.max_per_band = config.queue_max_per_band
        self.queue.tenants = config.tenants  # weights: for tenants that start waiting from now on
        self.adapters.set_catalog(catalog)
        self.catalog = catalog if catalog else None
        self.registry.set_static_models(self._static_models(config))
        self.registry.configure(**_registry_limits(config))
        self.scraper.interval = config.engine_scrape_interval
        self.pools.set_connect_timeout(config.connect_timeout)
        if config.log_level != old.log_level:
            logging.getLogger().setLevel(level)  # process-wide, as the command line set it at start
        if isinstance(self.discovery, StaticDiscovery) and config.service_discovery == "static":
            self.discovery.update(config.static_backends, config.static_roles, static_kinds)
        log.info("configuration reloaded (routing_logic=%s)", config.routing_logic)

    async def _watch_config(self, path: str, interval: float = 1.0) -> None:
        """Poll the YAML file's mtime; reload on change; keep the old config when the new one is bad."""
        last = _mtime(path)
        while True:
            await asyncio.sleep(interval)
            current = _mtime(path)
            if current == last:
                continue
            last = current
            try:
                read_yaml(path)
                self.reload(load_config(self._cli_settings, path))
            except ConfigError as exc:
                log.error("config reload rejected, keeping the running one: %s", exc)
            except Exception:  # noqa: BLE001 - a bug in a check must not end the watcher (later edits apply)
                log.exception("config reload failed, keeping the running one")

    # ---- engine fetchers (control plane, own connection pool) --------------------------------------
    def _engine_headers(self) -> dict[str, str]:
        return {"authorization": "Bearer " + self.engine_api_key} if self.engine_api_key else {}

    async def _fetch_models(self, engine: Engine) -> list[dict[str, Any]]:
        assert self.control_session is not None
        timeout = aiohttp.ClientTimeout(total=max(2.0, min(10.0, self.config.health_check_interval)))
        provider = self.external.by_url.get(engine.url)
        headers = self._engine_headers() if provider is None else provider.control_headers()
        tls = self.external.tls.get(engine.url)
        async with self.control_session.get(
            engine.url + engine.kind.models_path,
            headers=headers,
            timeout=timeout,
            **({"ssl": tls} if tls is not None else {}),
        ) as resp:
            if resp.status == 429 and provider is not None:
                # a provider over its rate limit answered: reachable, and it serves the models its file
                # names (its kind's are fixed), so it stays in rotation; its 429s reach clients as sent
                return []
            resp.raise_for_status()
            doc = await resp.json(content_type=None)
        data = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(data, list):
            raise ValueError("/v1/models answer has no data list")
        return data

    async def _fetch_kv_sources(self, engine: Engine) -> Any:  # noqa: ANN401 - the engine's JSON
        assert self.control_session is not None
        timeout = aiohttp.ClientTimeout(total=5.0)
        async with self.control_session.get(
            engine.url + engine.kind.kv_sources_path, headers=self._engine_headers(), timeout=timeout
        ) as resp:
            resp.raise_for_status()
            return await resp.json(content_type=None)

    async def _post_engine(self, engine: Engine, path: str, doc: dict[str, Any]) -> tuple[int, bytes]:
        """POST a JSON document to an engine (adapter loads and unloads)."""
        assert self.control_session is not None
        headers = {"content-type": "application/json", **self._engine_headers()}
        async with self.control_session.post(engine.url + path, json=doc, headers=headers) as resp:
            return resp.status, await resp.read()

    async def _call_engine(
        self, engine: Engine, method: str, path: str, params: Sequence[tuple[str, str]]
    ) -> tuple[int, bytes, str]:
        """One control call to an engine (the sleep endpoints): its status, body and content type."""
        assert self.control_session is not None
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout)
        async with self.control_session.request(
            method, engine.url + path, params=list(params), headers=self._engine_headers(), timeout=timeout
        ) as resp:
            return resp.status, await resp.read(), resp.headers.get("content-type", "application/json")

    async def _fetch_metrics(self, engine: Engine) -> str:
        assert self.control_session is not None
        # 1.5 intervals: two timed-out scrapes in a row (a hang, see EngineRegistry.engine_silent)
        # take about 3 s at the default interval.
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.config.engine_scrape_interval * 1.5))
        async with self.control_session.get(
            engine.url + engine.kind.metrics_path, headers=self._engine_headers(), timeout=timeout
        ) as resp:
            resp.raise_for_status()
            return await resp.text()

    # ---- lifecycle ---------------------------------------------------------------------------------
    def discovery_running(self) -> bool:
        task = self._discovery_task
        return task is not None and not task.done() and self.registry.snapshots_seen > 0

    async def start(self) -> None:
        config = self.config
        self.control_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=64, ssl=self.engine_tls if self.engine_tls is not None else True
            ),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._discovery_task = asyncio.ensure_future(self._run_discovery())
        self._tasks = [
            self._discovery_task,
            asyncio.ensure_future(self.registry.run_health_checks()),
            asyncio.ensure_future(self.scraper.run()),
            asyncio.ensure_future(self.kv_feed.run()),
        ]
        if config.config_file:
            self._tasks.append(
                asyncio.ensure_future(self._watch_config(config.config_file, config.config_watch_interval))
            )
        if self.pd_notifications is not None:
            self._tasks.append(asyncio.ensure_future(self.pd_notifications.run()))
        if config.ext_proc_port:
            from vllm_stack.epp.inference_objects import Objectives  # lazy: gRPC and Envoy's messages
            from vllm_stack.epp.limits import PickerLimits
            from vllm_stack.epp.server import PickerServer

            objectives = (
                Objectives(config.k8s_namespace, config.inference_pool)
                if config.inference_pool
                else Objectives()
            )
            self.picker_server = PickerServer(
                self,
                config.host,
                config.ext_proc_port,
                objectives,
                PickerLimits.of(config),
            )
            await self.picker_server.start()
        if self.batch is not None:
            await self.batch.start(self.engine_tls)

    async def _run_discovery(self) -> None:
        try:
            if self.config.inference_pool:
                await self._read_inference_pool()
            await self.discovery.run(with_providers(self.registry.apply_snapshot, self.external.providers))
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("discovery stopped")
            raise

    async def _read_inference_pool(self) -> None:
        """The engines are the InferencePool's pods: its selector and port, read until it can be."""
        from vllm_stack.epp.inference_objects import PoolError, read_pool

        config = self.config
        delay = 1.0
        while True:
            try:
                selector, port = await read_pool(config.k8s_namespace, config.inference_pool)
                break
            except (PoolError, OSError) as error:
                log.warning("%s; reading it again in %gs", error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        log.info("InferencePool %s: pods %r, port %d", config.inference_pool, selector, port)
        self.discovery.label_selector = selector  # type: ignore[attr-defined]
        self.discovery.port = port  # type: ignore[attr-defined]

    async def stop(self) -> None:
        if self.batch is not None:
            await self.batch.stop()
        if self.picker_server is not None:
            # The gateways' streams under way may run to their answers' ends within the whole grace:
            # each lasts as long as its answer (a stream of tokens), and a gateway that passes the
            # answer through its picker, as Envoy does, would fail the request whose stream is cut.
            # It follows the HTTP side's drain, which on a picker Pod (probes, scrapes) takes a second
            # or so; the kubelet's kill at the end of the Pod's grace period bounds the two together.
            await self.picker_server.stop(grace=self.config.shutdown_grace)
        if self.director.endpoint_picker is not None:
            await self.director.endpoint_picker.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.queue.close()
        await self.adapters.close()
        await self.sleep.close()
        await self.registry.close()
        self.pools.close()
        await self.plugin_state.close()
        if self.control_session is not None:
            await self.control_session.close()
        await self.rate_limiter.close()
        if self.tracer is not None:  # the spans still buffered go out (blocking: off the loop)
            await asyncio.to_thread(self.tracer.shutdown)

    # ---- ASGI ----------------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await routes.control(self, scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.start()
                except Exception as exc:  # noqa: BLE001 - reported to the server, which exits
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                with contextlib.suppress(Exception):
                    await self.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _build_tracer(
    config: RouterConfig,
    exporter: Any,  # noqa: ANN401
    endpoints: EndpointTable,
) -> RequestTracer | None:
    """The router's tracer, or None with tracing off (then OpenTelemetry is never imported)."""
    if not config.otlp_traces_endpoint and exporter is None:
        return None
    from vllm_stack.tracing.otel import RequestTracer, TracingSettings  # lazy: only with tracing on

    settings = TracingSettings(
        config.otlp_traces_endpoint or "",
        config.otlp_traces_protocol,
        config.otel_service_name,
        insecure=not config.otel_secure,
        sample_ratio=config.trace_sample_ratio,
    )
    return RequestTracer(settings, exporter, endpoints.operations)


def _external_providers(config: RouterConfig, environ: Mapping[str, str]) -> ExternalProviders:
    """The providers of ``--external-providers-config`` (none without it); ``ConfigError`` when the
    file cannot work, a key variable it names is unset among them."""
    if not config.external_providers_config:
        return ExternalProviders(())
    return ExternalProviders(
        load_providers(config.external_providers_config, environ), config.external_ca_file
    )


def _registry_limits(config: RouterConfig) -> dict[str, Any]:
    """The registry's thresholds and intervals (:meth:`EngineRegistry.configure`'s arguments); an
    engine's scraped figures count as unknown once older than three scrapes."""
    return {
        "failure_threshold": config.health_failure_threshold,
        "success_threshold": config.health_success_threshold,
        "breaker_failures": config.circuit_failure_threshold,
        "breaker_open_seconds": config.circuit_open_seconds,
        "stale_after": max(3 * config.engine_scrape_interval, 2.0),
        "check_interval": config.health_check_interval,
    }


def _log_level(config: RouterConfig) -> int:
    """``log_level`` as :mod:`logging`'s number (``ConfigError`` for a name it does not know)."""
    level = logging.getLevelNamesMapping().get(config.log_level.upper())
    if level is None:
        raise ConfigError(
            f"log_level {config.log_level!r} is not one of debug, info, warning, error, critical"
        )
    return level


def _root_path(root: str, endpoints: EndpointTable) -> str:
    """``root`` once no path the router serves lies under it: those would lose their own first segment
    (``/v1`` would turn ``/v1/models`` into ``/models``). A trailing ``/`` is taken away (``/vllm/`` is
    ``/vllm``, ``/`` is none), since the server strips the prefix only when a ``/`` follows it."""
    root = root.rstrip("/")
    for row in endpoints.rows:
        if root and (row.path == root or row.path.startswith(root + "/")):
            raise ConfigError(f"root_path {root!r} is the start of the router's own path {row.path}")
    return root


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _rate_limit_store(url: str | None, timeout: float) -> Any:  # noqa: ANN401 - a RedisBuckets, imported only with a URL
    """The rate limits' shared store at ``url`` (None: each replica its own buckets). The redis client is
    imported only here, when one is configured."""
    if not url:
        return None
    from vllm_stack.tenants.redis_store import RedisBuckets  # noqa: PLC0415 - only with a store

    return RedisBuckets(url, timeout)


def _build_batch(router: Router, config: RouterConfig) -> BatchRunner | None:
    """The Batch API's runner (its store opens at start), or None when it is off."""
    if not config.batch_api:
        return None
    settings = BatchSettings(
        Path(config.batch_dir),
        config.batch_database_url,
        config.batch_completion_window,
        config.batch_max_file_bytes,
        config.batch_concurrency,
        config.batch_lease_seconds,
        config.batch_reserve_slots,
        config.saturation_max_kv_cache_usage,
    )
    return BatchRunner(router, settings, router.metrics)


def _build_endpoint_picker(config: RouterConfig, metrics: RouterMetrics) -> Any:  # noqa: ANN401
    """Gateway mode's client of an external endpoint picker, or None (imported only when configured)."""
    if not config.endpoint_picker:
        return None
    from vllm_stack.director.endpoint_picker import EndpointPickerClient

    return EndpointPickerClient(
        config.endpoint_picker, config.endpoint_picker_timeout, config.endpoint_picker_fail_open, metrics
    )


def build_router(
    cli: Mapping[str, Any] | None = None,
    config_file: str | None = None,
    discovery: Discovery | None = None,
    environ: Mapping[str, str] | None = None,
    plugins: PluginRegistry | None = None,
    span_exporter: Any = None,  # noqa: ANN401 - an OpenTelemetry SpanExporter instead of OTLP (tests)
    endpoints: EndpointTable = ENDPOINTS,
) -> Router:
    """Load the configuration and assemble a router (``ConfigError`` when either fails)."""
    config = load_config(cli, config_file, environ)
    return Router(
        config,
        discovery=discovery,
        environ=environ,
        cli_settings=cli,
        plugins=plugins,
        span_exporter=span_exporter,
        endpoints=endpoints,
    )
