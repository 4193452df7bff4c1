"""A byte relay between a TCP address and a Unix socket, in either direction (the real node's way to the API
server: `python -m vllm_stack_dev.cluster.relay LISTEN CONNECT`, each `tcp:HOST:PORT` or `unix:PATH`).

A real node lives in a network namespace of its own, whose loopback is not the host's, so the kubelet
cannot reach the API server at 127.0.0.1 of the host. A Unix socket on a file path is reachable from every
network namespace: one relay in the host's namespace listens on a socket file and connects to the API
server; one in the node's namespace listens on its loopback and connects to that socket file. TLS passes
through untouched (the kubelet verifies the API server's certificate and presents its own). No interface,
route or address is added to any namespace for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

CHUNK = 65536


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _connect(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    kind, _, rest = address.partition(":")
    if kind == "unix":
        return await asyncio.open_unix_connection(rest)
    host, _, port = rest.rpartition(":")
    return await asyncio.open_connection(host, int(port))


async def serve(listen: str, connect: str) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await _connect(connect)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))

    kind, _, rest = listen.partition(":")
    if kind == "unix":
        server = await asyncio.start_unix_server(handle, rest)
    else:
        host, _, port = rest.rpartition(":")
        server = await asyncio.start_server(handle, host, int(port))
    print(f"relay {listen} -> {connect}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m vllm_stack_dev.cluster.relay LISTEN CONNECT (tcp:HOST:PORT or unix:PATH)")
        return 2
    asyncio.run(serve(args[0], args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
