"""What the API layer reads of the router, as a protocol: the API depends on this, not on the
application object that assembles everything (:class:`vllm_stack.app.Router` satisfies it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import aiohttp

from vllm_stack.api.auth import ApiKeyAuth
from vllm_stack.api.http import Receive, Send
from vllm_stack.api.parsing import BodyParser
from vllm_stack.api.priority import PriorityPolicy
from vllm_stack.config import RouterConfig
from vllm_stack.director.director import Director
from vllm_stack.endpoint_table import EndpointTable
from vllm_stack.engines.adapter_placement import AdapterPlacement
from vllm_stack.engines.adapters import AdapterCatalog
from vllm_stack.engines.discovery.base import Discovery
from vllm_stack.engines.registry import EngineRegistry
from vllm_stack.engines.sleep import SleepControl
from vllm_stack.metrics import RouterMetrics
from vllm_stack.scheduling.index.feed import KvEventFeed
from vllm_stack.tenants.declaration import TenantTable
from vllm_stack.tenants.identity import TenantIdentity


class BatchEndpoints(Protocol):
    """Answers a request of the Batch API's paths (the endpoint table's ``batch`` rows and below)."""

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None: ...


class RouterState(Protocol):
    config: RouterConfig
    endpoints: EndpointTable  # the paths it serves and what it does with each
    registry: EngineRegistry
    kv_feed: KvEventFeed  # the engines' KV events (readiness asks whether they are followed)
    metrics: RouterMetrics
    director: Director
    auth: ApiKeyAuth
    admin_auth: ApiKeyAuth  # keys that may load and unload adapters
    identity: TenantIdentity  # who sent a request (its tenant)
    tenants: TenantTable  # the declared tenants
    adapters: AdapterPlacement
    discovery: Discovery
    catalog: AdapterCatalog | None  # None when no adapter or weighted model name is configured
    parser: BodyParser
    priority: PriorityPolicy
    session_header: bytes
    request_drop: frozenset[bytes]  # request headers not sent upstream (hop-by-hop; traceparent when tracing)
    max_body_bytes: int
    engine_api_key: str | None
    external_aliases: Mapping[str, str]  # an external provider's alias -> its own id (empty: none)
    external_models: frozenset[str]  # the names external providers serve (they get their own key)
    control_session: aiohttp.ClientSession | None
    sleep: SleepControl  # the engines' sleep endpoints (vllm_stack.engines.sleep)
    batch_endpoints: BatchEndpoints | None  # the Batch API's (vllm_stack.batch.api); None: it is off

    def discovery_running(self) -> bool: ...

    def scheduling_description(self) -> Mapping[str, Any]: ...
