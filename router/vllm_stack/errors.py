"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}``, and the one
place that writes them (:func:`render_error`; the server's ``send_error`` and every path that answers an
error end there).

Clients (the official SDKs included) parse this shape to raise typed exceptions, so every error the
router itself produces uses it, with the HTTP status the SDKs map to the right exception class.

Every such response also carries ``x-vllm-stack-error: <code>`` (:data:`ERROR_MARKER`), so "a 5xx
from the router itself" can be told apart from an engine's 5xx, which passes through unchanged and
never carries it (docs/contracts.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from http import HTTPStatus

import orjson

#: The header on every error response the router writes itself; its value is the error's code.
ERROR_MARKER = b"x-vllm-stack-error"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
    501: "invalid_request_error",
    504: "timeout_error",
    505: "invalid_request_error",
}


class RouterError(Exception):
    """An error the router answers itself, before any byte of an upstream response was sent."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: Iterable[tuple[bytes, bytes]] = (),
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = list(headers)
        self.error_type = error_type  # the body's ``type`` when not the status's (see error_body)

    def body(self) -> bytes:
        return error_body(
            self.status, self.message, code=self.code, param=self.param, error_type=self.error_type
        )

    def marker(self) -> bytes:
        """The value of :data:`ERROR_MARKER`: the error's code (its status when it has none)."""
        return (self.code or str(self.status)).encode("latin-1")


def model_not_found(
    name: str, available: list[str], *, param: str = "model", what: str = "model"
) -> RouterError:
    """The 404 for a model (or base model) no engine serves, listing the ones that are."""
    return RouterError(
        404,
        f"The {what} '{name}' does not exist. Available models: {', '.join(available) or 'none'}.",
        param=param,
        code="model_not_found",
    )


def error_body(
    status: int,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    error_type: str | None = None,
) -> bytes:
    """The JSON body of an OpenAI-style error; ``type`` is the status's unless ``error_type`` says (a rate
    limit's is ``rate_limit_exceeded``, as OpenAI's)."""
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": error_type or _TYPES.get(status, "error"),
                "param": param,
                "code": code or status,
            }
        }
    )


def sse_error_event(message: str, code: str = "upstream_error", error_type: str = "upstream_error") -> bytes:
    """An SSE event that ends a stream broken mid-way, so clients see an error instead of a silent cut."""
    payload = orjson.dumps({"error": {"message": message, "type": error_type, "param": None, "code": code}})
    return b"data: " + payload + b"\n\n"


def no_healthy_engine(model: str) -> RouterError:
    """The 503 for a model that exists but has no engine able to take the request now."""
    return RouterError(
        503,
        f"No healthy engine is available for model '{model}'.",
        code="no_healthy_engine",
        headers=[(b"retry-after", b"1")],
    )


_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}


def status_line(status: int) -> bytes:
    """``HTTP/1.1 <status> <reason>`` and its CRLF (precomputed for the known statuses)."""
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status


_MARKER_PREFIX = b"\r\n" + ERROR_MARKER + b": "


def render_error(
    error: RouterError, request_id: bytes | None, keep_alive: bool, head_only: bool = False
) -> bytes:
    """The complete HTTP/1.1 response (head and JSON body) for ``error``; for a HEAD request
    (``head_only``) the same head, Content-Length included, and no body (RFC 9110 9.3.2)."""
    body = error.body()
    head = [
        status_line(error.status),
        b"content-type: application/json\r\ncontent-length: ",
        b"%d" % len(body),
        _MARKER_PREFIX,
        error.marker(),
    ]
    for name, value in error.headers:
        head += (b"\r\n", name, b": ", value)
    if request_id:
        head += (b"\r\nx-request-id: ", request_id)
    if not keep_alive:
        head.append(b"\r\nconnection: close")
    head += (b"\r\n\r\n", b"" if head_only else body)
    return b"".join(head)
