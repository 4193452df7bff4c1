"""The hot path's entry: one proxied OpenAI/vLLM request, from the parsed request to an exchange.

authenticate -> parse only the routing fields -> resolve the model (400 / 404 / 503) -> build the
upstream request once -> hand over to :class:`vllm_stack.relay.exchange.Exchange`, which routes,
relays and accounts. The server already bounded the body (413) before this is called.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from vllm_stack.api.errors import RouterError, model_not_found
from vllm_stack.api.parsing import multipart_field
from vllm_stack.api.request_id import new_request_id, valid_request_id
from vllm_stack.relay.exchange import Exchange
from vllm_stack.relay.headers import REQUEST_DROP, connection_listed
from vllm_stack.scheduling.framework import RequestContext
from vllm_stack.server.http1 import HttpConnection, HttpRequest

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
    raise model_not_found(model, registry.available_models())


def _header_lines(headers: list[tuple[bytes, bytes]], drop: frozenset[bytes]) -> list[bytes]:
    parts: list[bytes] = []
    for name, value in headers:
        if name not in drop:
            parts += (name, b": ", value, b"\r\n")
    return parts


def handle(router: Router, conn: HttpConnection, request: HttpRequest) -> None:
    """Answer an error at once, or start the exchange that forwards the request."""
    started = time.perf_counter()
    request_id: bytes | None = None
    session_value: bytes | None = None
    connection: bytes | None = None
    content_type = b""
    session_header = router.session_header
    # One pass over the headers finds the routed ones and builds the upstream header lines.
    lines: list[bytes] = []
    for name, value in request.headers:
        if name in REQUEST_DROP:
            if name == b"connection":
                connection = value
            continue
        if name == b"x-request-id":
            if not valid_request_id(value):  # replaced below by an id of the router's own
                continue
            request_id = value
        elif name == session_header:
            session_value = value
        elif name == b"content-type":
            content_type = value
        lines += (name, b": ", value, b"\r\n")
    if connection is not None:  # rare: headers the client declared hop-by-hop stay on this hop
        listed = connection_listed(request.headers)
        if listed:
            lines = _header_lines(request.headers, REQUEST_DROP | listed)
    if request_id is None:
        request_id = new_request_id()
        lines += (b"x-request-id: ", request_id, b"\r\n")
    path = request.path
    try:
        if not router.auth.check(request.headers):
            raise RouterError(401, "Invalid or missing API key.", code="invalid_api_key")
        if path in MULTIPART_PATHS:
            if not content_type.startswith(b"multipart/form-data"):
                raise RouterError(
                    400, "This endpoint takes multipart/form-data.", code="invalid_content_type"
                )
            model = multipart_field(request.body, content_type, b"model")
            user = None
            prefix = None
        else:
            fields = router.parser.parse(request.body)
            model, user, prefix = fields.model, fields.user, fields.prefix
        model = _resolve_model(router, path, model)
    except RouterError as err:
        router.metrics.observe_request(
            UNKNOWN_MODEL_LABEL, "none", str(err.status), time.perf_counter() - started
        )
        conn.send_error(err, request_id, request.keep_alive)
        return
    key = router.proxy_settings.engine_auth
    if key:
        lines += (b"authorization: ", key, b"\r\n")
    body = request.body
    lines += (b"content-length: ", b"%d" % len(body), b"\r\n\r\n", body)
    session_key = session_value.decode("latin-1") if session_value is not None else user
    ctx = RequestContext(model, session_key, prefix)
    # Everything after the request line and Host, the same for every attempt.
    tail = b"".join(lines)
    Exchange(router, conn, request, ctx, request_id, tail, started).start()
