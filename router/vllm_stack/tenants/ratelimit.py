"""Per-tenant rate limits: requests per minute and tokens per minute, with OpenAI's headers.

Each limit is a bucket that holds at most the minute's limit and refills continuously at limit/60 per
second (a token bucket, which is GCRA stated as a level): a tenant idle for a minute may send its whole
minute at once, and after that one request per 60/limit seconds. A request takes one from the request
bucket and its tokens from the token bucket, both or neither:

- its tokens are the prompt's (:func:`request_tokens`: as counted for routing where a tokenizer is
  configured, else the prompt's bytes / 4) plus ``max_tokens`` (``max_completion_tokens``; absent: the
  model's default) reserved, capped at the model's context and at one minute's tokens (a client's
  ``max_tokens`` of 1e9 must not lock its tenant out for days), and corrected from the answer's
  ``usage`` once it ended (:meth:`settle`);
- a bucket's level never falls below minus one minute's limit (:data:`MAX_DEBT_MINUTES`): a correction
  past that is forgiven, so no single request blocks a tenant for more than two minutes;
- only a limited axis is counted, and a bucket whose limit changed (a reload) starts full: what a
  bucket held under another limit means nothing under the new one;
- refused: nothing is taken; ``retry_after`` is when both buckets will hold enough.

The buckets live in a :class:`LocalBuckets` (this replica's memory: with several replicas each enforces
the limit alone) or in Redis (:mod:`.redis_store`, shared and exact across replicas).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import msgspec

#: The prompt's bytes per token when no tokenizer counted them (the prefix-cache picker's default).
CHARS_PER_TOKEN = 4.0
SECONDS_PER_MINUTE = 60.0
#: A token bucket's level is at least ``-MAX_DEBT_MINUTES * limit``: the debt one request can leave.
MAX_DEBT_MINUTES = 1


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """One tenant's limits; None: not limited on that axis."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    @property
    def limited(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


@dataclass(frozen=True, slots=True)
class BucketState:
    """One bucket after a decision: its limit, what it holds now (may be negative: debt), and the
    seconds until it is full again (OpenAI's ``reset``)."""

    limit: int
    remaining: float
    reset: float


@dataclass(frozen=True, slots=True)
class Decision:
    """The limiter's answer for one request: whether it may go, when to retry if not, the buckets
    (for the headers) and the tokens it reserved (for :meth:`RateLimiter.settle`)."""

    allowed: bool
    retry_after: float
    requests: BucketState | None
    tokens: BucketState | None
    reserved: int

    def header_pairs(self) -> list[tuple[bytes, bytes]]:
        """OpenAI's ``x-ratelimit-*`` headers for the limited axes, as (name, value) pairs."""
        pairs = []
        for axis, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is None:
                continue
            pairs += (
                (f"x-ratelimit-limit-{axis}".encode(), str(bucket.limit).encode()),
                (
                    f"x-ratelimit-remaining-{axis}".encode(),
                    str(max(0, math.floor(bucket.remaining))).encode(),
                ),
                (f"x-ratelimit-reset-{axis}".encode(), duration(bucket.reset).encode()),
            )
        return pairs

    def headers(self) -> bytes:
        """:meth:`header_pairs` as header lines, each CRLF-terminated."""
        return b"".join(name + b": " + value + b"\r\n" for name, value in self.header_pairs())

    def retry_after_header(self) -> bytes:
        """``retry-after`` in whole seconds, at least 1 (clients sleep this long before retrying)."""
        return str(max(1, math.ceil(self.retry_after))).encode("ascii")


def duration(seconds: float) -> str:
    """A duration the way OpenAI's headers (Go's ``time.Duration``) write it: ``"0s"``, ``"17ms"``,
    ``"1s"``, ``"1.5s"``, ``"6m0s"``, ``"1h0m0s"``; to the millisecond."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms // 1000}" if ms % 1000 == 0 else f"{ms / 1000:.3f}".rstrip("0")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


# ---- the bucket arithmetic (the Redis script in .redis_store is the same, line for line) ---------------
def refill(level: float, stamp: float, now: float, limit: int) -> float:
    """The bucket's level at ``now``: refilled at limit/60 per second since ``stamp``, at most full."""
    return min(float(limit), level + max(0.0, now - stamp) * limit / SECONDS_PER_MINUTE)


def wait_for(level: float, need: float, limit: int) -> float:
    """Seconds until a bucket at ``level`` holds ``need`` (0 when it does)."""
    return max(0.0, need - level) * SECONDS_PER_MINUTE / limit


def floor_debt(level: float, limit: int) -> float:
    """``level``, at least minus :data:`MAX_DEBT_MINUTES` of ``limit`` (the most debt a bucket keeps)."""
    return max(level, -MAX_DEBT_MINUTES * float(limit))


def reset_after(level: float, limit: int) -> float:
    """Seconds until a bucket at ``level`` is full."""
    return max(0.0, limit - level) * SECONDS_PER_MINUTE / limit


class LocalBuckets:
    """This replica's buckets, in memory: ``{tenant: (requests level, tokens level, stamp, limits)}``.

    Bounded by the configured tenants (only a tenant with limits has buckets). ``clock`` is
    injectable so tests step time instead of sleeping. The limits a bucket was filled under are kept
    with it, so a reload that changes a limit (or sets one) starts that bucket full."""

    __slots__ = ("_clock", "_state")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._state: dict[str, tuple[float, float, float, TenantLimits]] = {}

    def take(self, tenant: str, limits: TenantLimits, tokens: int) -> Decision:
        """Take one request and ``tokens`` from ``tenant``'s buckets, both or neither."""
        now = self._clock()
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        req, tok, stamp = self._levels(tenant, limits, now)
        waits = [0.0]
        if rpm is not None:
            req = refill(req, stamp, now, rpm)
            waits.append(wait_for(req, 1.0, rpm))
        if tpm is not None:
            tok = refill(tok, stamp, now, tpm)
            waits.append(wait_for(tok, min(float(tokens), float(tpm)), tpm))
        wait = max(waits)
        allowed = wait == 0.0
        if allowed:
            if rpm is not None:
                req -= 1.0
            if tpm is not None:
                tok = floor_debt(tok - tokens, tpm)
        self._state[tenant] = (req, tok, now, limits)
        return _decision(allowed, wait, limits, req, tok, tokens if allowed else 0)

    def adjust(self, tenant: str, limits: TenantLimits, delta: int) -> None:
        """Take ``delta`` more tokens (a refund when negative) once the answer's usage is known; nothing
        when the token bucket is now under another limit (a reload started it afresh)."""
        tpm = limits.tokens_per_minute
        state = self._state.get(tenant)
        if tpm is None or state is None or state[3].tokens_per_minute != tpm or delta == 0:
            return
        now = self._clock()
        req, tok, stamp = self._levels(tenant, limits, now)
        rpm = limits.requests_per_minute
        if rpm is not None:
            req = refill(req, stamp, now, rpm)
        tok = floor_debt(min(float(tpm), refill(tok, stamp, now, tpm) - delta), tpm)
        self._state[tenant] = (req, tok, now, limits)

    def _levels(self, tenant: str, limits: TenantLimits, now: float) -> tuple[float, float, float]:
        """``tenant``'s levels and stamp; a bucket new, or kept under another limit, is full."""
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        state = self._state.get(tenant)
        if state is None:
            return float(rpm or 0), float(tpm or 0), now
        req, tok, stamp, was = state
        if was.requests_per_minute != rpm:
            req = float(rpm or 0)
        if was.tokens_per_minute != tpm:
            tok = float(tpm or 0)
        return req, tok, stamp


def _decision(
    allowed: bool, wait: float, limits: TenantLimits, req: float, tok: float, reserved: int
) -> Decision:
    rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
    return Decision(
        allowed,
        wait,
        BucketState(rpm, req, reset_after(req, rpm)) if rpm is not None else None,
        BucketState(tpm, tok, reset_after(tok, tpm)) if tpm is not None else None,
        reserved,
    )


# ---- what a request counts ----------------------------------------------------------------------------
class _MaxTokens(msgspec.Struct):
    max_tokens: object = None
    max_completion_tokens: object = None
    max_output_tokens: object = None  # the Responses API's name


_MAX_TOKENS = msgspec.json.Decoder(_MaxTokens)


def max_tokens(body: bytes) -> int | None:
    """The completion tokens the client asked for at most (None: not said, or not a JSON object).
    Read only when a token limit applies, never on the common path."""
    try:
        fields = _MAX_TOKENS.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    for value in (fields.max_completion_tokens, fields.max_tokens, fields.max_output_tokens):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def prompt_tokens(counted: int | None, prompt: bytes | memoryview | None) -> int:
    """The prompt's tokens: ``counted`` when the routing tokenizer counted them, else the prompt's raw
    JSON bytes / :data:`CHARS_PER_TOKEN`, rounded up (an estimate: JSON quoting and a chat template's
    own tokens make it inexact; the answer's usage corrects it)."""
    return counted if counted is not None else math.ceil(len(prompt or b"") / CHARS_PER_TOKEN)


def request_tokens(
    prompt: int, body: bytes, default_max_tokens: int, context: int | None, tokens_per_minute: int
) -> int:
    """What a request reserves: its ``prompt`` tokens plus its ``max_tokens`` (``default_max_tokens``,
    the model's default, when it sets none), at most the model's ``context`` (when known: the engine
    never computes more) and at most ``tokens_per_minute`` (one minute's worth: a client's huge
    ``max_tokens`` must not hold its tenant's bucket empty for longer than a minute)."""
    completion = max_tokens(body)
    reserved = prompt + (default_max_tokens if completion is None else completion)
    if context is not None:
        reserved = min(reserved, context)
    return min(reserved, tokens_per_minute)


def limits_for(
    tenant: str, limits: Mapping[str, TenantLimits], default: TenantLimits | None = None
) -> TenantLimits | None:
    """``tenant``'s limits when it has any (else ``default``'s, else None: not limited)."""
    found = limits.get(tenant, default)
    return found if found is not None and found.limited else None
