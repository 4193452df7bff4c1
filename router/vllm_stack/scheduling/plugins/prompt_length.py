"""Prepare-data: the prompt's size in bytes, for plugins that weigh requests by size.

The example of the prepare-data extension point: it runs before scheduling and leaves its result in
the request's cycle state under its name, where a scorer or filter reads it. The body length is a
cheap proxy for the prompt's token count until a plugin tokenizes.
"""

from __future__ import annotations

from vllm_stack.scheduling.framework import RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext


class PromptLength:
    type_name = "prompt-length"
    roles = (Role.PREPARE_DATA,)

    def __init__(self, name: str = "prompt-length") -> None:
        self.name = name

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> PromptLength:
        return cls(name)

    def prepare(self, ctx: RequestContext) -> None:
        ctx.cycle[self.name] = len(ctx.body)
