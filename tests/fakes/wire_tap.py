"""A TCP tap in front of an engine: forwards both ways unchanged and records what crossed, so a test
can read the HTTP requests an engine received and the answers it sent exactly as they were on the
wire (not as the router or the engine report them)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httptools


@dataclass
class _Message:
    head: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    url: bytes = b""
    status: int = 0


class _Collector:
    """httptools callbacks: whole messages (head fields and the dechunked body)."""

    def __init__(self) -> None:
        self.messages: list[_Message] = []
        self._current = _Message()

    def on_url(self, url: bytes) -> None:
        self._current.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._current.head.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self._current.body += body

    def on_message_complete(self) -> None:
        self.messages.append(self._current)
        self._current = _Message()


@dataclass
class Exchange:
    """One request the engine received and the answer it sent (None while it is unanswered)."""

    path: str
    headers: dict[bytes, bytes]
    body: bytes
    status: int | None
    answer: bytes | None


class WireTap:
    """Listens on an ephemeral port and forwards every connection to ``target_port``."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target_port = target_port
        self.host = host
        self._connections: list[tuple[bytearray, bytearray]] = []  # (to the engine, from it)
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        sent, received = bytearray(), bytearray()
        self._connections.append((sent, received))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, log: bytearray) -> None:
            try:
                while data := await src.read(65536):
                    log += data
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        with contextlib.suppress(asyncio.CancelledError):  # the tap stopped under an open connection
            await asyncio.gather(pump(reader, up_writer, sent), pump(up_reader, writer, received))

    def exchanges(self, path_prefix: str = "/v1/") -> list[Exchange]:
        """Every request to a path under ``path_prefix`` (health checks and scrapes left out), in order
        per connection, each with the answer that followed it on its connection."""
        found: list[Exchange] = []
        for sent, received in self._connections:
            requests = _Collector()
            with contextlib.suppress(httptools.HttpParserError):
                httptools.HttpRequestParser(requests).feed_data(bytes(sent))
            answers = _Collector()
            response_parser = httptools.HttpResponseParser(answers)
            with contextlib.suppress(httptools.HttpParserError):
                response_parser.feed_data(bytes(received))
            statuses = _statuses(bytes(received))
            for i, request in enumerate(requests.messages):
                answer = answers.messages[i] if i < len(answers.messages) else None
                path = request.url.decode()
                if not path.startswith(path_prefix):
                    continue
                found.append(
                    Exchange(
                        path,
                        dict(request.head),
                        bytes(request.body),
                        statuses[i] if i < len(statuses) else None,
                        bytes(answer.body) if answer is not None else None,
                    )
                )
        return found


def _statuses(received: bytes) -> list[int]:
    """The status codes of the answers on one connection (httptools gives them only per parser)."""
    statuses: list[int] = []

    class _Status:
        def on_message_complete(self) -> None:
            statuses.append(parser.get_status_code())

    parser = httptools.HttpResponseParser(_Status())
    with contextlib.suppress(httptools.HttpParserError):
        parser.feed_data(received)
    return statuses


@contextlib.asynccontextmanager
async def tapped(target_port: int) -> AsyncIterator[WireTap]:
    tap = WireTap(target_port)
    await tap.start()
    try:
        yield tap
    finally:
        await tap.stop()
