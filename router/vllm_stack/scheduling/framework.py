"""The scheduling framework: request context, plugin protocols, profile and scheduler."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from vllm_stack.discovery.engine import Engine
from vllm_stack.metrics import RouterMetrics


@dataclass(slots=True)
class RequestContext:
    """What routing may look at: only the fields the proxy parsed, never the whole body."""

    model: str
    session_key: str | None = None  # header value or body "user"
    prefix: bytes | None = None  # first bytes of the raw prompt/messages JSON (prefix affinity)
    excluded: set[str] = field(default_factory=set)  # engines already tried (retries)


class Filter(Protocol):
    """Removes candidates that must not receive the request."""

    name: str

    def filter(self, ctx: RequestContext, engines: Sequence[Engine]) -> Sequence[Engine]: ...


class Scorer(Protocol):
    """Scores every candidate in [0, 1]; higher is better."""

    name: str

    def score(self, ctx: RequestContext, engines: Sequence[Engine]) -> list[float]: ...


class Picker(Protocol):
    """Chooses one candidate (``scores`` is None when the profile has no scorers); returns (engine, reason)."""

    name: str

    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]: ...


@dataclass(slots=True)
class Profile:
    """One routing strategy: filters, weighted scorers and a picker."""

    name: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker


class Scheduler:
    """Runs a profile over the registry's candidates and records the decision in metrics."""

    __slots__ = ("profile", "_metrics")

    def __init__(self, profile: Profile, metrics: RouterMetrics) -> None:
        self.profile = profile
        self._metrics = metrics

    def pick(self, ctx: RequestContext, candidates: Sequence[Engine]) -> Engine | None:
        """The chosen engine, or None when every candidate was filtered out."""
        started = time.perf_counter()
        profile = self.profile
        engines: Sequence[Engine] = candidates
        if ctx.excluded:
            engines = [e for e in engines if e.name not in ctx.excluded]
        for f in profile.filters:
            if not engines:
                break
            engines = f.filter(ctx, engines)
        if not engines:
            self._metrics.routing_decision(profile.name, "no_candidate", time.perf_counter() - started)
            return None
        scores: list[float] | None = None
        if profile.scorers and len(engines) > 1:
            scores = [0.0] * len(engines)
            for scorer, weight in profile.scorers:
                for i, s in enumerate(scorer.score(ctx, engines)):
                    scores[i] += weight * s
        engine, reason = profile.picker.pick(ctx, engines, scores)
        self._metrics.routing_decision(profile.name, reason, time.perf_counter() - started)
        return engine
