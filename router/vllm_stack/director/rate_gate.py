"""Where the rate limits meet a request: the last prepare-data hook and a response-complete hook, added
to the director's hooks only when some tenant has a limit (no limits: the request path is unchanged).

It runs after the other prepare-data hooks so the prompt is counted as routing counted it
(``RequestContext.prompt_tokens``, set in token mode), else estimated from its bytes. Admitted: the
answer carries OpenAI's ``x-ratelimit-*`` headers (``RequestContext.response_headers``) and the
decision waits in the request's cycle state for the answer's ``usage``. Refused: 429
``rate_limit_exceeded`` with ``retry-after`` and the same headers, before any engine is picked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

from vllm_stack.engines.engine import Engine
from vllm_stack.scheduling.config import Hooks
from vllm_stack.scheduling.framework import Completion, Reason, Refusal, RequestContext
from vllm_stack.tenants.limiter import RateLimiter
from vllm_stack.tenants.ratelimit import Decision, TenantLimits, prompt_tokens, request_tokens


def model_context(engines: Sequence[Engine], model: str) -> int | None:
    """The model's context (``max_model_len`` of its card), None when no engine's card says."""
    for engine in engines:
        for card in engine.model_cards:
            if card.get("id") == model:
                length = card.get("max_model_len")
                if isinstance(length, int):
                    return length
    return None


def unanswered_refund(completion: Completion, reserved: int, prompt: int) -> int:
    """What goes back of a reservation when the request ended without an answer and without usage.

    Never sent to an engine (the client left while queued): all of it. Sent, and the client left or the
    engine failed before any streamed event reached it (``client_closed``, ``upstream_error``): the
    output part (the engine may have computed the prompt; it generated little or nothing that anyone
    got). Otherwise (an answer was under way or whole): nothing, the reservation stands."""
    if completion.status not in ("client_closed", "upstream_error") or completion.ttft is not None:
        return 0
    if completion.engine is None:
        return reserved
    return max(0, reserved - prompt)


class RateLimitGate:
    """The hooks; ``tenant_of`` names a request's tenant, ``candidates`` a model's engines (their
    cards give the model's default ``max_tokens``), ``refused`` counts a refusal by tenant, ``tokens``
    is told a tenant's tokens counted against its tokens-per-minute after each decision."""

    name = "rate-limit"

    __slots__ = ("limiter", "_tenant_of", "_candidates", "_refused", "_tokens")

    def __init__(
        self,
        limiter: RateLimiter,
        tenant_of: Callable[[RequestContext], str],
        candidates: Callable[[str], Sequence[Engine]],
        refused: Callable[[str], None] | None = None,
        tokens: Callable[[str, float], None] | None = None,
    ) -> None:
        self.limiter = limiter
        self._tenant_of = tenant_of
        self._candidates = candidates
        self._refused = refused
        self._tokens = tokens

    def prepare(self, ctx: RequestContext) -> Refusal | Awaitable[Refusal | None] | None:
        tenant = self._tenant_of(ctx)
        limits = self.limiter.limits_for(tenant)
        if limits is None:
            return None
        tokens = prompt = 0
        if limits.tokens_per_minute is not None:
            prompt = prompt_tokens(ctx.prompt_tokens, ctx.prompt)
            context = model_context(self._candidates(ctx.pool or ctx.model), ctx.model)
            default = 0 if context is None else max(0, context - prompt)  # vLLM's default max_tokens
            tokens = request_tokens(prompt, ctx.body, default, context, limits.tokens_per_minute)
        decision = self.limiter.take(tenant, limits, tokens)
        if isinstance(decision, Decision):
            return self._decided(ctx, tenant, limits, decision, prompt)
        return self._later(ctx, tenant, limits, decision, prompt)

    async def _later(
        self,
        ctx: RequestContext,
        tenant: str,
        limits: TenantLimits,
        pending: Awaitable[Decision],
        prompt: int,
    ) -> Refusal | None:
        decided = asyncio.ensure_future(pending)
        try:
            decision = await asyncio.shield(decided)
        except asyncio.CancelledError:
            # the request ended while the store decided (its client left, its routing timed out): the
            # store may have taken a reservation, which goes back once it answers
            decided.add_done_callback(partial(self._abandoned, tenant, limits))
            raise
        return self._decided(ctx, tenant, limits, decision, prompt)

    def _abandoned(self, tenant: str, limits: TenantLimits, decided: asyncio.Future[Decision]) -> None:
        """A shared store's decision for a request that ended before it came: its tokens back (as for a
        client that left while queued; the request itself stays counted, as every admitted one)."""
        if decided.cancelled() or decided.exception() is not None:
            return
        decision = decided.result()
        if decision.allowed:
            self.limiter.settle(tenant, limits, decision, "client_closed", None, decision.reserved)

    def _decided(
        self, ctx: RequestContext, tenant: str, limits: TenantLimits, decision: Decision, prompt: int
    ) -> Refusal | None:
        bucket = decision.tokens
        if bucket is not None and self._tokens is not None:
            self._tokens(tenant, bucket.limit - bucket.remaining)
        if not decision.allowed:
            if self._refused is not None:
                self._refused(tenant)
            return Refusal(
                Reason.RATE_LIMITED,
                _message(tenant, decision),
                headers=((b"retry-after", decision.retry_after_header()), *decision.header_pairs()),
            )
        ctx.response_headers += decision.headers()
        if limits.tokens_per_minute is not None:
            ctx.cycle[self.name] = (tenant, limits, decision, prompt)
            ctx.keep_answer_end = True  # the answer's usage corrects the reservation
        return None

    def response_complete(self, ctx: RequestContext, completion: Completion) -> None:
        held: Any = ctx.cycle.get(self.name)
        if held is not None:
            tenant, limits, decision, prompt = held
            refund = unanswered_refund(completion, decision.reserved, prompt)
            self.limiter.settle(tenant, limits, decision, completion.status, completion.answer_end, refund)


def with_gate(hooks: Hooks, gate: RateLimitGate) -> Hooks:
    """``hooks`` with the gate's: its prepare-data hook last (after the tokenizer counted the prompt),
    its response-complete hook last."""
    return dataclasses.replace(
        hooks,
        prepare=(*hooks.prepare, gate.prepare),
        response_complete=(*hooks.response_complete, gate.response_complete),
    )


def _message(tenant: str, decision: Decision) -> str:
    """OpenAI's wording: which limit, its figures, when to try again."""
    axis = "requests"
    bucket = decision.requests
    if bucket is None or bucket.remaining >= 1:
        axis, bucket = "tokens", decision.tokens
    figures = f": limit {bucket.limit} per minute" if bucket is not None else ""
    return (
        f"Rate limit reached for tenant '{tenant}' on {axis} per minute{figures}. "
        f"Please try again in {max(1, math.ceil(decision.retry_after))}s."
    )
