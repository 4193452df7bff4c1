"""What can be refused from a request's head alone, before any byte of its body is read.

The server asks this (:meth:`vllm_stack.server.http1.ServerContext.check_head`) as soon as the head
is complete, so a client without a valid API key, or one asking for a path or method the router does
not serve, costs no body buffer (issue 29: keyless 32 MiB bodies were buffered whole before their
401), and ``Expect: 100-continue`` is answered 100 only once the head passed. The same rules, from the
same endpoint table (:mod:`vllm_stack.endpoint_table`), as the control endpoints' (:mod:`.routes`)
and the hot path's (:mod:`.proxied`), which then need not check again.
"""

from __future__ import annotations

from vllm_stack.api.endpoints import _check_admin, admin_if_keys_refusal  # the admin endpoints' own rules
from vllm_stack.api.proxied import UNKNOWN_MODEL_LABEL
from vllm_stack.api.routes import batch_off
from vllm_stack.api.state import RouterState
from vllm_stack.endpoint_table import EndpointTable
from vllm_stack.errors import RouterError

_NONE: frozenset[str] = frozenset()


def unauthorized() -> RouterError:
    return RouterError(401, "Invalid or missing API key.", code="invalid_api_key")


def not_allowed(table: EndpointTable, path: str) -> RouterError:
    """The 405 of a known path (RFC 9110 15.5.6: with ``Allow``, the table's methods of that path; the
    same words for HEAD as for GET)."""
    allow = table.allow[path]
    return RouterError(
        405,
        f"{path} takes {allow.decode()} only.",
        code="method_not_allowed",
        headers=[(b"allow", allow)],
    )


def refusal(
    router: RouterState, method: str, path: str, headers: list[tuple[bytes, bytes]]
) -> RouterError | None:
    """The error to answer ``method path`` with before reading its body, or None to read it."""
    table = router.endpoints
    if method == "POST" and path in table.proxied:  # the hot path: one set lookup, then the key
        if router.auth.check(headers):
            return None
        router.metrics.observe_request(UNKNOWN_MODEL_LABEL, "none", "401", 0.0)
        return unauthorized()
    if table.is_batch(path):  # the Batch API: its own methods, checked by its handler
        if router.batch_endpoints is None:
            return batch_off(path)
        return None if router.auth.check(headers) else unauthorized()
    if path not in table.routes.get(method, _NONE):
        return (
            not_allowed(table, path)
            if path in table.allow
            else RouterError(404, f"Unknown path {path}.", code="not_found")
        )
    if path in table.open:
        return None
    if path in table.admin_if_keys:
        return admin_if_keys_refusal(router, headers)
    if path in table.admin:
        try:
            _check_admin(router, headers)
        except RouterError as err:
            return err
        return None
    return None if router.auth.check(headers) else unauthorized()


def body_holder(router: RouterState, path: str, headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """Whose share of the server's body budget (``max_body_share_per_key``) a request's body counts
    against, asked once :func:`refusal` let its head pass: the key it offered, which that check found
    valid on every path but the open ones, whose requests (keyless, or with any key) share one holder
    (b""), so made-up keys cannot multiply shares. Asked only with client keys on."""
    if path in router.endpoints.open:
        return b""
    return router.auth.holder(headers)
