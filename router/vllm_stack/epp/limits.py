"""What the endpoint picker bounds for the gateways it serves, and the gRPC server options that bound it.

A gateway is trusted to relay requests, not to be well-behaved: every client of the gateway reaches the
picker through it (one stream per client request), so a client that sends its headers and then nothing
holds a picker stream, a body buffer and, after a pick, an engine booking for as long as nothing ends
them. These limits end them (issue 44): streams by :mod:`.server` and :mod:`.slots`, connections by gRPC
itself with the options below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_stack.config import RouterConfig

#: One message (a header block, a body chunk) at most this large: gateways send bodies in chunks of tens
#: of KiB, and each stream holds at most one header block.
MAX_MESSAGE_BYTES = 1 << 20
#: Streams gRPC lets through past ``max_streams``: each is answered at once, by evicting a stream that
#: waited in silence for its request (:class:`~.slots.StreamSlots`) or with RESOURCE_EXHAUSTED, so the
#: evicted stream's end and the newcomer's start may overlap.
STREAM_HEADROOM = 64


@dataclass(frozen=True, slots=True)
class PickerLimits:
    """The picker's settings that bound a gateway, taken from the router's configuration (:meth:`of`)."""

    buffer_limit: int  # bytes all streams' gathered bodies hold together
    max_streams: int  # streams at once
    max_connections: int = 256  # gateway connections at once
    idle_timeout: float = (
        30.0  # seconds a stream waiting for its request, or an idle connection, may be silent
    )
    answer_timeout: float = 600.0  # seconds a picked request's answer may be silent

    @classmethod
    def of(cls, config: RouterConfig) -> PickerLimits:
        return cls(
            buffer_limit=config.max_buffered_body_bytes,
            max_streams=config.max_connections,
            max_connections=config.ext_proc_max_connections,
            idle_timeout=config.ext_proc_idle_timeout,
            answer_timeout=config.ext_proc_answer_timeout,
        )

    def server_options(self) -> list[tuple[str, int]]:
        """gRPC's own bounds: a connection past ``max_connections`` is closed as it is accepted (before
        its handshake, so it costs no more than its accept); one with no stream for ``idle_timeout`` is
        sent GOAWAY and closed, as is one that has not finished its HTTP/2 preface by then. One
        connection may open as many streams as gRPC lets through (:meth:`stream_cap`), told to the
        gateway in HTTP/2's SETTINGS, so a gateway past it waits for a stream to end instead of being
        refused; not fewer, or a gateway's one connection at the cap would wait behind stalled streams
        that a new one should have evicted."""
        idle_ms = max(1, round(self.idle_timeout * 1000))
        return [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_allowed_incoming_connections", self.max_connections),
            ("grpc.max_connection_idle_ms", idle_ms),
            ("grpc.server_handshake_timeout_ms", idle_ms),
            ("grpc.max_concurrent_streams", self.stream_cap()),
        ]

    def stream_cap(self) -> int:
        """Streams gRPC itself lets run at once: the picker's cap and the headroom above it."""
        return self.max_streams + STREAM_HEADROOM
