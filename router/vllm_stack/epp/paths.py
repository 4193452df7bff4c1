"""Which gateway requests the endpoint picker names an engine for: the router's own notion of its paths.

The router relays POSTs to its proxied paths and answers its GET routes (``/v1/models``, ``/health``...;
the picker sends those to the least busy engine, which answers them too), both rows of its endpoint
table (:mod:`vllm_stack.endpoint_table`). Anything else the router answers itself or
refuses (404, 405 for a known path with another method); the picker, which can only name an engine,
gives the refusal as an ImmediateResponse, judged on the headers before any body is gathered, instead of
sending a path to an engine that no router would send there.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_stack.api.head import not_allowed, unauthorized
from vllm_stack.endpoint_table import EndpointTable
from vllm_stack.errors import RouterError

_NONE: frozenset[str] = frozenset()


def refusal(table: EndpointTable, headers: Sequence[tuple[str, str]]) -> RouterError | None:
    """The error for a request with these (lower-case) headers, or None when an engine may be picked
    (``table``: the router's endpoints)."""
    method = path = ""
    for name, value in headers:
        if name == ":method":
            method = value
        elif name == ":path":
            path = value.partition("?")[0]
    if path in table.proxied:
        return None if method == "POST" else not_allowed(table, path)
    if path in table.routes.get("GET", _NONE):
        return None if method in table.by_path[path].methods else not_allowed(table, path)
    if path in table.allow or table.is_batch(path):  # the router's own (adapters) or the Batch API
        return RouterError(
            404, f"{path} is served by the router itself, not through the endpoint picker.", code="not_found"
        )
    return RouterError(404, f"Unknown path {path}.", code="not_found")


def headerless(keys_required: bool) -> RouterError:
    """The answer to a body that came before any request headers: with client keys, the key check they
    would have carried failed (401); without, the protocol was not followed (400). Never a pick."""
    if keys_required:
        return unauthorized()
    return RouterError(400, "The request's body came before its headers.", code="headers_missing")
