"""Memory stays bounded under abuse: for each abusive class a bounded loop against the router
process, then its resident memory (from /proc) must be back within 50 MB of the baseline 5 s later.

The router runs as its own process through its real entry point (``vllm-stack router``), so any
allocator or GC setting the result depends on is the router's own (router_cli.py,
server/memory.py), never the test's; nothing here or in the router calls ``gc.collect()``. The
engine is ``benchmarks/router/fast_stub.py`` in a process of its own: the point is the router's
memory, and a real vLLM engine could not take these loops on two cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import orjson
import pytest
from vllm_stack_dev.waiting import wait_http_ok

ROOT = Path(__file__).resolve().parents[2]
SLACK_MB = 50
SETTLE_S = 5.0
MAX_POOLED = 64  # idle keep-alive connections to the stub the pool may keep (the loops use <= 50)
CHAT = orjson.dumps({"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
STREAM = orjson.dumps(
    {
        "model": "stub-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 400,
        "stream": True,
    }
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen[bytes], within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {port}")


class RouterProcess:
    def __init__(self, pid: int, port: int) -> None:
        self.pid = pid
        self.port = port

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def client_connections(self) -> int:
        """Client connections the router still holds open (established or half-closed by the client).

        Counted from /proc/net/tcp by the router's listening port, so the pooled keep-alive
        connections to the engine (bounded by the pool, and meant to stay) are not counted."""
        held = 0
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == self.port and fields[3] in ("01", "08"):  # ESTABLISHED, CLOSE_WAIT
                held += 1
        return held


@contextlib.contextmanager
def _router_process(*flags: str, environ: dict[str, str] | None = None) -> Iterator[RouterProcess]:
    """The router as its own process (its entry point) over a fast stub of its own."""
    stub_port, router_port = _free_port(), _free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        stub = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "benchmarks/router/fast_stub.py"),
                "--port",
                str(stub_port),
                "--token-gap-ms",
                "2",
            ],
        )
        procs.append(stub)
        _wait_port(stub_port, stub)
        router = subprocess.Popen(
            [
                str(Path(sys.executable).parent / "vllm-stack"),
                "router",
                "--service-discovery",
                "static",
                "--static-backends",
                f"http://127.0.0.1:{stub_port}",
                "--port",
                str(router_port),
                "--host",
                "127.0.0.1",
                "--log-level",
                "error",
                *flags,
            ],
            env={**os.environ, **(environ or {})},
        )
        procs.append(router)
        # Serving once it has a healthy engine (/ready needs no key), not once it listens: before its
        # first health check it answers 503 no_healthy_engine, which failed a test's first request.
        wait_http_ok(f"http://127.0.0.1:{router_port}/ready", 30, router)
        yield RouterProcess(router.pid, router_port)
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def router_process() -> Iterator[RouterProcess]:
    with _router_process("--max-body-bytes", str(8 << 20)) as router:
        yield router


KEY = "memory-test-key"
#: Eight client keys (KEY the first), so the budget test's bodies are not bounded by one key's share
#: of the budget (max_body_share_per_key) before the budget itself.
KEYS = [KEY, *(f"memory-test-key-{i}" for i in range(1, 8))]
BUDGET_MB = 64


@pytest.fixture(scope="module")
def keyed_router_process() -> Iterator[RouterProcess]:
    """With an API key, the default 32 MiB body limit and a 64 MiB budget for all bodies together."""
    flags = ("--max-buffered-body-bytes", str(BUDGET_MB << 20))
    with _router_process(*flags, environ={"VLLM_STACK_API_KEYS": ",".join(KEYS)}) as router:
        yield router


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def _post(body: bytes, path: str = "/v1/chat/completions") -> bytes:
    return (
        b"POST %b HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
        % (path.encode(), len(body), body)
    )


async def _until_answered(port: int, n: int = 5, key: str | None = None) -> None:
    """A few plain requests: the router is serving (and has warmed its pools)."""
    reader, writer = await _connect(port)
    request = _post(CHAT)
    if key:
        request = request.replace(b"Host: r\r\n", b"Host: r\r\nAuthorization: Bearer %s\r\n" % key.encode())
    for _ in range(n):
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200"), head
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
    writer.close()


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


# ---- the abusive classes (each bounded in count and time) -------------------------------------------
async def refused_large_bodies(port: int) -> None:
    """Chunked bodies streamed past the body limit (413 mid-body, the rest drained and dropped)."""
    chunk = b"%x\r\n%b\r\n" % (1 << 20, b"x" * (1 << 20))
    for _ in range(12):
        reader, writer = await _connect(port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(24):  # 24 MiB against an 8 MiB limit
                writer.write(chunk)
                await writer.drain()
        with contextlib.suppress(Exception):
            assert (await asyncio.wait_for(reader.read(12), 5)).startswith(b"HTTP/1.1 413")
        await _close(writer)


async def huge_headers(port: int) -> None:
    """Header lines of 2 MiB (431 once the head passes its bound, whatever the line length)."""
    for _ in range(30):
        reader, writer = await _connect(port)
        with contextlib.suppress(ConnectionError):
            writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\nX-Big: " + b"a" * (2 << 20) + b"\r\n\r\n")
            await writer.drain()
        with contextlib.suppress(Exception):
            assert (await asyncio.wait_for(reader.read(12), 5)).startswith(b"HTTP/1.1 431")
        await _close(writer)


async def slowloris(port: int) -> None:
    """300 connections each trickling a request head, a few bytes at a time, then leaving."""
    conns = [await _connect(port) for _ in range(300)]
    for step in range(20):
        for _, writer in conns:
            writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n"[:0] if step else b"GET /health HTTP/1.1\r\n")
            writer.write(b"X-Slow-%d: %s\r\n" % (step, b"v" * 200))
        await asyncio.sleep(0.1)
    for _, writer in conns:
        await _close(writer)


async def many_idle_connections(port: int) -> None:
    """2,000 keep-alive connections, one request each, then idle, then closed."""
    conns = []
    for _ in range(2000):
        reader, writer = await _connect(port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
        conns.append((reader, writer))
    for reader, _ in conns:
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    await asyncio.sleep(1.0)
    for _, writer in conns:
        await _close(writer)


async def pipelining_flood(port: int) -> None:
    """50 connections each writing 200 pipelined requests at once and never reading the answers."""
    conns = [await _connect(port) for _ in range(50)]
    flood = _post(CHAT) * 200
    for _, writer in conns:
        writer.write(flood)
    await asyncio.sleep(2.0)
    for _, writer in conns:
        writer.transport.abort()


async def disconnect_mid_stream(port: int) -> None:
    """200 long streams whose clients leave after the first events (the engine request is aborted)."""

    async def one() -> None:
        reader, writer = await _connect(port)
        writer.write(_post(STREAM))
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        await asyncio.wait_for(reader.read(4096), 10)
        writer.transport.abort()

    for _ in range(10):
        await asyncio.gather(*(one() for _ in range(20)))


LOOPS: list[Callable[[int], Awaitable[None]]] = [
    refused_large_bodies,
    huge_headers,
    slowloris,
    many_idle_connections,
    pipelining_flood,
    disconnect_mid_stream,
]


@pytest.fixture(scope="module")
def baseline(router_process: RouterProcess) -> tuple[float, int]:
    asyncio.run(_until_answered(router_process.port))
    time.sleep(1.0)
    return router_process.rss_mb(), router_process.fds()


@pytest.mark.parametrize("loop", LOOPS, ids=[f.__name__ for f in LOOPS])
def test_memory_comes_back_after(loop, router_process: RouterProcess, baseline: tuple[float, int]) -> None:
    base_rss, base_fds = baseline
    asyncio.run(loop(router_process.port))
    time.sleep(SETTLE_S)
    rss, fds, held = router_process.rss_mb(), router_process.fds(), router_process.client_connections()
    print(
        f"{loop.__name__}: RSS {base_rss:.0f} -> {rss:.0f} MB, fds {base_fds} -> {fds}, client connections {held}"
    )
    assert rss <= base_rss + SLACK_MB, f"{loop.__name__}: RSS {rss:.0f} MB, baseline {base_rss:.0f} MB"
    assert held == 0, f"{loop.__name__}: {held} client connections still open"
    assert fds <= base_fds + MAX_POOLED, f"{loop.__name__}: {fds} open fds, baseline {base_fds}"
    asyncio.run(_until_answered(router_process.port, 2))  # and it still serves


# ---- one attack, watched while it runs ------------------------------------------------------------
class Watch:
    """The router's peak RSS and the slowest ``/health`` answer while an attack runs beside them."""

    def __init__(self, router: RouterProcess) -> None:
        self.router = router
        self.base_rss = router.rss_mb()
        self.peak_rss = self.base_rss
        self.health_ms: list[float] = []

    async def run(self, attack: Awaitable[object]) -> object:
        done = asyncio.Event()

        async def sample_rss() -> None:
            while not done.is_set():
                self.peak_rss = max(self.peak_rss, self.router.rss_mb())
                await asyncio.sleep(0.01)

        async def poll_health() -> None:
            reader, writer = await _connect(self.router.port)
            try:
                while not done.is_set():
                    started = time.perf_counter()
                    writer.write(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                    await reader.readexactly(length)
                    self.health_ms.append((time.perf_counter() - started) * 1000)
                    await asyncio.sleep(0.02)
            finally:
                await _close(writer)

        watchers = [asyncio.create_task(sample_rss()), asyncio.create_task(poll_health())]
        try:
            return await attack
        finally:
            done.set()
            await asyncio.gather(*watchers)


async def _unterminated_trailer(port: int) -> bytes:
    """A chunked body whose trailer field never ends: 1 MiB writes of ``A``, up to 64 MiB, until the
    router answers (or closes); returns what it answered."""
    reader, writer = await _connect(port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-T: "
    )
    answer = asyncio.create_task(reader.read(65536))
    block = b"A" * (1 << 20)
    with contextlib.suppress(ConnectionError):
        for _ in range(64):
            if answer.done():
                break
            writer.write(block)
            await writer.drain()
    try:
        return await asyncio.wait_for(answer, 10)
    finally:
        await _close(writer)


def test_an_unterminated_trailer_field_is_refused_early(router_process: RouterProcess) -> None:
    """Issue 29: once the trailer passes the head limit (64 KiB) it is a 431 and a close; the router's
    memory grows by under 5 MB meanwhile and ``/health`` stays under 100 ms."""
    asyncio.run(_until_answered(router_process.port, 2))
    watch = Watch(router_process)
    answer = asyncio.run(watch.run(_unterminated_trailer(router_process.port)))
    print(
        f"RSS {watch.base_rss:.1f} -> peak {watch.peak_rss:.1f} MB, /health max {max(watch.health_ms):.1f} ms"
    )
    assert answer.startswith(b"HTTP/1.1 431"), answer[:80]
    assert watch.peak_rss - watch.base_rss < 5, (watch.base_rss, watch.peak_rss)
    assert watch.health_ms and max(watch.health_ms) < 100, watch.health_ms


async def _big_body(
    port: int, key: str | None, declared: int, send: int, hold: asyncio.Event, at_hold: asyncio.Queue[int]
) -> bytes:
    """A request declaring ``declared`` body bytes that sends up to ``send`` of them in 1 MiB writes
    (fewer if the router answers first), then waits for ``hold`` and leaves; returns the start of
    the router's answer (b"" when it had none: the body was being taken)."""
    reader, writer = await _connect(port)
    auth = b"Authorization: Bearer %s\r\n" % key.encode() if key else b""
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\n%bContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % (auth, declared)
    )
    answer = asyncio.create_task(reader.read(65536))
    block = b"x" * (1 << 20)
    sent = 0
    with contextlib.suppress(ConnectionError):
        while sent < send and not answer.done():
            writer.write(block[: min(len(block), send - sent)])
            await writer.drain()
            sent += len(block)
    try:
        # A refusal is written as soon as the head arrives, or as the body's bytes pass the budget
        # (then the sending above stops): by now it is in this socket's buffer, and 0.5 s is ample for the loop to hand it over. A body being
        # taken gets no answer until it is whole (never, here).
        with contextlib.suppress(TimeoutError, ConnectionError):
            await asyncio.wait_for(asyncio.shield(answer), 0.5 if key in KEYS else 10)
        at_hold.put_nowait(port)
        await hold.wait()
        return answer.result() if answer.done() and not answer.exception() else b""
    finally:
        answer.cancel()
        writer.transport.abort()


