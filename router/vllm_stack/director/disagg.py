"""Disaggregated prefill: a request's prompt is prefilled on a prefill engine, its answer generated
on a decode engine that receives the prompt's KV from it (vLLM's KV-connector protocol).

The director (:mod:`.request`) runs the stages; this module holds what is particular to them:

- which requests qualify (:attr:`DisaggSettings.paths`: the endpoint table's disaggregable ones, a JSON
  body without ``kv_transfer_params`` of its own, a model with prefill-role engines; whether a prefill
  leg is worth it is scheduling's: :mod:`vllm_stack.scheduling.disaggregation`);
- the two bodies, by protocol:

  ``vllm`` (vLLM's NixlConnector and every connector that follows its proxy protocol): the prefill
  request is the client's body with ``max_tokens`` 1, ``stream`` false and ``kv_transfer_params``
  ``{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, ...}`` (the
  prefill engine's kind's ``handover.prefill_params``: vLLM's kind declares them); the
  prefill answer's ``kv_transfer_params`` (the connector's hand-over: remote engine id, block ids,
  host, port) go unchanged into the decode request, which is otherwise the client's body. A connector
  that returns none (ExampleConnector: the KV goes through a shared folder keyed by the prompt)
  leaves the decode request exactly the client's body.

  ``lmcache`` (LMCache's own PD mode, 0.5.x): the prefill request's ``kv_transfer_params`` are
  ``{"ret_first_tok": true, "disagg_spec": {"req_id", "receiver_host", "receiver_init_port": [p],
  "receiver_alloc_port": [p]}}`` naming the decode engine chosen beforehand, whose LMCache receives
  the KV; after the prefill answer and LMCache's notification (:mod:`.pd_notify`) the client's own
  request goes to that engine, which finds the KV by the prompt's chunk hashes. The ports are
  one-element lists: one receiver per TP rank, so TP 1 (what LMCache's own proxy also assumes when
  given one port). Unverified here: LMCache's PD path needs CUDA; written from LMCache 0.5.6's source.

- :class:`PrefillExchange`: the prefill leg, one upstream exchange whose answer is read whole
  (bounded) and never forwarded; it reports to its owner how it ended and what it returned.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from vllm_stack.endpoint_table import ENDPOINTS
from vllm_stack.relay.pool import EnginePool, PooledExchange, UpstreamConnectError, UpstreamConnection
from vllm_stack.relay.sse import Dechunker

log = logging.getLogger(__name__)

PREFILL_ANSWER_LIMIT = 1 << 20  # bytes of a prefill answer read (one token and its envelope: far less)

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class DisaggSettings:
    """What disaggregated serving reads of the configuration (swapped as a whole on reload)."""

    protocol: str = "vllm"  # vllm | lmcache
    receiver_init_port: int = 7300  # lmcache: the decode engines' LMCache receiver ports
    receiver_alloc_port: int = 7400
    notify_timeout: float = 10.0  # lmcache: seconds to wait for the prefill engine's notification
    #: Endpoints whose requests may be disaggregated (the router's endpoint table says which)
    paths: frozenset[str] = ENDPOINTS.disaggregable


def parse_body(body: bytes) -> dict[str, Any] | None:
    """The request body as a JSON object, or None when it is not one (such a request is served
    decode-only: the engine answers it as it would have)."""
    try:
        value = _decoder.decode(body)
    except (msgspec.DecodeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def prefill_body(request: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The prefill leg's body: the client's request, one token, not streamed, with ``params``."""
    out = dict(request)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)  # more than the one token asked for is a 400
    out.pop("min_completion_tokens", None)
    out["n"] = 1
    out["kv_transfer_params"] = params
    return _encoder.encode(out)


def decode_body(request: dict[str, Any], body: bytes, params: dict[str, Any] | None) -> bytes:
    """The decode leg's body: the client's own bytes when the prefill handed over nothing, else the
    client's request with the prefill answer's ``kv_transfer_params`` as they came."""
    if params is None:
        return body
    out = dict(request)
    out["kv_transfer_params"] = params
    return _encoder.encode(out)


def with_body(tail: bytes, body: bytes, new_body: bytes) -> bytes:
    """``tail`` (the upstream request's headers, its ``content-length`` line last, and ``body``, as
    :mod:`vllm_stack.api.proxied` builds it) with ``new_body`` instead: same headers, new length."""
    framing = b"content-length: %d\r\n\r\n" % len(body)
    cut = len(tail) - len(body) - len(framing)
    if cut < 0 or tail[cut : len(tail) - len(body)] != framing:
        raise ValueError("the upstream request does not end in its content-length line and body")
    return tail[:cut] + b"content-length: %d\r\n\r\n" % len(new_body) + new_body


