"""The router's HTTP/1.1 server connection: one asyncio protocol per client connection.

Why not uvicorn: the router's hot path is a relay between two sockets. Behind an ASGI server every
streamed chunk costs a coroutine wake-up, an ASGI message dict and a separate socket write; the
benchmark (benchmarks/results/router.md) measured that server layer alone at more than the whole
CPU budget of a request. Here a request is parsed by httptools into an :class:`HttpRequest`, handed
to the server's dispatcher, and the handler writes to the socket directly; the relay forwards each
upstream read with one write and no task at all.

What the connection guarantees, whatever the handler:
- requests on one connection are answered in order (pipelined ones wait in a bounded queue, and
  reading pauses while it is full);
- a request is judged on its head before any byte of its body is read (:meth:`ServerContext.check_head`:
  a missing or wrong API key, an unknown path, a wrong method): a refused request's body is never
  buffered (a small one is read and dropped, so the connection is kept; a large one, or one that
  waits for ``100 Continue``, is answered at once and the connection closed);
- a body over the limit is refused with 413 as soon as its declared or received size passes it,
  without reading the rest; request lines and headers are bounded too (431);
- the bodies held by all connections together (arriving, queued behind a pipelined request, or of a
  request being answered) stay within the server's buffer budget (:class:`~.budget.BodyBudget`), and
  with client keys those of one key within its share of it: body bytes are counted as they arrive
  (a head alone holds nothing), and a request whose body would pass either bound gets 503 (429 for a
  key's share) with ``Retry-After``: mid-body, or at once when a large declared length cannot fit now.
  Refusing rather than pausing: bodies still arriving hold the budget, and pausing them all would
  wait forever;
- a body that sends no byte for the server's body timeout (:meth:`HttpConnection.check_reading`) gets
  408 and the connection is closed, so what a silent client holds is given back;
- ``Expect: 100-continue`` is answered when the request's turn comes, and only once its head passed;
- only the request head carries headers: chunked trailer fields are read and discarded, never
  merged into the head (a credential or routing header sent as a trailer would otherwise slip past
  any front proxy that checks headers), and bounded with the head (431 once they pass it, however
  long a field runs unterminated);
- memory is given back when a connection ends: the parser's reference to its connection (a cycle
  the collector would find only rarely) is cut, and a refused body is dropped at once;
- keep-alive follows the client (HTTP/1.0 and ``Connection: close`` end the connection after the
  answer); malformed input gets a 400 and the connection is closed, never a 500;
- the handler learns of a client that went away (:meth:`Handler.client_lost`) and of a slow reader
  (:meth:`Handler.pause` / :meth:`Handler.resume`), so no response is buffered without bound.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time
from typing import Protocol

import httptools

from vllm_stack.errors import RouterError, render_error
from vllm_stack.request_id import new_request_id, valid_request_id
from vllm_stack.server.body_stream import STREAM_HOLD, BodyStream
from vllm_stack.server.budget import BodyBudget

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024  # request line + headers
MAX_HEADERS = 256
#: Connections past the connection limit that may still reach the reserved (probe) paths, so a flood
#: of clients cannot fail the liveness probe; past this many more, a connection gets 503 at once.
RESERVED_CONNECTIONS = 64
RESERVED_WAIT = 0.5  # seconds such a connection may take to start its request; then it gets the 503
MAX_PIPELINED = 16  # parsed requests waiting behind the one being answered (and their bodies: one limit)
LINGER_SECONDS = 2.0  # after refusing a request mid-body: how long the rest is read and dropped
LINGER_BYTES = 64 * 1024 * 1024  # ... and at most how much of it
#: A request refused on its head with a body of at most this many bytes has the body read and
#: dropped (the connection is kept); a larger one is answered at once and the connection closed.
#: A larger declared body is also checked against the buffer budget on its head (see _check_room).
DISCARD_BYTES = 256 * 1024
#: A request (its head and body) still arriving after this many seconds gets 408, however it trickles.
REQUEST_READ_TIMEOUT = 300.0

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: Headers the connection itself acts on.
_NOTED = frozenset({b"content-length", b"expect", b"upgrade", b"host", b"transfer-encoding"})
#: RFC 9112 3.2: Host = uri-host [ ":" port ] (RFC 3986: an IP literal, or a reg-name, which an IPv4
#: address is too; a port of digits); empty is allowed. No userinfo, no path.
_valid_host = re.compile(rb"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~%!$&'()*+,;=]*)(?::[0-9]*)?").fullmatch
_DECLINED_OFFER = frozenset({b"upgrade", b"connection", b"http2-settings"})


class HttpRequest:
    """One complete request as received (header names lower-cased, body whole and bounded)."""

    __slots__ = (
        "method",
        "target",
        "path",
        "query",
        "headers",
        "body",
        "keep_alive",
        "http_10",
        "expect",
        "refusal",
        "stream",
        "holder",
    )

    def __init__(
        self,
        method: str,
        target: tuple[bytes, str, bytes],
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        http_10: bool,
        expect: bool,
        refusal: RouterError | None = None,
        holder: bytes | None = None,
    ) -> None:
        self.method = method
        # the request target as :func:`split_target` gives it: path and query, the path alone, the query
        self.target, self.path, self.query = target
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http_10 = http_10
        self.expect = expect
        self.refusal = refusal  # refused on its head (its body was dropped): answered with this error
        # a body handed over as it arrives (ServerContext.body_stream_limit), ``body`` then empty
        self.stream: BodyStream | None = None
        self.holder = holder  # whose share of the buffer budget the body counts against (body_holder)


def split_target(target: bytes) -> tuple[bytes, str, bytes]:
    """The request target as routed: path and query, the path (text), the query. Of an absolute-form
    target (RFC 9112 3.2.2) only the path and query route."""
    path, _, query = target.partition(b"?")
    if path[:1] != b"/" and b"://" in path:
        path = b"/" + path.partition(b"://")[2].partition(b"/")[2]
        target = path + (b"?" + query if query else b"")
    return target, path.decode("latin-1"), query


def strip_root(target: tuple[bytes, str, bytes], root: str) -> tuple[bytes, str, bytes]:
    """``target`` (as :func:`split_target` gives it) without the leading ``root`` (a path prefix such as
    ``/vllm``, production-stack's ``--root-path``) when its path is ``root`` or under it; any other
    target unchanged, so a router behind an ingress that strips the prefix and one behind an ingress
    that keeps it serve the same paths."""
    whole, path, query = target
    n = len(root)
    if path.startswith(root) and (len(path) == n or path[n] == "/"):
        rest = whole[n:]
        return (rest if rest[:1] == b"/" else b"/" + rest), path[n:] or "/", query
    return target


class Handler(Protocol):
    """What the connection tells the object answering its current request."""

    def client_lost(self) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def check_timeout(self, now: float) -> None: ...


class ServerContext(Protocol):
    """What a connection needs from its server."""

    connections: set[HttpConnection]
    draining: bool
    reserved_paths: frozenset[str]  # answered even on a connection past the limit (probes)
    root_path: str  # a path prefix taken off every request target under it ("": none; strip_root)
    budget: BodyBudget  # the request body bytes all connections hold together, and each key's
    stream_paths: frozenset[str]  # paths whose bodies may be streamed (body_stream_limit is asked then)

    def body_limit(self) -> int: ...

    def body_timeout(self) -> float:
        """Seconds a request body may send nothing; then 408 and close."""
        ...

    def check_head(self, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> RouterError | None:
        """The refusal of a request judged on its head alone (before its body is read), or None."""
        ...

    def body_holder(self, path: str, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """Whose share of the budget a request's body counts against (its client key), asked once the
        head passed :meth:`check_head`; None: the total alone bounds it (client keys off)."""
        ...

    def body_stream_limit(self, method: str, path: str) -> int:
        """For a request whose body is not to be buffered whole (a batch file upload, written to disk
        as it arrives): the most bytes that body may have. 0: buffer it, within ``body_limit``."""
        ...

    def connection_limit(self) -> int: ...

    def dispatch(self, conn: HttpConnection, request: HttpRequest) -> None: ...


class _Reject(Exception):
    """Stops parsing from inside a parser callback; the connection answers ``error`` and closes."""

    def __init__(self, error: RouterError) -> None:
        super().__init__(error.message)
        self.error = error


class HttpConnection(asyncio.Protocol):
    """One client connection. ``transport`` is public: handlers write responses to it directly."""

    __slots__ = (
        "server",
        "transport",
        "parser",
        "closed",
        "handler",
        "busy",
        "queue",
        "idle_since",
        "head_started",
        "_url",
        "_headers",
        "_head_bytes",
        "_body",
        "_body_size",
        "_limit",
        "_expect",
        "_reading_paused",
        "_queued_bytes",
        "writing_paused",
        "_drain_waiters",
        "_lingering",
        "_upgrade_offer",
        "_declined_head",
        "_declared",
        "_head_done",
        "_head_raw",
        "_in_chunks",
        "_hosts",
        "_codings",
        "_target",
        "_method",
        "_reserved",
        "_holder",
        "_current",
        "_current_holder",
        "_seen",
        "_seen_at",
        "_refusal",
        "_pending_error",
        "restricted",
        "answering_head",
        "_stream",
    )

    def __init__(self, server: ServerContext) -> None:
        self.server = server
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.handler: Handler | None = None
        self.busy = False  # a request is being answered
        self.queue: collections.deque[HttpRequest] = collections.deque()
        self.idle_since = time.monotonic()  # 0.0 while a request is being read or answered
        self.head_started = 0.0  # when the current request's first byte arrived (slow-client timeout)
        self._reading_paused = False
        self._queued_bytes = 0
        self.writing_paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._lingering = -1  # >= 0: closing, dropping what the client still sends (bytes so far)
        self._declined_head = b""  # a request head to parse again without its upgrade offer
        # malformed input behind requests still answered, with the request id to answer it under
        # and whether it was a HEAD request
        self._pending_error: tuple[RouterError, bytes, bool] | None = None
        self.restricted = False  # past the connection limit: only the reserved paths are answered
        self.answering_head = False  # the request being answered is a HEAD one: no body in the answer
        self._reserved = 0  # buffer budget held for the body being received (see _reserve)
        self._holder: bytes | None = None  # ... and whose it is (ServerContext.body_holder)
        self._current = 0  # ... and by the body of the request being answered
        self._current_holder: bytes | None = None
        # a request being read as the last sweep saw it (its head's start, body bytes), and since when
        self._seen = (0.0, -1)
        self._seen_at = 0.0
        self._stream: BodyStream | None = None  # the body being handed over as it arrives
        self._begin()

    def _begin(self) -> None:
        if self._reserved:  # a body given up half-way (refused, or its connection gone)
            self.server.budget.give(self._reserved, self._holder)
            self._reserved = 0
        self._refusal: RouterError | None = None
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_size = 0
        self._limit = 0
        self._expect = False
        self._upgrade_offer = False
        self._declared: bytes | None = None
        self._head_done = False  # headers complete: header callbacks from here on are trailers
        self._hosts = 0  # Host headers seen
        self._codings: bytes | None = None  # the Transfer-Encoding field values, combined
        self._head_raw = 0  # bytes of reads that carried only an unfinished head or trailer (data_received)
        self._in_chunks = False  # a chunked body is being read (its trailer fields may follow)

    # ---- asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        connections = self.server.connections
        limit = self.server.connection_limit()
        if len(connections) >= limit + RESERVED_CONNECTIONS:  # bounded memory under a connection flood
            self.busy = True
            self.send_error(_too_many_connections(), new_request_id(), keep_alive=False)
            return
        connections.add(self)
        if len(connections) > limit:  # probes still get through (see RESERVED_CONNECTIONS)
            self.restricted = True
            asyncio.get_running_loop().call_later(RESERVED_WAIT, self._refuse_if_idle)

    def data_received(self, data: bytes) -> None:
        if self._lingering >= 0:
            self._lingering += len(data)
            if self._lingering > LINGER_BYTES:
                self.transport.close()
            return
        in_head = self.head_started and not self._head_done
        in_chunks = self._in_chunks
        if in_chunks:
            body_before = self._body_size
        try:
            self.parser.feed_data(data)
            if in_head and self.head_started and not self._head_done:
                # httptools buffers an unfinished header line whole before any callback can count
                # it, so reads that carried nothing but an unfinished head are counted here.
                self._head_raw += len(data)
                if self._head_raw > MAX_HEAD_BYTES:
                    self._fail(RouterError(431, "Request headers too large.", code="headers_too_large"))
            elif in_chunks and self._in_chunks:
                # The same for a trailer field (after the last chunk) and for chunk framing alone:
                # reads of a chunked body that brought no body bytes are bounded like a head.
                if self._body_size != body_before:
                    self._head_raw = 0
                else:
                    self._head_raw += len(data)
                    if self._head_raw > MAX_HEAD_BYTES:
                        self._fail(
                            RouterError(431, "Request trailer fields too large.", code="headers_too_large")
                        )
        except httptools.HttpParserUpgrade as exc:
            # An offer to switch protocols (h2c from `curl --http2`, websocket). httptools stops at the
            # end of the head, before any body; the offer is declined (RFC 9110 7.8) by parsing the
            # same request again without it, so its body is read and it is answered over HTTP/1.1.
            self.parser = httptools.HttpRequestParser(self)
            offset = exc.args[0] if exc.args and isinstance(exc.args[0], int) else len(data)
            head, self._declined_head = self._declined_head, b""
            rest = head + data[offset:]
            if rest:
                self.data_received(rest)
        except httptools.HttpParserCallbackError as exc:
            # No local may hold the _Reject: its traceback reaches this frame (through the callback's
            # frame), and the cycle would keep this connection and ``data`` alive until a full collection.
            error = exc.__context__.error if isinstance(exc.__context__, _Reject) else None
            if error is not None:
                self._fail(error)
            else:
                log.exception("request parsing failed")
                self._fail(RouterError(400, "Malformed HTTP request.", code="bad_request"))
        except httptools.HttpParserError as exc:
            self._fail(RouterError(400, f"Malformed HTTP request: {exc}", code="bad_request"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        self._drop_queue()
        if self._current:
            self.server.budget.give(self._current, self._current_holder)
            self._current = 0
        if self._stream is not None:
            self._stream.lost()
            self._stream = None
        # The parser holds this protocol (a reference cycle): cut it, with what a request left behind,
        # so the memory goes back now rather than at a rare full collection.
        self.parser = None  # type: ignore[assignment]
        self._begin()
        self._declined_head = b""
        handler = self.handler
        if handler is not None:
            self.handler = None
            handler.client_lost()
        self._wake_drainers()

    def pause_writing(self) -> None:
        self.writing_paused = True
        if self.handler is not None:
            self.handler.pause()

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.handler is not None:
            self.handler.resume()
        self._wake_drainers()

    def _wake_drainers(self) -> None:
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    async def drain(self) -> None:
        """Wait while the client reads slower than the response is written (for coroutine handlers)."""
        if self.writing_paused and not self.closed:
            waiter = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(waiter)
            await waiter

    # ---- httptools callbacks ------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._begin()
        self.idle_since = 0.0
        self.head_started = time.monotonic()

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _Reject(RouterError(414, "Request line too long.", code="uri_too_long"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _Reject(RouterError(431, "Request headers too large.", code="headers_too_large"))
        if self._head_done:  # a chunked trailer field: read, bounded, and dropped (RFC 9112 7.1.2)
            return
        name = name.lower()
        if name in _NOTED:
            if name == b"content-length":
                self._declared = value
            elif name == b"expect":
                self._expect = value.lower() == b"100-continue"
            elif name == b"host":
                self._hosts += 1
                if not _valid_host(value):
                    raise _Reject(RouterError(400, "Invalid Host header.", code="bad_request"))
            elif name == b"transfer-encoding":
                self._codings = value if self._codings is None else self._codings + b"," + value
            else:
                self._upgrade_offer = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._head_done = True
        version = self.parser.get_http_version()
        if version[:2] != "1.":  # RFC 9110 15.6.6: a major version this server does not speak
            raise _Reject(
                RouterError(505, f"HTTP/{version} is not supported.", code="http_version_not_supported")
            )
        if len(self._headers) > MAX_HEADERS:  # counted once here: MAX_HEAD_BYTES bounds them meanwhile
            raise _Reject(RouterError(431, "Too many request headers.", code="headers_too_large"))
        if self._codings is not None:
            _check_codings(self._codings)
        if self._hosts != 1 and version != "1.0":
            raise _Reject(  # RFC 9112 3.2: an HTTP/1.1 request has exactly one Host
                RouterError(400, "An HTTP/1.1 request needs exactly one Host header.", code="bad_request")
            )
        self._in_chunks = self._declared is None  # no length: chunked, or no body at all (completes now)
        self._head_raw = 0
        declared = 0
        if self._declared is not None:
            try:
                declared = int(self._declared)
            except ValueError:
                raise _Reject(
                    RouterError(400, "Invalid Content-Length header.", code="invalid_content_length")
                ) from None
        server = self.server
        method = self._method = self.parser.get_method().decode("latin-1")
        target = split_target(self._url)
        if server.root_path:
            target = strip_root(target, server.root_path)
        self._target = target
        refusal = server.check_head(method, target[1], self._headers)
        if refusal is not None:
            self._refuse(refusal, declared)
            return
        self._holder = server.body_holder(target[1], self._headers)
        if target[1] in server.stream_paths and not self.busy and not self._upgrade_offer:
            stream_limit = server.body_stream_limit(method, target[1])
            if stream_limit:
                if declared > stream_limit:
                    raise _Reject(_too_large(stream_limit, declared))
                self._open_stream(stream_limit)
                return
        limit = self._limit = server.body_limit()
        if declared:
            if declared > limit:
                raise _Reject(_too_large(limit, declared))
            if declared > DISCARD_BYTES:
                self._check_room(declared)
        if self._expect and not self.busy and not self.queue:
            self._expect = False
            self.transport.write(_CONTINUE)

    def _open_stream(self, limit: int) -> None:
        """Start answering the request now and hand its body over as it arrives (see
        :mod:`.body_stream`); what the stream holds (``STREAM_HOLD``: its window, the piece being handled
        and the handler's own bytes) is taken from the buffer budget until the answer ends.
        Only on an idle connection: behind a pipelined request the body is buffered as any other."""
        self._reserve(STREAM_HOLD)
        self._reserved = 0  # the request holds it now (see _start and finish)
        parser = self.parser
        request = HttpRequest(
            self._method,
            self._target,
            self._headers,
            b"",
            parser.should_keep_alive(),
            parser.get_http_version() == "1.0",
            self._expect,
        )
        request.holder = self._holder
        request.stream = self._stream = BodyStream(self.transport, limit, self.server.body_timeout())
        self._expect = False
        self.head_started = 0.0  # the stream's idle timeout applies, not the whole-request one
        self._start(request)

    def _refuse(self, refusal: RouterError, declared: int) -> None:
        """A request refused on its head: its body is dropped as it arrives, never buffered.

        A small one is read to its end, so the connection stays usable (the error is answered in
        turn); one declared larger, or one that waits for ``100 Continue`` (whose client may never
        send the body), is answered now and the connection closed (as Go's net/http and nginx do)."""
        if declared > DISCARD_BYTES or (self._expect and (declared or self._in_chunks)):
            raise _Reject(refusal)
        self._refusal = refusal
        self._expect = False

    def _check_room(self, declared: int) -> None:
        """A large declared body that cannot fit the budget now is refused on its head, so its client
        need not send it (nothing is taken here: its bytes are, as they arrive)."""
        refusal = self.server.budget.refusal(declared, self._holder)
        if refusal is not None:
            raise _Reject(refusal)

    def _reserve(self, size: int) -> None:
        """Take ``size`` more bytes of the buffer budget for the body being received, or refuse it."""
        refusal = self.server.budget.take(size, self._holder)
        if refusal is not None:
            raise _Reject(refusal)
        self._reserved += size

    def on_body(self, body: bytes) -> None:
        if self._stream is not None:
            self._body_size += len(body)  # (data_received tells body bytes from chunk framing by it)
            self._stream.feed(body)
            return
        n = len(body)
        size = self._body_size = self._body_size + n
        if size > self._limit and not self._over_limit(size):  # a refused request's body: limit 0
            return
        refusal = self.server.budget.take(n, self._holder)  # as it arrives (_reserve, inlined)
        if refusal is not None:
            raise _Reject(refusal)
        self._reserved += n
        self._body.append(body)

    def _over_limit(self, size: int) -> bool:
        """A body past its limit: a refused request's (limit 0), dropped (False) up to DISCARD_BYTES,
        or one too large (a chunked one: a declared length was checked on the head), refused."""
        if self._refusal is not None:
            if size > DISCARD_BYTES:
                raise _Reject(self._refusal)
            return False
        raise _Reject(_too_large(self._limit))

    def on_message_complete(self) -> None:
        stream = self._stream
        if stream is not None:  # its request is being answered already
            self._stream = None
            self._in_chunks = False
            stream.end()
            if stream.paused:  # the connection keeps the socket paused: finish() resumes it
                stream.paused = False
                self._reading_paused = True
            return
        parser = self.parser
        if self._upgrade_offer and parser.should_upgrade():
            # An offer httptools acts on (``Connection: upgrade`` too): see data_received, this
            # request is parsed again without it. A bare ``Upgrade`` header is no offer (RFC 9110
            # 7.8) and the request is answered as it is.
            version = b"HTTP/1.0" if parser.get_http_version() == "1.0" else b"HTTP/1.1"
            head = [parser.get_method(), b" ", self._url, b" ", version, b"\r\n"]
            for name, value in self._headers:
                if name not in _DECLINED_OFFER:
                    head += (name, b": ", value, b"\r\n")
            head.append(b"\r\n")
            self._declined_head = b"".join(head)
            self._begin()
            return
        self._in_chunks = False
        parts = self._body
        request = HttpRequest(
            self._method,
            self._target,
            self._headers,
            parts[0] if len(parts) == 1 else b"".join(parts),
            parser.should_keep_alive(),
            parser.get_http_version() == "1.0",
            self._expect,
            self._refusal,
            self._holder,
        )
        self._body = []
        self.head_started = 0.0
        if self.closed:  # its reservation goes with the connection (connection_lost)
            return
        self._reserved = 0  # the request's body holds it now (queued or answered: see finish)
        if self.busy:
            self.queue.append(request)
            self._queued_bytes += len(request.body)
            if self._queue_full() and not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()
        else:
            self._start(request)

    # ---- request lifecycle ----------------------------------------------------------------------------
    def _start(self, request: HttpRequest) -> None:
        if self.closed:
            return
        self.busy = True
        self.idle_since = 0.0
        self._current = len(request.body) if request.stream is None else STREAM_HOLD
        self._current_holder = request.holder
        self.answering_head = request.method == "HEAD"
        if self.restricted:  # past the connection limit: a probe is answered, then the connection closed
            if request.path not in self.server.reserved_paths:
                self.send_error(_too_many_connections(), new_request_id(), keep_alive=False)
                return
            request.keep_alive = False
        if request.refusal is not None:
            self.send_error(request.refusal, _client_request_id(request.headers), request.keep_alive)
            return
        if request.expect:
            self.transport.write(_CONTINUE)
        try:
            self.server.dispatch(self, request)
        except Exception:  # a bug in a handler must not take the connection's other requests down
            log.exception("request dispatch failed")
            if self.busy and self.handler is None:
                self.send_error(
                    RouterError(500, "Internal router error.", code="internal_error"), None, False
                )

    def check_reading(self, now: float, head_limit: float, body_limit: float) -> None:
        """A request still arriving too slowly gets 408 and the connection is closed (RFC 9110
        15.5.9), and so gives back what its body held: a head not whole ``head_limit`` seconds after
        its first byte (slowloris), a body that sent no byte for ``body_limit`` seconds, or any request
        still arriving after :data:`REQUEST_READ_TIMEOUT`. Asked by the server's sweep (``now``:
        ``time.monotonic()``), which samples a body's progress, so reading a body keeps no clock."""
        started = self.head_started
        if not started or self.closed or self._pending_error is not None:
            return
        if now - started > REQUEST_READ_TIMEOUT:
            self._fail(_request_timeout(f"The request took over {REQUEST_READ_TIMEOUT:g}s to arrive."))
        elif not self._head_done:
            if now - started > head_limit:
                self._fail(_request_timeout("The request head took too long to arrive."))
        elif self._expect:  # its client waits for the 100 Continue this connection still owes it
            return
        elif (started, self._body_size) != self._seen:
            self._seen = (started, self._body_size)
            self._seen_at = now
        elif now - self._seen_at > body_limit:
            self._fail(_request_timeout(f"No request body byte arrived for {body_limit:g}s."))

    def _refuse_if_idle(self) -> None:
        """A connection past the limit that has not started a request by now gets the 503."""
        if not self.closed and not self.busy and not self.head_started:
            self.busy = True
            self.send_error(_too_many_connections(), new_request_id(), keep_alive=False)

    def finish(self, keep_alive: bool) -> None:
        """The current response was completely written: answer the next request or close."""
        self.handler = None
        self.busy = False
        if self._current:  # its body's share of the buffer budget is given back
            if self._current_holder is None:  # (BodyBudget.give without a holder, inlined)
                self.server.budget.held -= self._current
            else:
                self.server.budget.give(self._current, self._current_holder)
            self._current = 0
        if self.closed:
            return
        # ``keep_alive``: what the answer's head told the client. An answer begun before the server started
        # draining promised keep-alive: the client may send its next request at once, so the connection
        # stays open as an idle one, which the drain closes after ``drain_idle`` (RouterServer.stop); that
        # request is answered with `connection: close`.
        if not keep_alive:
            self.close()
            return
        self.idle_since = time.monotonic()
        if not self.queue and self._pending_error is not None:  # what followed the last good request
            (error, request_id, self.answering_head), self._pending_error = self._pending_error, None
            self.busy = True
            self.send_error(error, request_id, keep_alive=False)
            return
        if self.queue:
            request = self.queue.popleft()
            self._queued_bytes -= len(request.body)
            self._start(request)
            paused = self._reading_paused and self._pending_error is None
            if paused and not self._queue_full() and not self.closed:
                self._reading_paused = False
                self.transport.resume_reading()
        elif self._reading_paused and self._pending_error is None:  # a streamed body's pause, handed over
            self._reading_paused = False
            self.transport.resume_reading()

    def _drop_queue(self) -> None:
        """Pipelined requests that will not be answered: their bodies' budget is given back."""
        budget = self.server.budget
        for request in self.queue:
            if request.body:
                budget.give(len(request.body), request.holder)
        self.queue.clear()
        self._queued_bytes = 0

    def _queue_full(self) -> bool:
        """Pipelined requests wait within bounds: a count, and their bodies within one body limit."""
        return len(self.queue) >= MAX_PIPELINED or self._queued_bytes >= self.server.body_limit()

    def send_error(self, error: RouterError, request_id: bytes | None, keep_alive: bool) -> None:
        """Answer the current request with an OpenAI-style JSON error and finish it."""
        keep_alive = keep_alive and not self.server.draining
        if not self.closed:
            self.transport.write(render_error(error, request_id, keep_alive, self.answering_head))
        self.finish(keep_alive)

    def _fail(self, error: RouterError) -> None:
        """Malformed or refused input: answer it and close.

        Complete requests read before it (pipelined) are still answered, in order; the error comes
        after them, and nothing more is read meanwhile.
        """
        # the request line was read (a head too large, a body refused): a HEAD one gets no body
        head = bool(self._url) and self.parser.get_method() == b"HEAD"
        self.parser = httptools.HttpRequestParser(self)  # the old one is in an error state
        request_id = _client_request_id(self._headers)  # the head may be whole (413): keep its id
        self._begin()  # a refused body is not kept
        if self._stream is not None:  # its handler answers the error; the rest is dropped, then closed
            self._stream.abort(error)
            self._stream = None
            self._lingering = 0
            return
        if self.closed:
            return
        if self.busy:  # earlier requests are being answered: the error waits for its turn
            self._pending_error = (error, request_id, head)
            if not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()
            return
        self._drop_queue()
        self.busy = True
        self.answering_head = head
        self.send_error(error, request_id, keep_alive=False)

    def close(self) -> None:
        """Close after what was written is flushed; nothing is written or dispatched after this.

        If the client is still sending a request (a refused body), the connection is half-closed and
        what arrives is read and dropped for a moment: closing a socket with unread data makes the
        kernel send a reset, and the client would lose the answer explaining the refusal.
        """
        if self.closed:
            return
        self.closed = True
        transport = self.transport
        reading = self.head_started or self._stream is not None
        if reading and self._lingering < 0 and transport.can_write_eof():
            self._lingering = 0
            transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER_SECONDS, transport.close)
        else:
            transport.close()


def _check_codings(value: bytes) -> None:
    """A request's Transfer-Encoding: chunked alone. Chunked not last is 400 (RFC 9112 6.3, the
    length cannot be known: httptools says so too); any other coding before it is 501 (RFC 9112 6.1)."""
    codings = [coding.strip().lower() for coding in value.split(b",")]
    if codings[-1] == b"chunked" and len(codings) > 1:
        raise _Reject(
            RouterError(
                501,
                "Transfer codings other than chunked are not supported.",
                code="transfer_coding_not_supported",
            )
        )


def _client_request_id(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The client's own ``X-Request-Id`` among ``headers`` when it is a valid one, else a new id."""
    for name, value in headers:
        if name == b"x-request-id" and valid_request_id(value):
            return value
    return new_request_id()


def _too_many_connections() -> RouterError:
    return RouterError(
        503, "Too many connections.", code="too_many_connections", headers=[(b"retry-after", b"1")]
    )


def _request_timeout(message: str) -> RouterError:
    return RouterError(408, message, code="request_timeout")


def _too_large(limit: int, declared: int | None = None) -> RouterError:
    what = f"Request body of {declared} bytes" if declared is not None else "Request body"
    return RouterError(413, f"{what} exceeds the limit of {limit} bytes.", code="body_too_large")
