"""The soak benchmark's engine: ``benchmarks/router/fast_stub.py`` plus one fault it cannot do itself,
an engine that closes its connections.

``SIGUSR1`` switches close mode on: every open connection is closed at once (streams under way are cut
mid-way) and every new request is answered by closing the connection; ``SIGUSR2`` switches it off.
The other faults of the soak (SIGKILL and restart, SIGSTOP/SIGCONT) need nothing from the engine.

Usage: ``python benchmarks/soak/flaky_stub.py --port 9001 [--token-gap-ms 5]`` (loopback only).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
from fast_stub import Stub, StubProtocol  # noqa: E402

OPEN: set[FlakyProtocol] = set()
CLOSING = [False]


class FlakyProtocol(StubProtocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        OPEN.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        OPEN.discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if CLOSING[0]:
            self.transport.close()  # type: ignore[union-attr]
            return
        super().data_received(data)


def _close_mode(on: bool) -> None:
    CLOSING[0] = on
    if on:
        for proto in list(OPEN):
            if proto.transport is not None:
                proto.transport.close()


async def serve(port: int, stub: Stub) -> None:
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, _close_mode, True)
    loop.add_signal_handler(signal.SIGUSR2, _close_mode, False)
    server = await loop.create_server(lambda: FlakyProtocol(stub), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", default="stub-model")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--token-gap-ms", type=float, default=5.0)
    args = p.parse_args()
    uvloop.run(serve(args.port, Stub(args.model, args.tokens, args.token_gap_ms)))


if __name__ == "__main__":
    main()
