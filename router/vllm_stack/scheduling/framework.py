"""The scheduling framework: request context, cycle state, plugin protocols, profiles, the result.

A request is scheduled by running the profile(s) its profile handler picks; each profile runs its
filters, then its weighted scorers (0..1 each), then its picker. The result always says why: the
picker's reason when an engine was chosen, or a :class:`Reason` when none was, which the director
turns into one error in one place.
"""

from __future__ import annotations

import enum
import inspect
import time
from collections.abc import Awaitable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from vllm_stack.engines.adapters import AdapterSpec
from vllm_stack.engines.engine import Engine
from vllm_stack.metrics import RouterMetrics, _Value
from vllm_stack.tenants.identity import DEFAULT_TENANT


class Reason(enum.StrEnum):
    """Why a request got no engine (scheduling) or was turned away (admission, pre-request)."""

    NO_CANDIDATE = "no_candidate"  # no routable engine serves the model
    ALL_FILTERED = "all_filtered"  # candidates existed; filters (breakers, tried engines) removed all
    ALL_SATURATED = "all_saturated"  # candidates existed; every one is saturated
    OVERLOADED = "overloaded"  # admission: the router will not take more for this model now
    ADAPTER_UNAVAILABLE = "adapter_unavailable"  # pre-request: the LoRA adapter could not be loaded
    QUEUE_FULL = "queue_full"  # the model's queue is full of requests of at least this priority
    QUEUE_TIMEOUT = "queue_timeout"  # it waited the queue's timeout and no engine had room
    RATE_LIMITED = "rate_limited"  # its tenant is over a rate limit (vllm_stack.tenants.limiter)


@dataclass(frozen=True, slots=True)
class Refusal:
    """A plugin's "no" to a request: the director maps ``reason`` to the client's error."""

    reason: Reason
    message: str = ""
    headers: tuple[tuple[bytes, bytes], ...] = ()  # added to the error's (a rate limit's retry-after)


class CycleState(dict[str, Any]):
    """Per-request plugin state: what one stage computes for a later one (keys: plugin names)."""

    __slots__ = ()


_NO_ENGINES: frozenset[str] = frozenset()
_MAX_RESULTS = 4096  # cached scheduling results per profile


@dataclass(slots=True)
class RequestContext:
    """One request's context, the one place every stage, plugin and leg reads it from: what the API
    layer parsed (never more of the body than that), what the request is (id, metric label, arrival),
    what was decided for it (profile, reason) and when things happened (TTFT, duration); with
    tracing on, its spans."""

    model: str  # what the engine is asked for (a base model or an adapter)
    session_key: str | None = None  # header value or body "user"
    prefix: bytes | None = None  # first bytes of the raw prompt/messages JSON (prefix affinity)
    path: str = ""
    body: bytes = b""  # the raw request body (read-only: prepare-data plugins may look)
    prompt: bytes | memoryview | None = None  # the raw prompt / messages / input JSON, whole
    cache_salt: str | None = None  # the request's ``cache_salt`` (vLLM keeps such caches apart)
    # What the request is, set by the API layer (positionally: the fields above and these three):
    request_id: bytes = b""  # the client's valid X-Request-Id, or the router's own
    model_label: str = ""  # the model's label in metrics
    arrived: float = 0.0  # time.perf_counter() when the request was parsed
    excluded: set[str] | frozenset[str] = _NO_ENGINES  # engines already tried (retries): see exclude()
    upstream_headers: bytes = b""  # header lines pre-request plugins add to the upstream request
    response_headers: bytes = b""  # header lines (CRLF-terminated) added to the engine's answer
    keep_answer_end: bool = False  # a plugin wants Completion.answer_end (e.g. the engine's usage)
    # The picker's estimate of the prompt tokens the chosen engine must prefill (not cached there):
    # booked on Engine.prefill_tokens while the request waits for its first token (0: no estimate).
    prefill_tokens: int = 0
    # The prompt's tokens as the routing tokenizer counted them (prefix-cache routing in token mode;
    # None: not tokenized). Read by the tenants' token rate limits.
    prompt_tokens: int | None = None
    # A registered LoRA adapter: the engines of its base model are the candidates (``pool``), and the
    # lora-affinity filter narrows them to where it is loaded or can be.
    adapter: AdapterSpec | None = None
    pool: str = ""  # the model whose engines are candidates, when it is not ``model``
    # The request's priority (vllm_stack.priority): > 0 critical, 0 standard, < 0 sheddable
    priority: int = 0
    # Who sent it (vllm_stack.tenants.identity, resolved by the API layer): what the fair queue, rate
    # limits, eviction and the tenant headroom count by
    tenant: str = DEFAULT_TENANT
    # Its tenant holds more than its share of the model's engines while another is active (set by the
    # director as it schedules, with tenant_headroom_slots on): the saturation rule keeps the headroom from it
    held_back: bool = False
    # A picker's words on its decision (e.g. where LMCache's controller found the prompt), for the
    # x-vllm-stack-route debug header
    route_note: str = ""
    # The prompt tokens the picker predicts cached on the chosen engine (prefix-cache routing)
    predicted_cached: int | None = None
    # What was decided for it (the latest scheduling: a retry or the queue decides again):
    profile: str = ""  # the profile that ran
    reason: str = ""  # its picker's reason for the engine, or the Reason no engine was picked
    # Timings, seconds from ``arrived``:
    ttft: float | None = None  # the first streamed event (streamed answers)
    duration: float = 0.0  # the end of the request, once it ended
    # With tracing on, the request's spans (vllm_stack.tracing.otel.RequestTrace, or UnsampledTrace when
    # the sampler dropped it: ``trace.span`` is the server span, ``trace.trace_id`` the id logs and
    # exemplars carry, "" when dropped); None with tracing off.
    trace: Any = None
    _cycle: CycleState | None = None

    def log_ref(self) -> str:
        """The request in a log line: its id and, when its trace is kept, the trace id."""
        trace_id = self.trace.trace_id if self.trace is not None else ""
        rid = self.request_id.decode("latin-1")
        return f"request {rid}, trace_id={trace_id}" if trace_id else f"request {rid}"

    def log_fields(self) -> dict[str, str]:
        """The request's fields of a log record (``extra``): what the JSON log format writes as
        ``request_id`` and ``trace_id`` (vllm_stack.log_format)."""
        trace_id = self.trace.trace_id if self.trace is not None else ""
        return {"request_id": self.request_id.decode("latin-1"), "trace_id": trace_id}

    def exclude(self, name: str) -> None:
        """Leave engine ``name`` out of the next scheduling (it was tried); the set is made on first use."""
        excluded = self.excluded
        if isinstance(excluded, frozenset):
            excluded = self.excluded = set(excluded)
        excluded.add(name)

    @property
    def cycle(self) -> CycleState:
        """This request's plugin state, created on first use (most requests never need one)."""
        state = self._cycle
        if state is None:
            state = self._cycle = CycleState()
        return state


