"""The rate limiter a router holds: each tenant's limits, where the buckets live, what a store's failure
does, and the correction of a reservation from the answer's ``usage``.

A shared store's failure fails open to this replica's own buckets (:class:`LocalBuckets`): the limits
then hold per replica, not across them, for as long as Redis does not answer (each failed call waits at
most ``rate_limit_store_timeout``, 0.5 s by default). Each failure counts in
``vllm_stack_router_rate_limit_store_errors_total``; the first of an outage and the recovery are logged
once each. Rate limits share capacity fairly; refusing every request because their bookkeeping is
unreachable would turn a Redis outage into a whole-fleet outage.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from vllm_stack.tenants.declaration import TenantTable
from vllm_stack.tenants.ratelimit import Decision, LocalBuckets, TenantLimits

log = logging.getLogger(__name__)

_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class SharedBuckets(Protocol):
    """A store shared by the replicas (:class:`~.redis_store.RedisBuckets`)."""

    url: str

    async def take(self, tenant: str, limits: TenantLimits, tokens: int) -> Decision: ...

    async def adjust(self, tenant: str, limits: TenantLimits, delta: int) -> None: ...

    async def close(self) -> None: ...


def used_tokens(answer_end: bytes | None) -> int | None:
    """The tokens the answer's ``usage`` reports (prompt + completion; a stream's last usage: its final
    chunk's, with ``stream_options.include_usage``), None when the answer carries none."""
    if not answer_end:
        return None
    prompt = _PROMPT_TOKENS.findall(answer_end)
    completion = _COMPLETION_TOKENS.findall(answer_end)
    if not prompt and not completion:
        return None
    return (int(prompt[-1]) if prompt else 0) + (int(completion[-1]) if completion else 0)


def correction(decision: Decision, status: str, answer_end: bytes | None, unanswered: int = 0) -> int:
    """Tokens to take beyond the reservation once a request ended (negative: a refund).

    The answer's ``usage``: exactly what it used. None, and the request ended with an error status (the
    engine or the router refused it: nothing was generated): the whole reservation back. None, and it
    ended without an answer (the client left, the engine failed): ``unanswered`` back, what the caller
    knows went unused (the rate gate's ``unanswered_refund``). None otherwise (an answer without usage,
    a stream cut midway): the reservation stays."""
    used = used_tokens(answer_end)
    if used is not None:
        return used - decision.reserved
    if status.isdigit() and status[0] != "2":
        return -decision.reserved
    return -min(unanswered, decision.reserved)


def declared_limits(table: TenantTable) -> dict[str, TenantLimits]:
    """The limits of the declared tenants that have any (a tenant nobody declared has none)."""
    out = {}
    for spec in table.specs.values():
        limits = TenantLimits(spec.requests_per_minute, spec.tokens_per_minute)
        if limits.limited:
            out[spec.name] = limits
    return out


class RateLimiter:
    """Limits per tenant, decided in ``shared`` (Redis) when set, else in this replica's buckets."""

    __slots__ = ("limits", "default", "local", "shared", "_on_store_error", "_failing", "_tasks")

    def __init__(
        self,
        limits: Mapping[str, TenantLimits],
        *,
        default: TenantLimits | None = None,
        shared: SharedBuckets | None = None,
        local: LocalBuckets | None = None,
        on_store_error: Callable[[], None] | None = None,
    ) -> None:
        self.limits = {name: lim for name, lim in limits.items() if lim.limited}
        self.default = default if default is not None and default.limited else None
        self.shared = shared
        self.local = local or LocalBuckets()
        self._on_store_error = on_store_error
        self._failing = False
        self._tasks: set[asyncio.Task[Any]] = set()

    def configure(self, limits: Mapping[str, TenantLimits]) -> None:
        """New limits (a reload); the buckets, and what they hold, stay."""
        self.limits = {name: lim for name, lim in limits.items() if lim.limited}

    def limits_for(self, tenant: str) -> TenantLimits | None:
        """``tenant``'s limits (the default's for a tenant without its own), None: not limited."""
        return self.limits.get(tenant, self.default)

    def take(self, tenant: str, limits: TenantLimits, tokens: int) -> Decision | Awaitable[Decision]:
        """The decision for one request: at once from local buckets, awaited from a shared store."""
        if self.shared is None:
            return self.local.take(tenant, limits, tokens)
        return self._take_shared(self.shared, tenant, limits, tokens)

    async def _take_shared(
        self, shared: SharedBuckets, tenant: str, limits: TenantLimits, tokens: int
    ) -> Decision:
        try:
            decision = await shared.take(tenant, limits, tokens)
        except Exception as exc:  # noqa: BLE001 - any failure of the store fails open (module docstring)
            self._store_failed(exc)
            return self.local.take(tenant, limits, tokens)
        if self._failing:
            self._failing = False
            log.warning("rate-limit store %s answers again: limits are shared again", _safe(shared.url))
        return decision

    def settle(
        self,
        tenant: str,
        limits: TenantLimits,
        decision: Decision,
        status: str,
        answer_end: bytes | None,
        unanswered: int = 0,
    ) -> None:
        """Correct ``decision``'s reservation once its request ended (see :func:`correction`)."""
        if limits.tokens_per_minute is None:
            return
        delta = correction(decision, status, answer_end, unanswered)
        if delta == 0:
            return
        if self.shared is None or self._failing:
            self.local.adjust(tenant, limits, delta)
            return
        task = asyncio.ensure_future(self._adjust_shared(self.shared, tenant, limits, delta))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _adjust_shared(
        self, shared: SharedBuckets, tenant: str, limits: TenantLimits, delta: int
    ) -> None:
        try:
            await shared.adjust(tenant, limits, delta)
        except Exception as exc:  # noqa: BLE001 - a lost correction only leaves the reservation standing
            self._store_failed(exc)

    def _store_failed(self, exc: BaseException) -> None:
        if self._on_store_error is not None:
            self._on_store_error()
        if not self._failing:
            self._failing = True
            log.warning(
                "rate-limit store %s failed (%s): limits hold per router replica until it answers again",
                _safe(self.shared.url if self.shared is not None else ""),
                exc.__class__.__name__,
            )

    async def close(self) -> None:
        """Wait for pending corrections, then close the store's connections."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.shared is not None:
            await self.shared.close()


def _safe(url: str) -> str:
    """The store's address without its password, for a log line."""
    return re.sub(r"//[^@/]*@", "//***@", url)
