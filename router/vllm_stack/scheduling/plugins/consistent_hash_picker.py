"""Picker: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

A key (session id, or a prompt prefix) maps to a point on a hash ring of virtual nodes; the request
goes to the first engine clockwise whose in-flight count stays within ``ceil((1 + e) * (m + 1) / n)``
(m requests in flight over n engines). Sticky while loads are even, and no engine ever takes more than
(1 + e) x the mean. Hashes are stable across processes (blake2b), so router replicas agree.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Sequence
from operator import attrgetter

from vllm_stack.config import ConfigError
from vllm_stack.engines.engine import Engine
from vllm_stack.engines.load import bounded_capacity, in_flight
from vllm_stack.scheduling.framework import RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext

VNODES = 64
_NAME = attrgetter("name")
_MAX_RINGS = 64  # rings cached per candidate set; bounded


def stable_hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class _Ring:
    __slots__ = ("points", "owners")

    def __init__(self, names: Sequence[str]) -> None:
        pairs = sorted(
            (stable_hash(f"{name}#{v}".encode()), i) for i, name in enumerate(names) for v in range(VNODES)
        )
        self.points = [p for p, _ in pairs]
        self.owners = [i for _, i in pairs]


class ConsistentHashPicker:
    """``key_of`` extracts the affinity key; requests without one go to the least in-flight engine.

    ``name`` is the key's kind (``session``, ``prefix``): it prefixes the decision reasons.
    """

    type_name = "consistent-hash-picker"
    roles = (Role.PICKER,)

    def __init__(
        self, name: str, key_of: Callable[[RequestContext], bytes | None], epsilon: float = 0.25
    ) -> None:
        self.name = name
        self._key_of = key_of
        self.epsilon = epsilon
        # The decision reasons, made once (they key the scheduler's result cache on every request).
        self._hit, self._overflow, self._no_key = f"{name}_hit", f"{name}_overflow", f"{name}_no_key"
        self._rings: dict[tuple[str, ...], _Ring] = {}
        self._fallback_turn = 0

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> ConsistentHashPicker:
        key = parameters.string("key", "session")
        key_of = KEYS.get(key)
        if key_of is None:
            raise ConfigError(f"plugin {name!r}: key must be one of {sorted(KEYS)}")
        epsilon = parameters.number("epsilon", 0.25)
        if epsilon <= 0:
            raise ConfigError(f"plugin {name!r}: epsilon must be > 0")
        return cls(key, key_of, epsilon)

    def _ring(self, engines: Sequence[Engine]) -> _Ring:
        names = tuple(map(_NAME, engines))
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) >= _MAX_RINGS:
                self._rings.clear()
            ring = self._rings[names] = _Ring(names)
        return ring

    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]:
        key = self._key_of(ctx)
        n = len(engines)
        loads = in_flight(engines)
        if key is None:
            low = min(loads)
            least = [e for e, load in zip(engines, loads, strict=True) if load == low]
            self._fallback_turn += 1
            return least[self._fallback_turn % len(least)], self._no_key
        if n == 1:
            return engines[0], self._hit
        ring = self._ring(engines)
        capacity = bounded_capacity(loads, self.epsilon)
        start = bisect.bisect(ring.points, stable_hash(key)) % len(ring.points)
        seen: set[int] = set()
        first = True
        for step in range(len(ring.points)):
            owner = ring.owners[(start + step) % len(ring.points)]
            if owner in seen:
                continue
            seen.add(owner)
            if loads[owner] < capacity:
                return engines[owner], self._hit if first else self._overflow
            first = False
            if len(seen) == n:
                break
        return engines[ring.owners[start]], self._overflow  # unreachable: capacity >= mean


def session_key(ctx: RequestContext) -> bytes | None:
    return ctx.session_key.encode() if ctx.session_key else None


def prefix_key(ctx: RequestContext) -> bytes | None:
    return ctx.prefix or None


KEYS: dict[str, Callable[[RequestContext], bytes | None]] = {"session": session_key, "prefix": prefix_key}
