"""Picker: send a request to the engine whose LMCache holds its prompt's KV, as LMCache's controller says.

production-stack's ``kvaware``. LMCache keeps KV beyond the engine's own GPU cache (CPU, disk, a
shared cache server), and its controller knows which instance holds which 256-token chunks, so a
prompt can go where its prefix still is after the engine itself evicted it. Per request:

1. prepare: the prompt's token ids, exactly as the engine will see them (the model's tokenizer and
   chat template, as the prefix-cache picker computes them), then ``POST /lookup`` to the controller
   (:mod:`..index.lmcache_controller`: bounded by a timeout, skipped for a while after a failure);
2. pick: the instance reaching furthest is mapped to an engine by name (the chart sets each engine's
   LMCache ``lmcache_instance_id`` to its pod name, which is the engine's name under Kubernetes
   discovery; under static discovery it is ``host:port``). The request goes there when the prompt
   tokens it still lacks are at most ``threshold`` (production-stack's ``--kv-aware-threshold``,
   2000), and the engine is a candidate (healthy, not saturated: the profile's filters ran) within
   the prefix-cache picker's in-flight bound;
3. otherwise the cache-aware profile decides: this picker is the prefix-cache picker
   (:class:`PrefixCachePicker`) with the same parameters, index and KV-event feed.

Each request counts one outcome in ``vllm_stack_router_lmcache_lookups_total{model, outcome}``, and
``x-vllm-stack-route`` (when the router's ``debug_headers`` is on) names the holder and its match.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any

from vllm_stack.config import ConfigError
from vllm_stack.engines.engine import Engine
from vllm_stack.engines.load import bounded_capacity, engine_loads
from vllm_stack.scheduling.framework import RequestContext, Role
from vllm_stack.scheduling.index.lmcache_controller import Holder, LmcacheController, LookupFailed
from vllm_stack.scheduling.plugins.prefix_cache_picker import PrefixCachePicker
from vllm_stack.scheduling.registry import Parameters, PluginContext

log = logging.getLogger(__name__)

LMCACHE_CHUNK_TOKENS = 256  # the controller's lookup cuts tokens into 256-token chunks (LMCache 0.5.6)


class LmcacheLookupPicker(PrefixCachePicker):
    type_name = "lmcache-lookup-picker"
    roles = (Role.PREPARE_DATA, Role.PICKER, Role.RESPONSE_COMPLETE)

    controller: LmcacheController
    threshold: float
    _holder_key: str

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> LmcacheLookupPicker:
        url = parameters.string("controller_url", "")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"plugin {name!r}: controller_url must be the controller's http(s):// URL")
        threshold = parameters.number("threshold", 2000, minimum=0)
        timeout = parameters.number("timeout", 0.2, minimum=0.001)
        backoff = parameters.number("backoff", 2.0, minimum=0.0)
        picker = super().create(name, parameters, context)
        assert isinstance(picker, LmcacheLookupPicker)
        # One client per controller, kept across reloads (its connections stay open).
        controller = context.state.get(("lmcache-controller", url), lambda: LmcacheController(url))
        controller.timeout, controller.backoff = timeout, backoff
        picker.controller = controller
        picker.threshold = threshold
        picker._holder_key = name + "/holder"
        return picker

    # ---- prepare-data: token ids, then the controller's answer ------------------------------------------
    def prepare(self, ctx: RequestContext) -> Any:  # noqa: ANN401 - an awaitable, or None
        tokenizing = super().prepare(ctx)
        return self._look_up(ctx, tokenizing)

    async def _look_up(self, ctx: RequestContext, tokenizing: asyncio.Future[None] | None) -> None:
        if tokenizing is not None:
            await tokenizing
        ids = ctx.cycle.get(self._ids_key)
        if ids is None:
            self._count(ctx, "no_tokens")  # no tokenizer for the model (yet), or the prompt would not render
            return
        if len(ids) < LMCACHE_CHUNK_TOKENS:
            self._count(ctx, "short_prompt")  # no whole chunk: LMCache stores and finds none
            return
        started = time.perf_counter()
        try:
            holder = await self.controller.lookup(ids)
        except LookupFailed as exc:
            self._count(ctx, exc.outcome)
            return
        finally:
            if self.metrics is not None:
                self.metrics.lmcache_lookup_seconds.observe(time.perf_counter() - started)
        if holder is None:
            self._count(ctx, "miss")
            return
        ctx.cycle[self._holder_key] = holder

    # ---- pick ---------------------------------------------------------------------------------------------
    def pick(
        self, ctx: RequestContext, engines: Sequence[Engine], scores: list[float] | None
    ) -> tuple[Engine, str]:
        holder: Holder | None = ctx.cycle.pop(self._holder_key, None)  # a retry goes by the fallback
        if holder is not None:
            chosen = self._holder(ctx, engines, holder)
            if chosen is not None:
                return chosen, "lmcache_hit"
        return super().pick(ctx, engines, scores)

    def uncached_tokens(self, ctx: RequestContext, engines: Sequence[Engine]) -> int:
        """What :meth:`pick` would leave the chosen engine to prefill, nothing recorded: the holder's
        lack when it would go there, else the fallback's estimate."""
        holder: Holder | None = ctx.cycle.get(self._holder_key)
        if holder is not None:
            index, _, lacking = self._holder_at(ctx, engines, holder)
            if index is not None:
                return max(1, lacking)
        return super().uncached_tokens(ctx, engines)

    def _holder(self, ctx: RequestContext, engines: Sequence[Engine], holder: Holder) -> Engine | None:
        """The holder's engine if the request should go there (one outcome counted either way)."""
        index, outcome, lacking = self._holder_at(ctx, engines, holder)
        prompt = len(ctx.cycle[self._ids_key])
        ctx.route_note = (
            f"lmcache={holder.instance}; matched={holder.tokens}/{prompt}; location={holder.location}"
        )
        self._count(ctx, outcome)
        if index is None:
            return None
        engine = engines[index]
        ctx.prefill_tokens = max(1, lacking)
        # The fallback's index learns where the prompt went, as when it places a request itself.
        keys = self._keys(ctx, engine.kv_block_size or engine.kind.default_block_tokens)
        self.claim(ctx, engine, keys)
        return engine

    def _holder_at(
        self, ctx: RequestContext, engines: Sequence[Engine], holder: Holder
    ) -> tuple[int | None, str, int]:
        """(the holder's position among ``engines`` when the request should go there, else None; the
        lookup's outcome; the prompt tokens the holder lacks). Changes nothing."""
        lacking = len(ctx.cycle[self._ids_key]) - holder.tokens
        if lacking > self.threshold:
            return None, "below_threshold", lacking
        index = next((i for i, e in enumerate(engines) if e.name == holder.instance), None)
        if index is None:  # not an engine of this model now, unhealthy, saturated, or unknown
            return None, "holder_unavailable", lacking
        if len(engines) > 1:
            loads = engine_loads(engines)
            if loads[index] >= bounded_capacity(loads, self.epsilon) + self.slack:
                return None, "holder_busy", lacking
        return index, "routed", lacking

    def _count(self, ctx: RequestContext, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.lmcache_lookup(ctx.model, outcome)

    def describe(self) -> dict[str, Any]:
        return {
            "controller_url": self.controller.url,
            "threshold": self.threshold,
            "timeout": self.controller.timeout,
            "fallback": super().describe(),
        }
