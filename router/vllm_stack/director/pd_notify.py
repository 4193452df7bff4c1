"""LMCache's PD notifications: a prefill engine's LMCache tells the proxy that a request's KV has
reached its decode engine, so the decode request is sent only then.

Wire format (LMCache 0.5.x, read from its source; its PD path needs CUDA and was not run here): each
prefill engine's TP worker has a ZMQ PUSH socket connected to ``pd_proxy_host:pd_proxy_port``; the
proxy binds a PULL socket there. One message is one frame, msgpack of LMCache's tagged
``ProxyNotif`` struct: the map ``{"type": "ProxyNotif", "req_id": "<the disagg_spec's req_id>"}``.
One notification arrives per TP rank of the prefill engine, and it may come before or after the
prefill engine's HTTP answer.

Bounded: waiters exist only for requests in flight (each removed when it is notified, gives up or
its client leaves); notifications nobody waits for yet are kept, at most :data:`MAX_EARLY`, the
oldest dropped first (an id nobody ever waits for, e.g. of a request that ended, ages out).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

MAX_EARLY = 4096  # notifications kept for requests not (yet) waiting for them
MAX_FRAME = 4096  # bytes: a notification is a few dozen


class PdNotifications:
    """The PULL socket and the requests waiting on it, keyed by ``disagg_spec.req_id``."""

    def __init__(self, port: int, host: str = "*") -> None:
        self.endpoint = f"tcp://{host}:{port}"
        self._waiters: dict[str, tuple[int, Callable[[], None]]] = {}  # req_id -> (still expected, done)
        self._early: OrderedDict[str, int] = OrderedDict()  # req_id -> notifications that came first
        self.received = 0
        self.malformed = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._decoder = msgspec.msgpack.Decoder()

    def expect(self, req_id: str, count: int, done: Callable[[], None]) -> None:
        """Call ``done`` (once, from the loop) when ``count`` notifications for ``req_id`` arrived."""
        count -= self._early.pop(req_id, 0)
        if count <= 0:
            asyncio.get_running_loop().call_soon(done)
            return
        self._waiters[req_id] = (count, done)

    def forget(self, req_id: str) -> None:
        """The request no longer waits (it gave up, or its client left)."""
        self._waiters.pop(req_id, None)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def deliver(self, frame: bytes) -> None:
        """One frame from the socket (public for tests that feed frames without a socket)."""
        self.received += 1
        req_id = self._req_id(frame)
        if req_id is None:
            self.malformed += 1
            return
        waiter = self._waiters.get(req_id)
        if waiter is None:
            self._early[req_id] = self._early.get(req_id, 0) + 1
            self._early.move_to_end(req_id)
            while len(self._early) > MAX_EARLY:
                self._early.popitem(last=False)
            return
        left, done = waiter
        if left > 1:
            self._waiters[req_id] = (left - 1, done)
            return
        del self._waiters[req_id]
        done()

    def _req_id(self, frame: bytes) -> str | None:
        if len(frame) > MAX_FRAME:
            return None
        try:
            value: Any = self._decoder.decode(frame)
        except (msgspec.DecodeError, ValueError):
            return None
        if not isinstance(value, dict):
            return None
        req_id = value.get("req_id")
        return req_id if isinstance(req_id, str) and value.get("type", "ProxyNotif") == "ProxyNotif" else None

    async def run(self) -> None:
        """Bind and receive until cancelled."""
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.PULL)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
            sock.bind(self.endpoint)
            log.info("taking LMCache PD notifications at %s", self.endpoint)
            while True:
                frames = await sock.recv_multipart()
                for frame in frames:
                    self.deliver(frame)
        finally:
            sock.close(0)
            self._ctx.term()
            self._ctx = None
