"""LoRA affinity: a request for a registered adapter goes where the adapter is, and is loaded there first.

Filter: the candidates (the engines of the adapter's base model) narrowed to those holding the adapter
or loading it, else those with a free adapter slot, else the least loaded one where an adapter can be
unloaded, else all of them (:meth:`AdapterPlacement.place`); the profile's picker chooses among them.
Pre-request: the adapter is loaded on the picked engine when it is not there yet (single-flight), and
counted in use there until the request ends, so no eviction takes it away meanwhile. A failed load
is the client's 502 ``adapter_load_failed`` with the engine's words, never a hang (the load has its
own timeout).

The router adds this plugin to every profile when adapters are registered (:mod:`..profiles`);
requests for anything else pass through it untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence

from vllm_stack.config import ConfigError
from vllm_stack.engines.adapter_placement import AdapterLoadError, AdapterPlacement
from vllm_stack.engines.engine import Engine
from vllm_stack.scheduling.framework import Completion, Reason, Refusal, RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext

_HELD = "lora-affinity"  # ctx.cycle key: the engine this request holds its adapter on


class LoraAffinity:
    type_name = "lora-affinity-filter"
    roles = (Role.FILTER, Role.PRE_REQUEST, Role.RESPONSE_COMPLETE)

    def __init__(self, name: str, placement: AdapterPlacement) -> None:
        self.name = name
        self.placement = placement

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> LoraAffinity:
        if context.adapters is None:
            raise ConfigError(f"plugin {name!r}: this router has no adapter placement")
        return cls(name, context.adapters)

    def filter(self, ctx: RequestContext, engines: Sequence[Engine]) -> Sequence[Engine]:
        spec = ctx.adapter
        if spec is None:
            return engines
        return self.placement.place(spec, engines)

    def pre_request(self, ctx: RequestContext, engine: Engine) -> Awaitable[Refusal | None] | None:
        spec = ctx.adapter
        if spec is None:
            return None
        placement = self.placement
        held = ctx.cycle.get(_HELD)
        if held is not None:  # a retry: the adapter is no longer in use on the engine tried before
            placement.release(held, spec.name)
        ctx.cycle[_HELD] = engine
        placement.acquire(engine, spec.name)
        if spec.name in engine.models:
            return None
        # started now, not when the awaitable first runs: the next request of this loop turn sees it
        return self._wait(placement.start_load(engine, spec))

    async def _wait(self, load: asyncio.Task[None]) -> Refusal | None:
        try:
            await self.placement.wait(load)
        except AdapterLoadError as exc:
            return Refusal(Reason.ADAPTER_UNAVAILABLE, str(exc))
        return None

    def response_complete(self, ctx: RequestContext, completion: Completion) -> None:
        spec = ctx.adapter
        if spec is None or ctx._cycle is None:  # noqa: SLF001 - no cycle: nothing was held
            return
        held = ctx.cycle.pop(_HELD, None)
        if held is not None:
            self.placement.release(held, spec.name)
