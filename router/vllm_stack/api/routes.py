"""The control endpoints' route table and their ASGI entry (everything that is not a proxied path).

Authentication applies to every path but the open ones; an unknown path is 404, a known one with the
wrong method 405. Refusals are raised as :class:`~vllm_stack.errors.RouterError` and written by the
server's connection (the one error writer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from vllm_stack.api import endpoints
from vllm_stack.api.http import Receive, Send
from vllm_stack.api.proxied import PROXIED_PATHS
from vllm_stack.api.state import RouterState
from vllm_stack.errors import RouterError

Handler = Callable[[RouterState, dict[str, Any], Receive, Send], Awaitable[None]]

GET_ROUTES: dict[str, Handler] = {
    "/health": endpoints.health,
    "/ready": endpoints.ready,
    "/version": endpoints.version,
    "/metrics": endpoints.metrics,
    "/engines": endpoints.engines,
    "/v1/models": endpoints.models,
}
POST_ROUTES: dict[str, Handler] = {
    "/v1/load_lora_adapter": endpoints.lora_fanout,
    "/v1/unload_lora_adapter": endpoints.lora_fanout,
}
OPEN_PATHS = frozenset({"/health", "/ready", "/version", "/metrics"})  # no API key needed
ADMIN_PATHS = frozenset(POST_ROUTES)  # an admin key, checked by the endpoint, instead of a client key


#: The Batch API's paths (vllm_stack.batch.api answers them; this layer only knows they exist).
BATCH_PATHS = ("/v1/files", "/v1/batches")


def is_batch_path(path: str) -> bool:
    return path in BATCH_PATHS or path.startswith(("/v1/files/", "/v1/batches/"))


def batch_off(path: str) -> RouterError:
    return RouterError(
        404, f"Unknown path {path}: the Batch API is off (router setting batch_api).", code="not_found"
    )


async def control(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Answer one control request (an ASGI ``http`` scope)."""
    path = scope["path"]
    method = scope["method"]
    if is_batch_path(path):
        if router.batch_endpoints is None:
            raise batch_off(path)
        if not router.auth.check(scope["headers"]):
            raise RouterError(401, "Invalid or missing API key.", code="invalid_api_key")
        await router.batch_endpoints(scope, receive, send)
        return
    routes = GET_ROUTES if method in ("GET", "HEAD") else POST_ROUTES if method == "POST" else {}
    handler = routes.get(path)
    if handler is None:
        if path in GET_ROUTES or path in POST_ROUTES or path in PROXIED_PATHS:
            raise RouterError(405, f"Method {method} not allowed on {path}.", code="method_not_allowed")
        raise RouterError(404, f"Unknown path {path}.", code="not_found")
    if path not in OPEN_PATHS and path not in ADMIN_PATHS and not router.auth.check(scope["headers"]):
        raise RouterError(401, "Invalid or missing API key.", code="invalid_api_key")
    await handler(router, scope, receive, send)
