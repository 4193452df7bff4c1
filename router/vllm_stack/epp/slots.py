"""The endpoint picker's streams under its cap, and which one gives way when a new one finds it full.

An idle timeout alone ends a silent stream after ``ext_proc_idle_timeout``, but until then streams that
sent their headers and nothing more would keep every new stream out once they fill the cap (issue 44:
50 of them on a picker capped at 50 refused every gateway request). So at the cap the stream that has
waited longest in silence for the rest of its request gives way (408, ``evicted``), when it has been
silent for :data:`EVICTABLE_AFTER` at least: a gateway relays a request's parts as the client sends
them, milliseconds apart, so only a stalled request is taken. Streams being picked or answered are
never taken: their silence is the scheduling's or the engine's, bounded by their own timeouts.

The streams waiting for their request are kept in the order they last sent something (a dict's
insertion order, moved to the end on each message), so the longest silent one is found in O(1) however
many streams are open.
"""

from __future__ import annotations

from typing import Protocol


class Stream(Protocol):
    """A stream as its slot sees it (:class:`~.stream.Exchange`, named here by what is used, so the
    import runs one way: the stream knows its slots, not the other way round)."""

    def evict(self) -> bool:
        """Give way to a new stream; False when it cannot (its request is no longer arriving)."""
        ...


#: Seconds a stream waiting for its request must have been silent before a new stream may take its place.
EVICTABLE_AFTER = 1.0


class StreamSlots:
    """The open streams (``open``: the sweep's and the counts'), at most ``limit`` of them."""

    __slots__ = ("limit", "open", "waiting")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: set[Stream] = set()
        # streams waiting for their request's next message -> when they last sent one (time.monotonic),
        # longest silent first
        self.waiting: dict[Stream, float] = {}

    def admit(self, now: float) -> bool:
        """Whether a new stream may open: under the cap, or in place of the longest silent waiting one
        (which is told to end, and counted out at once)."""
        if len(self.open) < self.limit:
            return True
        waiting = self.waiting
        if not waiting:
            return False
        exchange, since = next(iter(waiting.items()))
        if now - since < EVICTABLE_AFTER or not exchange.evict():
            return False
        self.remove(exchange)
        return True

    def add(self, exchange: Stream, now: float) -> None:
        self.open.add(exchange)
        self.waiting[exchange] = now

    def heard(self, exchange: Stream, now: float) -> None:
        """A stream waiting for its request sent a part of it: the most recently heard now."""
        waiting = self.waiting
        if exchange in waiting:
            del waiting[exchange]
            waiting[exchange] = now

    def settled(self, exchange: Stream) -> None:
        """The stream's request is whole (being picked, or answered at once): no longer evictable."""
        self.waiting.pop(exchange, None)

    def remove(self, exchange: Stream) -> None:
        self.open.discard(exchange)
        self.waiting.pop(exchange, None)
