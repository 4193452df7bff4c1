"""The hot path: one proxied OpenAI/vLLM request from receipt to accounting.

receive -> authenticate -> read the bounded body -> parse only the routing fields -> resolve the
model (404 / 503) -> forward with retries (proxy) while watching for a client disconnect -> metrics.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import TYPE_CHECKING, Any

from vllm_stack.api.errors import RouterError, send_error
from vllm_stack.api.http import Receive, Send, read_body
from vllm_stack.api.parsing import multipart_field
from vllm_stack.proxy import ForwardState
from vllm_stack.scheduling.framework import RequestContext

if TYPE_CHECKING:
    from vllm_stack.app import Router

#: Endpoints forwarded to an engine of the request's model.
PROXIED_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/rerank",
        "/rerank",
        "/v1/score",
        "/score",
        "/tokenize",
        "/detokenize",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/pooling",
        "/classify",
        "/v1/classify",
    }
)
#: Endpoints where vLLM lets ``model`` be omitted: the only base model is used then.
MODEL_OPTIONAL = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/rerank",
        "/v1/rerank",
        "/score",
        "/v1/score",
        "/pooling",
        "/classify",
        "/v1/classify",
    }
)
MULTIPART_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
UNKNOWN_MODEL_LABEL = "unknown"  # bounded metric label for names no engine serves
WATCH_AFTER = 0.02  # seconds before a request gets a client-disconnect watcher


def new_request_id() -> bytes:
    """128 random bits as 32 hex digits (unique, not secret: no need for the OS entropy syscall)."""
    return b"%032x" % random.getrandbits(128)


def _resolve_model(router: Router, path: str, model: str | None) -> str:
    registry = router.registry
    if not model:
        if path in MODEL_OPTIONAL:
            bases = registry.base_models()
            if len(bases) == 1:
                return bases[0]
        raise RouterError(400, "The request must name a 'model'.", param="model", code="missing_model")
    if registry.candidates(model):
        return model
    if registry.is_known(model) or registry.healthy_count == 0:
        raise RouterError(
            503,
            f"No healthy engine is available for model '{model}'.",
            code="no_healthy_engine",
            headers=[(b"retry-after", b"1")],
        )
    available = ", ".join(registry.available_models()) or "none"
    raise RouterError(
        404,
        f"The model '{model}' does not exist. Available models: {available}.",
        param="model",
        code="model_not_found",
    )


async def handle_proxied(router: Router, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    started = time.perf_counter()
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    request_id: bytes | None = None
    session_value: bytes | None = None
    content_type = b""
    content_length: bytes | None = None
    session_header = router.session_header
    for k, v in headers:
        if k == b"x-request-id":
            request_id = v
        elif k == session_header:
            session_value = v
        elif k == b"content-type":
            content_type = v
        elif k == b"content-length":
            content_length = v
    has_request_id = request_id is not None
    if request_id is None:
        request_id = new_request_id()
    path: str = scope["path"]
    model_label = UNKNOWN_MODEL_LABEL
    state = ForwardState()
    task = asyncio.current_task()
    assert task is not None
    loop = task.get_loop()
    watcher: asyncio.Task[None] | None = None
    watch_timer: asyncio.TimerHandle | None = None
    client_gone = False

    async def watch_disconnect() -> None:
        nonlocal client_gone
        message = await receive()
        if message["type"] == "http.disconnect" and not state.finished:
            client_gone = True
            task.cancel()

    def start_watcher() -> None:
        nonlocal watcher
        watcher = loop.create_task(watch_disconnect())

    try:
        if not router.auth.check(headers):
            raise RouterError(401, "Invalid or missing API key.", code="invalid_api_key")
        body = await read_body(receive, router.max_body_bytes, content_length)
        if body is None:
            state.status = "client_closed"
            return
        if path in MULTIPART_PATHS:
            if not content_type.startswith(b"multipart/form-data"):
                raise RouterError(
                    400, "This endpoint takes multipart/form-data.", code="invalid_content_type"
                )
            model = multipart_field(body, content_type, b"model")
            user = None
            prefix = None
        else:
            fields = router.parser.parse(body)
            model, user, prefix = fields.model, fields.user, fields.prefix
        model = _resolve_model(router, path, model)
        model_label = model
        if session_value is not None:
            session_key: str | None = session_value.decode("latin-1")
        else:
            session_key = user
        ctx = RequestContext(model, session_key, prefix)
        raw_path = scope.get("raw_path")
        path_qs = raw_path.decode("latin-1") if raw_path else path
        qs = scope.get("query_string")
        if qs:
            path_qs += "?" + qs.decode("latin-1")
        # Watch for a client disconnect only once the request has lasted WATCH_AFTER: most requests to
        # a fast engine finish before, and a task per request is a large share of the router's CPU.
        # A client that left earlier is still noticed then (receive() reports it at once).
        watch_timer = loop.call_later(WATCH_AFTER, start_watcher)
        await router.proxy.forward(
            send, scope["method"], path_qs, headers, body, ctx, request_id, has_request_id, state, started
        )
    except RouterError as err:  # raised only while nothing was sent to the client
        state.status = str(err.status)
        await send_error(send, err, request_id)
    except asyncio.CancelledError:
        if not client_gone:
            raise
        task.uncancel()
        state.status = "client_closed"
    finally:
        if watch_timer is not None:
            watch_timer.cancel()
        if watcher is not None:
            watcher.cancel()
        engine = state.engine
        router.metrics.observe_request(
            model_label,
            engine.name if engine is not None else "none",
            state.status,
            time.perf_counter() - started,
        )
