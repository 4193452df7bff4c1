"""The control endpoints' ASGI entry (everything that is not a proxied path), routed by the router's
endpoint table (:mod:`vllm_stack.endpoint_table`: the paths, their methods and who may call them).

Authentication applies to every path but the open ones; an unknown path is 404, a known one with the
wrong method 405. Refusals are raised as :class:`~vllm_stack.errors.RouterError` and written by the
server's connection (the one error writer).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from vllm_stack.api import endpoints
from vllm_stack.api.http import Receive, Send
from vllm_stack.api.state import RouterState
from vllm_stack.endpoint_table import EndpointTable
from vllm_stack.errors import RouterError

Handler = Callable[[RouterState, dict[str, Any], Receive, Send], Awaitable[None]]
_NONE: Mapping[str, str] = {}


def handler(name: str) -> Handler:
    """The function of :mod:`vllm_stack.api.endpoints` a table row names (AttributeError: none)."""
    found: Handler = getattr(endpoints, name)
    return found


def route(table: EndpointTable, method: str, path: str) -> Handler | None:
    """The router's own endpoint for ``method path``, or None (a path of another kind, or another method)."""
    name = table.routes.get(method, _NONE).get(path)
    return handler(name) if name is not None else None


def batch_off(path: str) -> RouterError:
    return RouterError(
        404, f"Unknown path {path}: the Batch API is off (router setting batch_api).", code="not_found"
    )


async def control(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Answer one control request (an ASGI ``http`` scope)."""
    path = scope["path"]
    method = scope["method"]
    table = router.endpoints
    if table.is_batch(path):
        if router.batch_endpoints is None:
            raise batch_off(path)
        if not router.auth.check(scope["headers"]):
            raise RouterError(401, "Invalid or missing API key.", code="invalid_api_key")
        await router.batch_endpoints(scope, receive, send)
        return
    found = route(table, method, path)
    if found is None:
        if path in table.allow:  # the server asked api.head first, whose 405 carries Allow
            raise RouterError(405, f"Method {method} not allowed on {path}.", code="method_not_allowed")
        raise RouterError(404, f"Unknown path {path}.", code="not_found")
    if path in table.admin_if_keys:
        refused = endpoints.admin_if_keys_refusal(router, scope["headers"])
        if refused is not None:
            raise refused
    elif path not in table.open and path not in table.admin and not router.auth.check(scope["headers"]):
        raise RouterError(401, "Invalid or missing API key.", code="invalid_api_key")
    await found(router, scope, receive, send)
