"""CPU cost of the router's own request handling, with the network taken out.

Drives the router's hot path in-process exactly as its server does, minus the sockets: the client's
request bytes go into a real :class:`~vllm_stack.server.http1.HttpConnection` (httptools parsing,
dispatch by :class:`~vllm_stack.server.serve.RouterServer`), :func:`vllm_stack.api.proxied.handle`
parses the routing fields, resolves the model and starts an
the director (:class:`~vllm_stack.director.request.ProxiedRequest` and its relay leg), which takes a real
:class:`~vllm_stack.relay.pool.UpstreamConnection` from the engine's pool and writes the request to
it. The upstream connection's transport is a fake that only keeps what was written; the engine's
answer (the fast stub's exact bytes for the benchmark request: a chunked SSE stream of 8 tokens) is
then fed through the connection's ``data_received``, and the client transport keeps what the router
writes back. No socket, no system call, no event-loop I/O: what remains is HTTP parsing both ways,
routing-field parsing, model lookup, scheduling, header handling, forwarding and metrics.

Two ways the answer reaches the relay, as the two stub modes deliver it:
- ``one_read``: the whole response in one ``data_received`` (events written back to back and read
  together);
- ``per_token_reads``: 9 reads, the head, then one per token event with ``[DONE]`` and the
  terminating chunk arriving with the last one (tokens milliseconds apart, as a real engine sends
  them; see ``fast_stub.py --token-gap-ms``).

Each figure: CPU time (``time.process_time``) per request, the minimum over 3 repeats of 20,000
requests after a warm-up, with the garbage collector set up as ``router_cli`` does.

Usage: ``.venv/bin/python benchmarks/router/handler_cost.py [msgspec|orjson]``
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "router"))

from fast_stub import Stub  # noqa: E402
from loadgen import build_request  # noqa: E402

from vllm_stack.app import build_router  # noqa: E402
from vllm_stack.engines.discovery.base import EndpointInfo  # noqa: E402
from vllm_stack.engines.discovery.static import endpoint_name  # noqa: E402
from vllm_stack.relay.pool import UpstreamConnection  # noqa: E402
from vllm_stack.server.http1 import HttpConnection  # noqa: E402
from vllm_stack.server.serve import RouterServer  # noqa: E402

MODEL = "stub-model"
ENGINE_URL = "http://127.0.0.1:9"  # never connected to: the pool already holds a connection
MODES = ("one_read", "per_token_reads")


class FakeTransport:
    """An asyncio transport that writes into a list; what a protocol calls on its transport, no more."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.writes = 0  # write / writelines calls (a real transport: one send system call each)
        self.closed = False
        self.reading = True

    def write(self, data: bytes) -> None:
        self.written.append(data)
        self.writes += 1

    def writelines(self, data: list[bytes]) -> None:
        self.written.extend(data)
        self.writes += 1

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:  # noqa: ANN401 - as asyncio's
        return default

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.closed = True


def response_reads(mode: str) -> list[bytes]:
    """The engine's answer to the benchmark request, split as the router's socket reads would get it."""
    stub = Stub(MODEL, 8)
    head, events, done = stub.stream_head[False], stub.events(True, MODEL, 8), stub.done
    if mode == "one_read":
        return [head + b"".join(events) + done]
    if mode == "per_token_reads":
        return [head, *events[:-1], events[-1] + done]
    raise ValueError(f"unknown mode {mode!r}; one of {MODES}")


async def measure(
    body: bytes,
    parser: str = "msgspec",
    mode: str = "one_read",
    n: int = 20000,
    settings: dict[str, Any] | None = None,
) -> float:
    """Microseconds of CPU per request (min of 3 repeats of ``n``); checks the relayed answer first.

    ``settings``: more router settings (e.g. ``otlp_traces_endpoint``). With tracing on, each repeat
    ends by sending every span it made (the tracer's flush), inside the measured time: the exporter's
    thread is part of the cost (``process_time`` counts every thread)."""
    router = build_router(
        {"static_backends": ENGINE_URL, "static_models": MODEL, "json_parser": parser, **(settings or {})},
        environ={},
    )
    tracer = router.tracer
    registry = router.registry
    # The engine, known with its model from static_models; not started, so nothing fetches /v1/models:
    # the probe apply_snapshot spawns fails at once (no control session), and one good check is
    # enough for a new engine.
    await registry.apply_snapshot([EndpointInfo(endpoint_name(ENGINE_URL), ENGINE_URL)])
    await registry.wait_probes()
    engine = registry.engines()[0]
    registry.record_check(engine, ok=True)
    assert registry.candidates(MODEL) == (engine,), "the engine is not routable"

    pool = router.pools.get(engine.url)
    upstream_transport = FakeTransport()
    up = UpstreamConnection(pool)
    up.connection_made(upstream_transport)  # type: ignore[arg-type]
    pool.put(up)

    server = RouterServer(router, "127.0.0.1", 0)  # not started: only its dispatch and body limit
    client = FakeTransport()
    conn = HttpConnection(server)
    conn.connection_made(client)  # type: ignore[arg-type]

    request = build_request("127.0.0.1", 8000, "/v1/chat/completions", body)
    reads = response_reads(mode)
    feed = up.data_received

    def one() -> None:
        conn.data_received(request)
        for data in reads:
            feed(data)

    # One request, checked: the request reached the engine, the answer reached the client whole, and
    # both connections are ready for the next request.
    one()
    sent = b"".join(upstream_transport.written)
    assert sent.startswith(b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:9\r\n"), sent[:200]
    assert sent.endswith(body), sent[-200:]
    answer = b"".join(client.written)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nx-request-id: " in answer, answer[:300]
    relayed = b"".join(reads)
    assert answer.endswith(relayed[relayed.index(b"\r\n\r\n") + 4 :]), answer[-300:]
    assert client.writes == len(reads), f"{client.writes} client writes for {len(reads)} reads"
    assert pool.idle == [up] and not conn.busy and conn.handler is None and not client.closed

    def run(count: int) -> float:
        written, upstream_written = client.written, upstream_transport.written
        started = time.process_time()
        for _ in range(count):
            one()
            written.clear()
            upstream_written.clear()
        if tracer is not None:
            tracer.provider.force_flush()
        return time.process_time() - started

    run(2000)
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 100)  # as router_cli does
    best = min(run(n) for _ in range(3))
    assert pool.idle == [up] and not conn.busy and not client.closed, "the relay did not stay in steady state"
    ok = router.metrics.registry.get_sample_value(
        "vllm_stack_router_requests_total", {"model": MODEL, "engine": engine.name, "status": "200"}
    )
    if ok is not None:  # the request counter's name and labels are the router's business; checked if found
        assert ok == 2000 + 3 * n + 1, f"{ok} requests counted as 200"
    return best / n * 1e6


def handler_cost(body: bytes, parser: str = "msgspec", mode: str = "one_read") -> float:
    """CPU microseconds per request for one JSON parser and one way of delivering the answer."""
    return asyncio.run(measure(body, parser, mode))


def handler_costs(body: bytes, parser: str = "msgspec") -> dict[str, float]:
    """:func:`handler_cost` for every mode in :data:`MODES`."""
    return {mode: handler_cost(body, parser, mode) for mode in MODES}


if __name__ == "__main__":
    from run import BODY

    for name in sys.argv[1:] or ["msgspec", "orjson"]:
        print(name, json.dumps({k: round(v, 1) for k, v in handler_costs(BODY, name).items()}))
