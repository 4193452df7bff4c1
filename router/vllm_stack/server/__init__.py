"""The router's own HTTP/1.1 server (asyncio protocols + httptools); see :mod:`.http1` for why."""

from vllm_stack.server.serve import RouterServer, serve_forever

__all__ = ["RouterServer", "serve_forever"]