KEYLESS = 20
LARGE = (32 << 20) - 10  # issue 29: 32 MiB minus 10 bytes, under the default body limit


def test_keyless_connections_cost_under_one_megabyte_each(keyed_router_process: RouterProcess) -> None:
    """Issue 29: bodies without a valid key are refused on their head (401, closed), never buffered:
    20 connections each sending a 32 MiB body cost under 1 MB of router memory each, at the peak."""
    router = keyed_router_process
    asyncio.run(_until_answered(router.port, 2, KEY))
    watch = Watch(router)

    async def attack() -> list[bytes]:
        hold = asyncio.Event()
        hold.set()
        keys = [None, "wrong-key"] * (KEYLESS // 2)
        return await asyncio.gather(
            *(_big_body(router.port, key, LARGE, LARGE, hold, asyncio.Queue()) for key in keys)
        )

    answers = asyncio.run(watch.run(attack()))
    per_connection = (watch.peak_rss - watch.base_rss) / KEYLESS
    print(
        f"RSS {watch.base_rss:.1f} -> peak {watch.peak_rss:.1f} MB: {per_connection:.2f} MB per keyless connection"
    )
    assert all(a.startswith(b"HTTP/1.1 401") for a in answers), [a[:40] for a in answers]
    assert per_connection < 1, (watch.base_rss, watch.peak_rss)


def test_keyed_and_keyless_bodies_together_stay_within_the_budget(
    keyed_router_process: RouterProcess,
) -> None:
    """Issue 29: keyed clients holding large bodies half-sent take the body budget (64 MiB here)
    and no more: past it they get 503; keyless ones alongside cost nothing; the router's peak RSS
    stays within the budget plus 50 MB. (Eight keys, one body each: each key's share, 32 MiB, holds
    its body. Issue 44: bytes count as they arrive, so four bodies of 15 MiB fit and a fifth's bytes
    do not.)"""
    router = keyed_router_process
    asyncio.run(_until_answered(router.port, 2, KEY))
    watch = Watch(router)
    declared = 16 << 20

    async def attack() -> list[bytes]:
        hold, at_hold = asyncio.Event(), asyncio.Queue()
        keyed = [_big_body(router.port, key, declared, declared - (1 << 20), hold, at_hold) for key in KEYS]
        keyless = [_big_body(router.port, None, LARGE, LARGE, hold, at_hold) for _ in range(10)]
        tasks = [asyncio.create_task(c) for c in keyed + keyless]
        for _ in tasks:  # every body is sent (a keyed one but its last MiB) or refused: then all leave
            await asyncio.wait_for(at_hold.get(), 60)
        hold.set()
        return await asyncio.gather(*tasks)

    answers = asyncio.run(watch.run(attack()))
    keyed, keyless = answers[:8], answers[8:]
    print(
        f"RSS {watch.base_rss:.1f} -> peak {watch.peak_rss:.1f} MB; keyed held {keyed.count(b'')},"
        f" refused {sum(a.startswith(b'HTTP/1.1 503') for a in keyed)}"
    )
    assert all(a.startswith(b"HTTP/1.1 401") for a in keyless), [a[:40] for a in keyless]
    assert keyed.count(b"") == BUDGET_MB // 16, [a[:40] for a in keyed]
    assert all(a.startswith(b"HTTP/1.1 503") for a in keyed if a), [a[:40] for a in keyed]
    assert watch.peak_rss <= watch.base_rss + BUDGET_MB + SLACK_MB, (watch.base_rss, watch.peak_rss)
