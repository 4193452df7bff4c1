"""What can be refused from a request's head alone, before any byte of its body is read.

The server asks this (:meth:`vllm_stack.server.http1.ServerContext.check_head`) as soon as the head
is complete, so a client without a valid API key, or one asking for a path or method the router does
not serve, costs no body buffer (issue 29: keyless 32 MiB bodies were buffered whole before their
401), and ``Expect: 100-continue`` is answered 100 only once the head passed. The same rules as the
route table's (:mod:`.routes`) and the hot path's (:mod:`.proxied`), which then need not check again.
"""

from __future__ import annotations

from vllm_stack.api.endpoints import _check_admin  # the admin endpoints' own check, the one rule
from vllm_stack.api.proxied import PROXIED_PATHS, UNKNOWN_MODEL_LABEL
from vllm_stack.api.routes import (
    ADMIN_PATHS,
    GET_ROUTES,
    OPEN_PATHS,
    POST_ROUTES,
    batch_off,
    is_batch_path,
)
from vllm_stack.api.state import RouterState
from vllm_stack.errors import RouterError

_GET = frozenset({"GET", "HEAD"})
_ALLOW = {
    **{path: b"POST" for path in (*POST_ROUTES, *PROXIED_PATHS)},
    **{path: b"GET, HEAD" for path in GET_ROUTES},
}


def unauthorized() -> RouterError:
    return RouterError(401, "Invalid or missing API key.", code="invalid_api_key")


def not_allowed(path: str) -> RouterError:
    """The 405 of a known path (RFC 9110 15.5.6: with ``Allow``; the same words for HEAD as for GET)."""
    allow = _ALLOW[path]
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
    if method == "POST" and path in PROXIED_PATHS:  # the hot path: one set lookup, then the key
        if router.auth.check(headers):
            return None
        router.metrics.observe_request(UNKNOWN_MODEL_LABEL, "none", "401", 0.0)
        return unauthorized()
    if is_batch_path(path):  # the Batch API: its own methods, checked by its handler
        if router.batch_endpoints is None:
            return batch_off(path)
        return None if router.auth.check(headers) else unauthorized()
    routes = GET_ROUTES if method in _GET else POST_ROUTES if method == "POST" else {}
    if path not in routes:
        return (
            not_allowed(path)
            if path in _ALLOW
            else RouterError(404, f"Unknown path {path}.", code="not_found")
        )
    if path in OPEN_PATHS:
        return None
    if path in ADMIN_PATHS:
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
    if path in OPEN_PATHS:
        return b""
    return router.auth.holder(headers)