def lmcache_prefill_params(
    request_id: str, receiver_host: str, init_port: int, alloc_port: int
) -> dict[str, Any]:
    """LMCache's PD mode (0.5.x, ``enable_pd``): the prefiller's LMCache sends the KV straight to the
    decode engine's receiver named in ``disagg_spec``; the decode request then finds it there by the
    same request id. Unverified here (LMCache's PD path needs CUDA): written from LMCache's source."""
    return {
        "ret_first_tok": True,
        "disagg_spec": {
            "req_id": request_id,
            "receiver_host": receiver_host,
            "receiver_init_port": [init_port],
            "receiver_alloc_port": [alloc_port],
        },
    }


def answer_params(answer: bytes) -> tuple[bool, dict[str, Any] | None]:
    """(whether ``answer`` is a JSON object, its ``kv_transfer_params`` when they are an object)."""
    value = parse_body(answer)
    if value is None:
        return False, None
    params = value.get("kv_transfer_params")
    return True, params if isinstance(params, dict) else None


class PrefillOwner(Protocol):
    """What a prefill exchange reports to (the director's request): exactly one of these, or nothing
    after the owner aborted it."""

    def prefill_answered(self, exchange: PrefillExchange, status: int, answer: bytes) -> None: ...

    def prefill_failed(self, exchange: PrefillExchange, message: str, reason: str) -> None: ...


class PrefillExchange(PooledExchange):
    """The prefill leg: the request written on a pooled connection (or a new one), the answer read
    whole up to :data:`PREFILL_ANSWER_LIMIT`, nothing forwarded to the client. An idle pooled
    connection the engine closed as it was reused is retried once on a fresh one, as a relay leg does."""

    __slots__ = ("owner", "request", "status", "dechunker", "parts", "size", "started", "last_activity")

    def __init__(self, owner: PrefillOwner, pool: EnginePool, request: bytes) -> None:
        self.owner = owner
        self.pool = pool
        self.request = request
        self.up: UpstreamConnection | None = None
        self.reused = False
        self.resent = False
        self.connecting: asyncio.Task[UpstreamConnection] | None = None
        self.status = 0
        self.dechunker: Dechunker | None = None
        self.parts: list[bytes] = []
        self.size = 0
        self.done = False
        self.started = self.last_activity = time.perf_counter()
        up = pool.take()
        if up is None:
            self._connect()
        else:
            self._send(up, reused=True)

    # ---- sending (the connection's life: PooledExchange) ---------------------------------------------
    def connect_failed(self, error: BaseException) -> None:
        if not isinstance(error, UpstreamConnectError):
            log.error("connecting to a prefill engine failed unexpectedly", exc_info=error)
        self.owner.prefill_failed(self, f"Could not reach the prefill engine: {error}", "connect_error")

    def _send(self, up: UpstreamConnection, reused: bool) -> None:
        self.up = up
        self.reused = reused
        up.send(self, self.request)

    def silent_for(self, now: float) -> float:
        return now - self.last_activity

    # ---- upstream callbacks ----------------------------------------------------------------------
    def on_head(self, status: int, head: bytes) -> None:
        self.status = status
        lowered = head.lower()
        if b"\r\ntransfer-encoding:" in lowered and b"chunked" in lowered:
            self.dechunker = Dechunker()

    def on_read(self, data: bytes, complete: bool) -> None:
        self.last_activity = time.perf_counter()
        if data:
            if self.dechunker is not None:
                data = self.dechunker.feed(data)
            self.size += len(data)
            if self.size > PREFILL_ANSWER_LIMIT:
                self.abort()
                self.owner.prefill_failed(self, "The prefill answer was too large.", "upstream_broken")
                return
            self.parts.append(data)
        if complete and not self.done:
            self.done = True
            up, self.up = self.up, None
            if up is not None:
                up.release()
            self.owner.prefill_answered(self, self.status, b"".join(self.parts))

    def upstream_failed(self, up: UpstreamConnection, error: BaseException) -> None:
        if self.done or up is not self.up:
            return
        self.up = None
        if self.resend_if_stale(up):
            return
        self.done = True
        reason = "upstream_broken" if up.got_bytes else "upstream_closed"
        self.owner.prefill_failed(self, f"The prefill engine failed: {error}", reason)
