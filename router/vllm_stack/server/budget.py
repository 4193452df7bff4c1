"""The request body bytes all client connections hold together, and each client key's part of them.

Why bytes are counted as they arrive, not as declared: a head alone costs the router nothing, so a
declared ``Content-Length`` reserved from the head on let eight heads of 32 MiB that never sent a byte
hold the whole 256 MiB budget, and every other body got 503 (issue 44). What a connection holds is what
it sent; a body that stops sending is answered 408 (the server's ``request_body_timeout``).

Why a share per key: with client keys on, one key opening many connections could still take the whole
budget with bodies it sends slowly. Each key (and, together, the requests that carry none: the open
paths) may hold at most ``max_body_share_per_key`` of it; past that its request gets 429 while other
keys' requests go on. With keys off there is no holder and only the total counts.
"""

from __future__ import annotations

from typing import Protocol

from vllm_stack.errors import RouterError


class BudgetLimits(Protocol):
    """The application's limits, read at each :meth:`BodyBudget.take` (they change on reload);
    attributes rather than methods, as that runs for every body read."""

    buffered_body_limit: int  # the most bytes all holders together may hold
    key_body_limit: int  # the most bytes one holder may hold


class BodyBudget:
    """Body bytes held, in total and per holder (a client key; None: counted in the total only).

    A holder's entry exists only while it holds bytes, so the map is bounded by the connections
    holding bodies."""

    __slots__ = ("held", "_by_holder", "_limits")

    def __init__(self, limits: BudgetLimits) -> None:
        self.held = 0  # bytes all connections hold (arriving, queued or being answered)
        self._by_holder: dict[bytes, int] = {}
        self._limits = limits

    def take(self, size: int, holder: bytes | None) -> RouterError | None:
        """Count ``size`` more bytes of ``holder``; or, when they would not fit, the error to answer."""
        held = self.held + size
        if held > self._limits.buffered_body_limit:
            return _buffers_full()
        if holder is not None:
            mine = self._by_holder.get(holder, 0) + size
            if mine > self._limits.key_body_limit:
                return _share_full()
            self._by_holder[holder] = mine
        self.held = held
        return None

    def refusal(self, size: int, holder: bytes | None) -> RouterError | None:
        """The error for ``size`` more bytes of ``holder`` if they would not fit now (nothing taken)."""
        error = self.take(size, holder)
        if error is None:
            self.give(size, holder)
        return error

    def give(self, size: int, holder: bytes | None) -> None:
        """``size`` bytes of ``holder`` are no longer held (answered, refused, or their client left)."""
        self.held -= size
        if holder is not None:
            left = self._by_holder[holder] - size
            if left:
                self._by_holder[holder] = left
            else:
                del self._by_holder[holder]

    def held_by(self, holder: bytes) -> int:
        return self._by_holder.get(holder, 0)


def _buffers_full() -> RouterError:
    return RouterError(
        503,
        "The router holds as many request bodies as it may (max_buffered_body_bytes); retry shortly.",
        code="body_buffers_full",
        headers=[(b"retry-after", b"1")],
    )


def _share_full() -> RouterError:
    return RouterError(
        429,
        "This API key's requests hold as many request bodies as one key may (max_body_share_per_key of "
        "max_buffered_body_bytes); retry shortly.",
        code="body_share_exceeded",
        headers=[(b"retry-after", b"1")],
    )
