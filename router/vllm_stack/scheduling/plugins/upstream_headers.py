"""Pre-request: headers added to the request sent to the picked engine.

The example of the pre-request extension point, which runs once an engine is picked and before the
request is written to it (the place a LoRA adapter is loaded on the picked engine). Parameters:
``headers`` (name -> value, sent as given) and ``engine_header`` (a header naming the picked engine,
so engine logs show which router decision sent them the request; empty for none).
"""

from __future__ import annotations

from vllm_stack.config import ConfigError
from vllm_stack.engines.engine import Engine
from vllm_stack.scheduling.framework import RequestContext, Role
from vllm_stack.scheduling.registry import Parameters, PluginContext

_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _checked(plugin: str, name: str, value: str) -> bytes:
    if not name or not set(name) <= _TOKEN or any(c in value for c in "\r\n\0"):
        raise ConfigError(f"plugin {plugin!r}: bad header {name!r}")
    return f"{name.lower()}: {value}\r\n".encode("latin-1")


class UpstreamHeaders:
    type_name = "upstream-headers"
    roles = (Role.PRE_REQUEST,)

    def __init__(self, name: str, fixed: bytes, engine_header: bytes) -> None:
        self.name = name
        self._fixed = fixed
        self._engine_header = engine_header

    @classmethod
    def create(cls, name: str, parameters: Parameters, context: PluginContext) -> UpstreamHeaders:
        fixed = b"".join(_checked(name, k, v) for k, v in parameters.mapping("headers").items())
        engine_header = parameters.string("engine_header", "")
        if engine_header:
            _checked(name, engine_header, "")
        return cls(name, fixed, engine_header.lower().encode("latin-1"))

    def pre_request(self, ctx: RequestContext, engine: Engine) -> None:
        extra = self._fixed
        if self._engine_header:
            extra += b"%s: %s\r\n" % (self._engine_header, engine.name.encode("latin-1", "replace"))
        ctx.upstream_headers += extra
