"""Small raw-ASGI helpers: read a bounded body, send JSON."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from vllm_stack.errors import RouterError

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


async def read_body(receive: Receive, limit: int, content_length: bytes | None) -> bytes | None:
    """The whole request body, or None when the client disconnected first.

    Raises a 413 :class:`RouterError` as soon as the declared or received size passes ``limit``,
    without reading the rest.
    """
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise RouterError(400, "invalid Content-Length header", code="invalid_content_length") from None
        if declared > limit:
            raise RouterError(
                413,
                f"Request body of {declared} bytes exceeds the limit of {limit} bytes.",
                code="body_too_large",
            )
    message = await receive()
    if message["type"] != "http.request":
        return None
    body = message.get("body", b"")
    if not message.get("more_body", False):
        if len(body) > limit:
            raise RouterError(413, f"Request body exceeds the limit of {limit} bytes.", code="body_too_large")
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RouterError(413, f"Request body exceeds the limit of {limit} bytes.", code="body_too_large")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def read_json_object(
    receive: Receive, limit: int, headers: list[tuple[bytes, bytes]]
) -> dict[str, Any] | None:
    """The request body as a JSON object (400 ``invalid_json`` when it is not one; 413 past ``limit``), or
    None when the client disconnected first."""
    content_length = next((v for k, v in headers if k == b"content-length"), None)
    body = await read_body(receive, limit, content_length)
    if body is None:
        return None
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RouterError(400, f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict):
        raise RouterError(400, "The request body must be a JSON object.", code="invalid_json")
    return doc


async def send_json(
    send: Send, status: int, payload: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = orjson.dumps(payload)
    await send_bytes(send, status, body, b"application/json", headers)


async def send_bytes(
    send: Send,
    status: int,
    body: bytes,
    content_type: bytes,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    out = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if headers:
        out.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": out})
    await send({"type": "http.response.body", "body": body})