@dataclass(slots=True)
class Completion:
    """How one request ended, given to response-complete hooks once per request."""

    engine: Engine | None  # the last engine tried (None when none was picked)
    status: str  # the outcome label of the request counter: "200", "503", "client_closed", ...
    duration: float  # seconds from the request's arrival
    ttft: float | None  # seconds to the first streamed event, for streamed answers
    # The answer's last bytes (dechunked, at most relay.leg.ANSWER_END_BYTES), when a prepare-data
    # plugin set ``keep_answer_end``: where the engine's ``usage`` is, in a JSON body or an SSE stream.
    answer_end: bytes | None = None

    @property
    def ok(self) -> bool:
        return self.status[0] == "2"


# ---- plugin protocols (a plugin implements one or several) ----------------------------------------------
class Role(enum.StrEnum):
    """What a plugin does, declared by its class (``roles = (Role.FILTER,)``): each role is one of the
    protocols below, and a plugin is used in exactly the roles it declares (see :func:`plugin_roles`)."""

    FILTER = "filter"
    SCORER = "scorer"
    PICKER = "picker"
    PROFILE_HANDLER = "profile-handler"
    DECIDER = "decider"
    PREPARE_DATA = "prepare-data"
    ADMISSION = "admission"
    PRE_REQUEST = "pre-request"
    RESPONSE_COMPLETE = "response-complete"


class Filter(Protocol):
    """Removes candidates that must not receive the request. ``empty_reason`` is the :class:`Reason`
    reported when the filter leaves none (``ALL_FILTERED`` unless it declares another)."""

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


class Decider(Protocol):
    """Disaggregated serving's decider (:mod:`.disaggregation`): whether a request with
    ``uncached_tokens`` of its prompt not cached on the prefill pool (the prefill profile's picker's
    estimate, before it picks) is worth a prefill leg; False serves it decode-only."""

    name: str

    def decide(self, ctx: RequestContext, uncached_tokens: int) -> bool: ...


class PrepareData(Protocol):
    """Computes request data before scheduling (tokens, block keys) into ``ctx.cycle``."""

    def prepare(self, ctx: RequestContext) -> Awaitable[None] | None: ...


class Admission(Protocol):
    """Admits a request before any work is done for it: None to admit, a :class:`Refusal` to refuse."""

    def admit(
        self, ctx: RequestContext, candidates: Sequence[Engine]
    ) -> Refusal | Awaitable[Refusal | None] | None: ...


class PreRequest(Protocol):
    """Runs once an engine is picked, before the request is sent (e.g. load an adapter there)."""

    def pre_request(
        self, ctx: RequestContext, engine: Engine
    ) -> Refusal | Awaitable[Refusal | None] | None: ...


