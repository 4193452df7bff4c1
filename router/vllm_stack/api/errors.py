"""OpenAI-shaped error responses: ``{"error": {"message", "type", "param", "code"}}``.

Clients (the official SDKs included) parse this shape to raise typed exceptions, so every error the
router itself produces uses it, with the HTTP status the SDKs map to the right exception class.

Every such response also carries ``x-vllm-stack-error: <code>`` (:data:`ERROR_MARKER`), so "a 5xx
from the router itself" can be told apart from an engine's 5xx, which passes through unchanged and
never carries it (docs/contracts.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson

Send = Callable[[dict[str, Any]], Awaitable[None]]

#: The header on every error response the router writes itself; its value is the error's code.
ERROR_MARKER = b"x-vllm-stack-error"

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
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
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = list(headers)

    def body(self) -> bytes:
        return error_body(self.status, self.message, code=self.code, param=self.param)

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


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> bytes:
    """The JSON body of an OpenAI-style error."""
    return orjson.dumps(
        {
            "error": {
                "message": message,
                "type": _TYPES.get(status, "error"),
                "param": param,
                "code": code or status,
            }
        }
    )


def sse_error_event(message: str, code: str = "upstream_error") -> bytes:
    """An SSE event that ends a stream broken mid-way, so clients see an error instead of a silent cut."""
    payload = orjson.dumps(
        {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    )
    return b"data: " + payload + b"\n\n"


async def send_error(send: Send, error: RouterError, request_id: bytes | None = None) -> None:
    """Send ``error`` as a complete JSON response."""
    body = error.body()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (ERROR_MARKER, error.marker()),
        *error.headers,
    ]
    if request_id:
        headers.append((b"x-request-id", request_id))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
