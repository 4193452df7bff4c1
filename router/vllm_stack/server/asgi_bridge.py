"""Runs the router's ASGI app for one request that is not on the hot path.

An endpoint refuses a request by raising :class:`~vllm_stack.errors.RouterError`; the bridge has
the connection write it (:meth:`HttpConnection.send_error`), so every error the router answers goes
through one writer. The control endpoints (``/health``, ``/ready``, ``/metrics``, ``/engines``, ``/v1/models``, the LoRA
fan-out, 404/405 answers) are ordinary coroutines written against ASGI; they are few and cheap, so
they keep that well-known interface and run as a task each. The bridge maps the ASGI messages onto
the connection: ``content-length`` when the whole body comes in one message, chunked otherwise,
no body for HEAD, back-pressure through :meth:`HttpConnection.drain`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from vllm_stack.errors import RouterError, status_line
from vllm_stack.request_id import new_request_id
from vllm_stack.server.http1 import HttpConnection, HttpRequest

log = logging.getLogger(__name__)

AsgiApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


class AsgiCall:
    """One request handed to an ASGI app; also the connection's :class:`~.http1.Handler` meanwhile."""

    def __init__(self, app: AsgiApp, conn: HttpConnection, request: HttpRequest) -> None:
        self.app = app
        self.conn = conn
        self.request = request
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_written = False
        self.chunked = False
        self.complete = False
        self.body_given = False
        self.keep_alive = request.keep_alive
        self.gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.conn.handler = self
        self.task = asyncio.get_running_loop().create_task(self._run())

    def _scope(self) -> dict[str, Any]:
        request = self.request
        transport = self.conn.transport
        return {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.0" if request.http_10 else "1.1",
            "method": request.method,
            "scheme": "http",
            "path": request.path,
            "raw_path": request.target.partition(b"?")[0],
            "query_string": request.query,
            "root_path": "",
            "headers": request.headers,
            "client": _address(transport.get_extra_info("peername")),
            "server": _address(transport.get_extra_info("sockname")),
        }

    async def _run(self) -> None:
        try:
            await self.app(self._scope(), self._receive, self._send)
            self._unread_body()
        except RouterError as err:  # an endpoint's refusal: written by the connection, the one error writer
            self._unread_body()
            if not self.head_written and not self.conn.closed:
                self.conn.send_error(err, new_request_id(), self.keep_alive)
                return
            self.complete = False
        except Exception:  # noqa: BLE001 - a bug in an endpoint answers 500 and keeps the server up
            self._unread_body()
            log.exception("endpoint %s %s failed", self.request.method, self.request.path)
            if not self.head_written and not self.conn.closed:
                self.conn.send_error(
                    RouterError(500, "Internal router error.", code="internal_error"), None, False
                )
                return
            self.complete = False
        if self.conn.closed:
            self.conn.finish(False)
        elif self.complete:
            self.conn.finish(self.keep_alive)
        else:  # the app ended without finishing its answer: the connection cannot be reused
            self.conn.close()
            self.conn.finish(False)

    def _unread_body(self) -> None:
        """An answer given before a streamed body's end: the connection cannot carry another request."""
        stream = self.request.stream
        if stream is not None and not stream.ended:
            self.keep_alive = False

    async def _receive(self) -> dict[str, Any]:
        stream = self.request.stream
        if stream is not None:  # a body handed over as it arrives (raises the stream's error)
            data = await stream.read()
            if data is None:
                return {"type": "http.disconnect"}
            return {"type": "http.request", "body": data, "more_body": bool(data)}
        if not self.body_given:
            self.body_given = True
            return {"type": "http.request", "body": self.request.body, "more_body": False}
        await self.gone
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            return
        if kind != "http.response.body" or self.complete:
            return
        body: bytes = message.get("body", b"")
        more: bool = message.get("more_body", False)
        head_only = self.request.method == "HEAD"
        out: list[bytes] = []
        if not self.head_written:
            self.head_written = True
            out.append(self._head(None if more else len(body)))
        if head_only:
            body = b""
        if self.chunked:
            if body:
                out.append(b"%x\r\n%b\r\n" % (len(body), body))
            if not more:
                out.append(b"0\r\n\r\n")
        elif body:
            out.append(body)
        if not self.conn.closed and out:
            self.conn.transport.writelines(out)
        if not more:
            self.complete = True
        await self.conn.drain()

    def _head(self, length: int | None) -> bytes:
        parts = [status_line(self.status)]
        has_length = False
        for name, value in self.headers:
            if name.lower() == b"content-length":
                has_length = True
            parts += (name, b": ", value, b"\r\n")
        if not has_length:
            if length is not None:
                parts += (b"content-length: ", b"%d" % length, b"\r\n")
            elif self.request.http_10:
                self.keep_alive = False  # close-delimited body
            else:
                self.chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
        if not self.keep_alive or self.conn.server.draining:
            self.keep_alive = False
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    # Handler
    def client_lost(self) -> None:
        if not self.gone.done():
            self.gone.set_result(None)

    def pause(self) -> None:
        """Back-pressure reaches the app through :meth:`HttpConnection.drain` in ``_send``."""

    def resume(self) -> None:
        """See :meth:`pause`."""

    def check_timeout(self, now: float) -> None:
        """Control endpoints bound their own waits (their engine calls have timeouts); a streamed body
        must keep arriving."""
        stream = self.request.stream
        if stream is not None:
            stream.check_idle(now)


def _address(value: Any) -> list[Any] | None:
    if isinstance(value, tuple) and len(value) >= 2:
        return [value[0], value[1]]
    return None