class ResponseComplete(Protocol):
    """Told once per request how it ended (synchronous; a failure is logged, never raised)."""

    def response_complete(self, ctx: RequestContext, completion: Completion) -> None: ...


# ---- profiles ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SchedulingResult:
    """The decision: an engine and the picker's reason, or no engine and a :class:`Reason`."""

    engine: Engine | None
    reason: str
    profile: str
    results: Mapping[str, SchedulingResult] | None = None  # per profile, when several ran


class Profile:
    """One routing strategy: filters, weighted scorers and a picker. Running it records the decision
    (``routing_decisions_total`` by profile and reason, and the decision's duration)."""

    __slots__ = ("name", "filters", "scorers", "picker", "_metrics", "_record", "_seconds", "_results")

    def __init__(
        self,
        name: str,
        filters: list[Filter],
        scorers: list[tuple[Scorer, float]],
        picker: Picker,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.name = name
        self.filters = filters
        self.scorers = scorers
        self.picker = picker
        self._metrics = metrics = metrics or RouterMetrics()
        self._record = metrics.routing_decision
        self._seconds = metrics.observe_decision_seconds
        # Results are immutable and few (engines x reasons): each made once with its decision
        # counter, not per request.
        self._results: dict[tuple[Engine, str], tuple[SchedulingResult, _Value]] = {}

    def run(self, ctx: RequestContext, candidates: Sequence[Engine]) -> SchedulingResult:
        started = time.perf_counter()
        engines = self.filtered(ctx, candidates)
        if isinstance(engines, str):  # a Reason: none left
            return self._done(SchedulingResult(None, engines, self.name), started)
        return self.pick(ctx, engines, started)

    def filtered(self, ctx: RequestContext, candidates: Sequence[Engine]) -> Sequence[Engine] | str:
        """The candidates its filters keep (never empty), or the :class:`Reason` they left none: the
        first half of :meth:`run`, which records and claims nothing (a decider may look before the
        profile picks)."""
        if not candidates:
            return Reason.NO_CANDIDATE
        engines = candidates
        if ctx.excluded:
            engines = [e for e in engines if e.name not in ctx.excluded]
            if not engines:
                return Reason.ALL_FILTERED
        for f in self.filters:
            engines = f.filter(ctx, engines)
            if not engines:
                return getattr(f, "empty_reason", Reason.ALL_FILTERED)  # type: ignore[no-any-return]
        return engines

    def pick(self, ctx: RequestContext, engines: Sequence[Engine], started: float) -> SchedulingResult:
        """The second half of :meth:`run`: score and pick among ``engines`` (what :meth:`filtered`
        kept), record the decision (counted, and timed from ``started``)."""
        scores: list[float] | None = None
        if self.scorers and len(engines) > 1:
            scores = [0.0] * len(engines)
            for scorer, weight in self.scorers:
                for i, s in enumerate(scorer.score(ctx, engines)):
                    scores[i] += weight * s
        engine, reason = self.picker.pick(ctx, engines, scores)
        key = (engine, reason)
        entry = self._results.get(key)
        if entry is None:
            if len(self._results) >= _MAX_RESULTS:
                self._results.clear()  # engines come and go: the cache stays small
            entry = self._results[key] = (
                SchedulingResult(engine, reason, self.name),
                self._metrics.decision_counter(self.name, reason),
            )
        entry[1].value += 1
        self._seconds(time.perf_counter() - started)
        return entry[0]

    def no_engine(self, reason: str, started: float) -> SchedulingResult:
        """A decision of no engine for ``reason`` (what :meth:`filtered` returned), recorded as one."""
        return self._done(SchedulingResult(None, reason, self.name), started)

    def _done(self, result: SchedulingResult, started: float) -> SchedulingResult:
        self._record(self.name, result.reason, time.perf_counter() - started)
        return result


class ProfileHandler(Protocol):
    """Chooses which profile(s) run for a request and which result the request follows."""

    def pick_profiles(self, ctx: RequestContext, profiles: Mapping[str, Profile]) -> Sequence[Profile]: ...

    def combine(self, ctx: RequestContext, results: Mapping[str, SchedulingResult]) -> SchedulingResult: ...


#: Each role's protocol: the methods a plugin declaring the role must have, called with these arguments.
ROLE_PROTOCOLS: Mapping[Role, type] = {
    Role.FILTER: Filter,
    Role.SCORER: Scorer,
    Role.PICKER: Picker,
    Role.PROFILE_HANDLER: ProfileHandler,
    Role.DECIDER: Decider,
    Role.PREPARE_DATA: PrepareData,
    Role.ADMISSION: Admission,
    Role.PRE_REQUEST: PreRequest,
    Role.RESPONSE_COMPLETE: ResponseComplete,
}


def _protocol_methods(protocol: type) -> dict[str, int]:
    """A protocol's methods and how many arguments each is called with (``self`` not counted)."""
    return {
        name: len(inspect.signature(fn).parameters) - 1
        for name, fn in vars(protocol).items()
        if inspect.isfunction(fn) and not name.startswith("_")
    }


_ROLE_METHODS: Mapping[Role, dict[str, int]] = {
    role: _protocol_methods(p) for role, p in ROLE_PROTOCOLS.items()
}


def plugin_roles(plugin: object) -> frozenset[Role]:
    """The roles ``plugin`` (a plugin class, or an instance a factory made) declares, checked against
    the protocols: each declared role's methods exist and take the protocol's arguments, and no
    method of an undeclared role is there (a ``score`` nobody declared would silently never run).
    Raises ``TypeError`` naming what is wrong. Run when a type is registered and when a
    configuration is built, never per request."""
    what = plugin.__name__ if isinstance(plugin, type) else type(plugin).__name__
    declared = getattr(plugin, "roles", None)
    if isinstance(declared, str) or not isinstance(declared, Collection) or not declared:
        raise TypeError(
            f"plugin {what}: declare its roles, e.g. roles = (Role.FILTER,); roles: "
            + ", ".join(r.value for r in Role)
        )
    try:
        roles = frozenset(Role(r) for r in declared)
    except ValueError as err:
        raise TypeError(f"plugin {what}: {err}; roles: {', '.join(r.value for r in Role)}") from None
    for role, methods in _ROLE_METHODS.items():
        for method, arity in methods.items():
            impl = getattr(plugin, method, None)
            if role not in roles:
                if impl is not None:
                    raise TypeError(
                        f"plugin {what} has {method}() but does not declare the role {role.value!r}; "
                        "add it to roles, or rename the method"
                    )
                continue
            if not callable(impl):
                raise TypeError(f"plugin {what} declares {role.value!r} but has no {method}() method")
            unbound = isinstance(plugin, type) and inspect.isfunction(impl)  # self comes first
            try:
                inspect.signature(impl).bind(*([None] * (arity + unbound)))
            except TypeError:
                raise TypeError(
                    f"plugin {what}: {method}() must take the {arity} arguments of the "
                    f"{role.value!r} protocol ({ROLE_PROTOCOLS[role].__name__})"
                ) from None
            except ValueError:  # a builtin without a signature: nothing to check
                pass
    return roles


class Scheduler:
    """Runs the handler's profile(s) over the registry's candidates (each profile records its decision).

    ``schedule(ctx, candidates)`` is scheduling (for a disaggregated request: its decode engine);
    ``critical`` and ``standard`` are the same for requests
    of priority > 0 and of the rest, each already resolved to what runs (for the criticality handler:
    the profile's own ``run``), so the director's hot path makes no call of the scheduler's own."""

    __slots__ = (
        "profiles",
        "handler",
        "disaggregation",
        "schedule",
        "critical",
        "standard",
        "_critical",
        "_default",
    )

    def __init__(
        self, profiles: Mapping[str, Profile], handler: ProfileHandler, disaggregation: Any = None
    ) -> None:
        if not profiles:
            raise ValueError("a scheduler needs at least one profile")
        self.profiles = dict(profiles)
        self.handler = handler
        # Disaggregated serving's decider and prefill profile (a .disaggregation.Disaggregation), when
        # the configuration declares them; None: every request is served whole
        self.disaggregation = disaggregation
        # The common case, one profile and the single-profile handler: scheduling is running that
        # profile, so ``schedule`` is its bound ``run`` (no call of the handler's, none of ours).
        only = next(iter(self.profiles.values())) if len(self.profiles) == 1 else None
        by_priority = getattr(handler, "by_priority", None)
        if only is not None and getattr(handler, "single", False):
            self.schedule = self.critical = self.standard = only.run
        elif by_priority is not None:  # (critical profile, every other request's): one runs, chosen here
            self._critical, self._default = by_priority()
            self.schedule = self._schedule_by_priority
            self.critical, self.standard = self._critical.run, self._default.run
        else:
            self.schedule = self.critical = self.standard = self._schedule

    @property
    def profile(self) -> Profile:
        """The first (for built-in strategies: the only) profile."""
        return next(iter(self.profiles.values()))

    def _schedule_by_priority(self, ctx: RequestContext, candidates: Sequence[Engine]) -> SchedulingResult:
        return (self._critical if ctx.priority > 0 else self._default).run(ctx, candidates)

    def _schedule(self, ctx: RequestContext, candidates: Sequence[Engine]) -> SchedulingResult:
        chosen = self.handler.pick_profiles(ctx, self.profiles)
        results = {p.name: p.run(ctx, candidates) for p in chosen}
        return self.handler.combine(ctx, results)
