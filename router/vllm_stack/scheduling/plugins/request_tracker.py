"""Response-complete: feed each engine's completion tracker (smoothed TTFT and duration, outcomes).

The example of the response-complete extension point, told once per request how it ended. What it
records lives on the engine (:class:`vllm_stack.engines.load.CompletionStats`), so it survives a
reload with the engine, leaves with it, and shows in ``GET /engines``.
"""

from __future__ import annotations

from vllm_stack.scheduling.framework import Completion, RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext


class RequestTracker:
    type_name = "request-tracker"
    roles = (Role.RESPONSE_COMPLETE,)

    def __init__(self, name: str = "request-tracker") -> None:
        self.name = name

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> RequestTracker:
        return cls(name)

    def response_complete(self, ctx: RequestContext, completion: Completion) -> None:
        engine = completion.engine
        if engine is not None and completion.status != "client_closed":
            engine.completions.record(completion.ok, completion.duration, completion.ttft)
