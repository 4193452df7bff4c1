"""Assembles one router: its state objects, background tasks and the ASGI app of its control endpoints.

Everything a router needs lives on a :class:`Router` instance (registry, metrics registry, scheduler,
engine connection pools, tasks); nothing is module-global, so several routers can run in one process.
The proxied endpoints do not go through ASGI: :class:`vllm_stack.server.RouterServer` hands them to
the relay (:mod:`vllm_stack.api.proxied`), and everything else to this object as an ASGI app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from vllm_stack.api import endpoints
from vllm_stack.api.auth import ApiKeyAuth
from vllm_stack.api.errors import RouterError, send_error
from vllm_stack.api.http import Receive, Send
from vllm_stack.api.parsing import BodyParser, make_parser
from vllm_stack.api.proxied import PROXIED_PATHS
from vllm_stack.api.request_id import new_request_id
from vllm_stack.config import ConfigError, RouterConfig, load_config, read_yaml
from vllm_stack.discovery.base import Discovery
from vllm_stack.discovery.engine import Engine
from vllm_stack.discovery.registry import EngineRegistry
from vllm_stack.discovery.static import StaticDiscovery
from vllm_stack.metrics import RouterMetrics
from vllm_stack.relay.pool import EnginePools
from vllm_stack.scheduling.framework import Scheduler
from vllm_stack.scheduling.profiles import build_profile
from vllm_stack.telemetry.scraper import EngineScraper

log = logging.getLogger(__name__)

Handler = Callable[["Router", dict[str, Any], Receive, Send], Awaitable[None]]

_GET_ROUTES: dict[str, Handler] = {
    "/health": endpoints.health,
    "/ready": endpoints.ready,
    "/version": endpoints.version,
    "/metrics": endpoints.metrics,
    "/engines": endpoints.engines,
    "/v1/models": endpoints.models,
}
_POST_ROUTES: dict[str, Handler] = {
    "/v1/load_lora_adapter": endpoints.lora_fanout,
    "/v1/unload_lora_adapter": endpoints.lora_fanout,
}
_OPEN_PATHS = frozenset({"/health", "/ready", "/version", "/metrics"})  # no API key needed


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """What the relay reads per request; swapped as a whole on reload."""

    retries: int = 2
    request_timeout: float = 600.0
    engine_auth: bytes | None = None  # "Bearer <VLLM_API_KEY>" sent to engines


def _static_models(config: RouterConfig) -> dict[str, tuple[str, ...]]:
    if not config.static_models:
        return {}
    return {b.rstrip("/"): (m,) for b, m in zip(config.static_backends, config.static_models, strict=True)}


class Router:
    """One router instance. ``discovery`` may be injected (tests); otherwise built from the config."""

    def __init__(
        self,
        config: RouterConfig,
        discovery: Discovery | None = None,
        environ: Mapping[str, str] | None = None,
        cli_settings: Mapping[str, Any] | None = None,
    ) -> None:
        environ = os.environ if environ is None else environ
        self.config = config
        self._cli_settings = dict(cli_settings or {})
        self.engine_api_key = environ.get("VLLM_API_KEY") or None
        self.metrics = RouterMetrics()
        self.registry = EngineRegistry(
            self._fetch_models,
            self.metrics,
            failure_threshold=config.health_failure_threshold,
            success_threshold=config.health_success_threshold,
            breaker_failures=config.circuit_failure_threshold,
            breaker_open_seconds=config.circuit_open_seconds,
            stale_after=max(3 * config.engine_scrape_interval, 2.0),
            static_models=_static_models(config),
        )
        self.discovery: Discovery = discovery if discovery is not None else self._build_discovery(config)
        self.scraper = EngineScraper(
            self.registry.engines, self._fetch_metrics, self.metrics, liveness=self.registry
        )
        self._apply_runtime(config)
        # https engines: verified against the system's CAs, or against engine_ca_file when given.
        self.engine_tls = (
            ssl.create_default_context(cafile=config.engine_ca_file) if config.engine_ca_file else None
        )
        self.pools = EnginePools(config.connect_timeout, self.engine_tls)
        self.registry.on_engine_left.append(lambda engine: self.pools.forget(engine.url))
        self.control_session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._discovery_task: asyncio.Task[None] | None = None

    # ---- configuration ---------------------------------------------------------------------------
    def _apply_runtime(self, config: RouterConfig) -> None:
        """Settings that can change while running (hot reload): swapped as whole objects."""
        self.config = config
        self.scheduler = Scheduler(build_profile(config), self.metrics)
        self.parser: BodyParser = make_parser(config.json_parser, config.prefix_chars)
        self.auth = ApiKeyAuth(config.api_keys)
        self.max_body_bytes = config.max_body_bytes
        self.session_header = config.session_key.lower().encode("latin-1")
        self.proxy_settings = ProxySettings(
            config.retries,
            config.request_timeout,
            b"Bearer " + self.engine_api_key.encode() if self.engine_api_key else None,
        )

    @staticmethod
    def _build_discovery(config: RouterConfig) -> Discovery:
        if config.service_discovery == "k8s":
            from vllm_stack.discovery.kubernetes import KubernetesDiscovery  # lazy: optional heavy import

            return KubernetesDiscovery(
                namespace=config.k8s_namespace, label_selector=config.k8s_label_selector, port=config.k8s_port
            )
        return StaticDiscovery(config.static_backends)

    def reload(self, config: RouterConfig) -> None:
        """Apply a new configuration without dropping requests (in-flight ones keep the old objects)."""
        old = self.config
        for name in (
            "host",
            "port",
            "service_discovery",
            "k8s_namespace",
            "k8s_label_selector",
        ):
            if getattr(old, name) != getattr(config, name):
                log.warning("config: %s changed; it takes effect after a restart", name)
        self._apply_runtime(config)
        self.registry.static_models = _static_models(config)
        if isinstance(self.discovery, StaticDiscovery) and config.service_discovery == "static":
            self.discovery.update(config.static_backends)
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
                config = load_config(self._cli_settings, path)
            except ConfigError as exc:
                log.error("config reload rejected, keeping the running one: %s", exc)
                continue
            self.reload(config)

    # ---- engine fetchers (control plane, own connection pool) --------------------------------------
    def _engine_headers(self) -> dict[str, str]:
        return {"authorization": "Bearer " + self.engine_api_key} if self.engine_api_key else {}

    async def _fetch_models(self, engine: Engine) -> list[dict[str, Any]]:
        assert self.control_session is not None
        timeout = aiohttp.ClientTimeout(total=max(2.0, min(10.0, self.config.health_check_interval)))
        async with self.control_session.get(
            engine.url + "/v1/models", headers=self._engine_headers(), timeout=timeout
        ) as resp:
            resp.raise_for_status()
            doc = await resp.json(content_type=None)
        data = doc.get("data") if isinstance(doc, dict) else None
        if not isinstance(data, list):
            raise ValueError("/v1/models answer has no data list")
        return data

    async def _fetch_metrics(self, engine: Engine) -> str:
        assert self.control_session is not None
        # 1.5 intervals: two timed-out scrapes in a row (a hang, see EngineRegistry.engine_silent)
        # take about 3 s at the default interval.
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.config.engine_scrape_interval * 1.5))
        async with self.control_session.get(
            engine.url + "/metrics", headers=self._engine_headers(), timeout=timeout
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
            asyncio.ensure_future(self.registry.run_health_checks(config.health_check_interval)),
            asyncio.ensure_future(self.scraper.run(config.engine_scrape_interval)),
        ]
        if config.config_file:
            self._tasks.append(asyncio.ensure_future(self._watch_config(config.config_file)))

    async def _run_discovery(self) -> None:
        try:
            await self.discovery.run(self.registry.apply_snapshot)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("discovery stopped")
            raise

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await self.registry.close()
        self.pools.close()
        if self.control_session is not None:
            await self.control_session.close()

    # ---- ASGI ----------------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _http(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path = scope["path"]
        method = scope["method"]
        routes = _GET_ROUTES if method in ("GET", "HEAD") else _POST_ROUTES if method == "POST" else {}
        handler = routes.get(path)
        try:
            if handler is None:
                if path in _GET_ROUTES or path in _POST_ROUTES or path in PROXIED_PATHS:
                    raise RouterError(
                        405, f"Method {method} not allowed on {path}.", code="method_not_allowed"
                    )
                raise RouterError(404, f"Unknown path {path}.", code="not_found")
            if path not in _OPEN_PATHS and not self.auth.check(scope["headers"]):
                raise RouterError(401, "Invalid or missing API key.", code="invalid_api_key")
            await handler(self, scope, receive, send)
        except RouterError as err:
            await send_error(send, err, new_request_id())

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


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def build_router(
    cli: Mapping[str, Any] | None = None,
    config_file: str | None = None,
    discovery: Discovery | None = None,
    environ: Mapping[str, str] | None = None,
) -> Router:
    """Load the configuration and assemble a router (the ASGI app is the returned object)."""
    config = load_config(cli, config_file, environ)
    return Router(config, discovery=discovery, environ=environ, cli_settings=cli)
