"""The floor under any Python router on this event loop: the smallest reverse proxy for the benchmark's
request, on bare asyncio protocols (uvloop + httptools).

Per request it does only what every router must: parse the client's request (httptools), read the
``model`` field of the JSON body (msgspec, one field), write the request to the engine on a pooled
keep-alive connection (one per request in flight), parse the engine's response (httptools) and forward
its status, headers and body, re-emitting the chunk framing. No routing, no metrics, no retries, no
timeouts, no request ids, no logging. The router's CPU per request minus this relay's is what all of
that, and the router's HTTP server, cost on top of the unavoidable socket and parsing work.

Correct enough to be measured, not to be deployed: pipelined client requests are queued and answered
in order; an engine that cannot be reached gets a 502; an engine that fails mid-response closes the
client connection; HTTP/1.0 clients, ``Expect: 100-continue`` and upgrades are not handled.

Usage: ``python benchmarks/router/floor_relay.py LISTEN_PORT UPSTREAM_PORT`` (both on 127.0.0.1).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
from http import HTTPStatus

import httptools
import msgspec
import uvloop

HOST = "127.0.0.1"
#: Request headers not forwarded (rewritten or hop-by-hop).
_DROP_REQUEST = frozenset(
    {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade"}
)
#: Response headers not forwarded (hop-by-hop; the framing is re-emitted).
_DROP_RESPONSE = frozenset({b"connection", b"keep-alive", b"transfer-encoding"})
_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}
_BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\n\r\n"
_MAX_PENDING = 16  # pipelined requests queued per client before its socket stops being read


class _Model(msgspec.Struct):
    model: str | None = None


_decode_model = msgspec.json.Decoder(_Model).decode


class Relay:
    """Shared state: where the engine is and the idle keep-alive connections to it."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.host_header = b"host: %s:%d\r\n" % (HOST.encode(), upstream_port)
        self.idle: list[Upstream] = []

    def send(self, client: Client, request: bytes) -> None:
        if self.idle:
            self.idle.pop().start(client, request)
        else:
            asyncio.get_running_loop().create_task(self._connect(client, request))

    async def _connect(self, client: Client, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, upstream = await loop.create_connection(lambda: Upstream(self), HOST, self.upstream_port)
        except OSError:
            client.upstream_failed()
            return
        upstream.start(client, request)


class Upstream(asyncio.Protocol):
    """One keep-alive connection to the engine; carries one request at a time."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: Client | None = None
        self.out: list[bytes] = []
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunked = True
        self.done = False
        self.reusable = False  # the engine keeps the connection open after this response

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def start(self, client: Client, request: bytes) -> None:
        if client.closed:  # the client left while this connection was being made
            self.relay.idle.append(self)
            return
        self.client = client
        client.upstream = self
        self.done = False
        self.transport.write(request)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()  # type: ignore[union-attr]  # connection_lost tells the client
            return
        client = self.client
        out = self.out
        if out and client is not None:
            if len(out) == 1:
                client.transport.write(out[0])  # type: ignore[union-attr]
            else:
                client.transport.writelines(out)  # type: ignore[union-attr]
            out.clear()
        if self.done:
            self.client = None
            if self.reusable:
                self.relay.idle.append(self)
            else:
                self.transport.close()  # type: ignore[union-attr]
            if client is not None:
                client.finish()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.relay.idle:
            self.relay.idle.remove(self)
        client, self.client = self.client, None
        if client is not None:
            client.upstream_failed()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.headers = []
        self.chunked = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        parts = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status]
        for name, value in self.headers:
            lname = name.lower()
            if lname in _DROP_RESPONSE:
                continue
            if lname == b"content-length":
                self.chunked = False
            parts += (name, b": ", value, b"\r\n")
        if status < 200 or status in (204, 304):
            self.chunked = False
        if self.chunked:
            parts.append(b"transfer-encoding: chunked\r\n")
        if self.client is not None and not self.client.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        self.out.append(b"".join(parts))
        if self.client is not None:
            self.client.answered = True

    def on_body(self, body: bytes) -> None:
        self.out.append(b"%x\r\n%b\r\n" % (len(body), body) if self.chunked else body)

    def on_message_complete(self) -> None:
        if self.chunked:
            self.out.append(b"0\r\n\r\n")
        self.done = True
        self.reusable = self.parser.should_keep_alive()  # only valid here, not after feed_data returns


class Client(asyncio.Protocol):
    """One client connection; its requests go to the engine one at a time, in order."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.upstream: Upstream | None = None  # the connection carrying the request in flight
        self.busy = False  # a request is in flight (its connection may still be being made)
        self.pending: collections.deque[tuple[bytes | None, bool]] = collections.deque()  # None: bad request
        self.keep_alive = True  # of the request in flight
        self.answered = False  # its response head has gone out
        self.closed = False
        self.stopped = False  # no more requests are read: after "connection: close" or a parse error
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.stopped:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # also an upgrade request, or data after "connection: close"
            if not self.stopped:
                self.stopped = True
                self.transport.pause_reading()  # type: ignore[union-attr]
                self._enqueue(None, False)  # a 400, after the answers to the requests before it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pending.clear()
        upstream, self.upstream = self.upstream, None
        if upstream is not None:  # mid-response: that connection cannot be reused
            upstream.client = None
            upstream.transport.close()  # type: ignore[union-attr]

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        if body:
            try:
                _decode_model(body)  # every router reads the model to route; this one ignores it
            except msgspec.DecodeError:
                pass  # forwarded as it is; the engine answers 400
        parts = [self.parser.get_method(), b" ", self.url, b" HTTP/1.1\r\n", self.relay.host_header]
        for name, value in self.headers:
            if name.lower() not in _DROP_REQUEST:
                parts += (name, b": ", value, b"\r\n")
        parts.append(b"content-length: %d\r\n\r\n" % len(body))
        parts.append(body)
        request = b"".join(parts)
        keep_alive = self.parser.should_keep_alive()
        if not keep_alive:
            self.stopped = True
        self._enqueue(request, keep_alive)

    def _enqueue(self, request: bytes | None, keep_alive: bool) -> None:
        if not self.busy:
            self._send(request, keep_alive)
            return
        self.pending.append((request, keep_alive))
        if len(self.pending) == _MAX_PENDING:
            self.transport.pause_reading()  # type: ignore[union-attr]

    def _send(self, request: bytes | None, keep_alive: bool) -> None:
        if request is None:
            self.transport.write(_BAD_REQUEST)  # type: ignore[union-attr]
            self.transport.close()  # type: ignore[union-attr]
            return
        self.busy = True
        self.keep_alive = keep_alive
        self.answered = False
        self.relay.send(self, request)

    def finish(self) -> None:
        """The engine's response is complete and forwarded."""
        self.upstream = None
        self.busy = False
        if not self.keep_alive:
            self.transport.close()  # type: ignore[union-attr]
        elif self.pending:
            if len(self.pending) == _MAX_PENDING and not self.stopped:
                self.transport.resume_reading()  # type: ignore[union-attr]
            self._send(*self.pending.popleft())

    def upstream_failed(self) -> None:
        """The engine could not be reached, or went away mid-response."""
        self.upstream = None
        if self.closed:
            return
        if self.answered:  # part of a response went out: the client must see it broken
            self.transport.close()  # type: ignore[union-attr]
            return
        self.transport.write(_BAD_GATEWAY)  # type: ignore[union-attr]
        self.finish()


async def serve(listen_port: int, upstream_port: int) -> None:
    relay = Relay(upstream_port)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(relay), HOST, listen_port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("listen_port", type=int)
    p.add_argument("upstream_port", type=int)
    args = p.parse_args()
    uvloop.run(serve(args.listen_port, args.upstream_port))


if __name__ == "__main__":
    main()
