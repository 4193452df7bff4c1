"""The hot path's entry: one proxied OpenAI/vLLM request, from the parsed request to the director.

(authenticated on its head: :mod:`.head`) -> parse only the routing fields -> resolve the model (400 / 404) and the priority
(:mod:`.priority`: 400 / 403) -> build the upstream request once -> hand over to the director (:mod:`vllm_stack.director`), which admits, schedules,
relays, retries and accounts (a model that exists but has no engine now is its 503). The server
already bounded the body (413) before this is called.
"""

from __future__ import annotations

import time

from vllm_stack.api.parsing import multipart_field, with_top_level
from vllm_stack.api.state import RouterState
from vllm_stack.director.request import ProxiedRequest
from vllm_stack.engines.adapters import AdapterCatalog, AdapterSpec
from vllm_stack.errors import RouterError, model_not_found
from vllm_stack.relay.headers import connection_listed
from vllm_stack.request_id import new_request_id, valid_request_id
from vllm_stack.scheduling.framework import RequestContext
from vllm_stack.server.http1 import HttpConnection, HttpRequest

UNKNOWN_MODEL_LABEL = "unknown"  # bounded metric label for names no engine serves


def _resolve_model(
    router: RouterState, path: str, model: str | None, spec: AdapterSpec | None = None
) -> tuple[str, str]:
    """The model to route and its metric label; 400 when none is named, 404 when no engine has it
    and it is not configured (a registered adapter exists when its base model does, loaded anywhere
    or not; a configured model with no engine waits for one: scale from zero)."""
    registry = router.registry
    configured = router.priority.models
    if spec is not None:
        base = spec.base_model
        if (
            registry.candidates(base)
            or registry.is_known(base)
            or base in configured
            or registry.healthy_count == 0
        ):
            return spec.name, spec.name
        raise model_not_found(base, registry.available_models(), what="base model")
    if not model:
        if path in router.endpoints.model_optional:
            bases = registry.base_models()
            if len(bases) == 1:
                return bases[0], bases[0]
        raise RouterError(400, "The request must name a 'model'.", param="model", code="missing_model")
    if registry.candidates(model) or registry.is_known(model) or model in configured:
        return model, model
    if registry.healthy_count == 0:  # nothing is healthy, so the name cannot be checked: the director's 503
        return model, UNKNOWN_MODEL_LABEL
    raise model_not_found(model, registry.available_models())


def model_served(router: RouterState, model: str) -> bool:
    """Whether a request naming ``model`` would be routed (the rule of :func:`_resolve_model`, a weighted
    name's targets included): what a batch's lines are checked against before the batch runs."""
    catalog = router.catalog
    if catalog is not None and catalog.target(model, None) is not None:
        return True
    try:
        _resolve_model(router, "/v1/completions", model, catalog.get(model) if catalog is not None else None)
    except RouterError:
        return False
    return True


def _retarget(
    catalog: AdapterCatalog, model: str | None, session_key: str | None, body: bytes, multipart: bool
) -> tuple[str | None, bytes]:
    """A weighted model name replaced by the target chosen for this request, in the body too (the
    engine knows only the target); anything else unchanged."""
    if model is None:
        return model, body
    target = catalog.target(model, session_key)
    if target is None:
        return model, body
    if multipart:
        raise RouterError(
            400,
            f"'{model}' is a weighted model name; this endpoint needs a model by its own name.",
            param="model",
        )
    return target, with_top_level(body, "model", target)


def _header_lines(headers: list[tuple[bytes, bytes]], drop: frozenset[bytes]) -> list[bytes]:
    """The upstream header lines without ``drop``; a client ``X-Request-Id`` only when it is valid
    (the same rule as the common path in :func:`handle`)."""
    parts: list[bytes] = []
    for name, value in headers:
        if name not in drop and (name != b"x-request-id" or valid_request_id(value)):
            parts += (name, b": ", value, b"\r\n")
    return parts


def resolve(
    router: RouterState,
    path: str,
    body: bytes,
    content_type: bytes,
    session_value: bytes | None,
    priority_value: bytes | None,
    headers: list[tuple[bytes, bytes]],
) -> RequestContext:
    """The request's context from its body and routed headers: the routing fields parsed, a weighted
    model name retargeted, the model resolved (400 / 404) and the priority (400 / 403); ``ctx.body`` is
    the body as the engine gets it. The caller sets ``request_id`` and ``arrived``. The router's own
    requests and the endpoint picker's (:mod:`vllm_stack.epp`) both come through here."""
    multipart = path in router.endpoints.multipart
    if multipart:
        if not content_type.startswith(b"multipart/form-data"):
            raise RouterError(400, "This endpoint takes multipart/form-data.", code="invalid_content_type")
        model = multipart_field(body, content_type, b"model")
        user = prefix = prompt = cache_salt = body_priority = None
    else:
        fields = router.parser.parse(body)
        model, user, prefix = fields.model, fields.user, fields.prefix
        prompt, cache_salt, body_priority = fields.prompt, fields.cache_salt, fields.priority
    session_key = session_value.decode("latin-1") if session_value is not None else user
    spec = None
    catalog = router.catalog
    if catalog is not None:
        model, body = _retarget(catalog, model, session_key, body, multipart)
        spec = catalog.get(model) if model else None
    model, model_label = _resolve_model(router, path, model, spec)
    priority = 0
    policy = router.priority
    if priority_value is not None or body_priority is not None or policy.defaults:
        priority = policy.resolve(model, spec, priority_value, body_priority, headers)
        if not multipart:
            body = policy.engine_body(spec.base_model if spec else model, priority, body, body_priority)
    ctx = RequestContext(model, session_key, prefix, path, body, prompt, cache_salt, b"", model_label)
    if spec is not None:
        ctx.adapter = spec
        ctx.pool = spec.base_model
    if priority:
        ctx.priority = priority
    return ctx


def provider_body(router: RouterState, ctx: RequestContext) -> bytes:
    """The body as an external provider gets it: an alias of one of its models replaced by the provider's
    own id (a local engine serving the same name gets the client's ``ctx.body``; multipart is left)."""
    own = router.external_aliases.get(ctx.model)
    if own is None or ctx.path in router.endpoints.multipart:
        return ctx.body
    return with_top_level(ctx.body, "model", own)


def handle(router: RouterState, conn: HttpConnection, request: HttpRequest) -> None:
    """Answer an error at once, or hand the request to the director."""
    started = time.perf_counter()
    request_id: bytes | None = None
    session_value: bytes | None = None
    connection: bytes | None = None
    content_type = b""
    session_header = router.session_header
    policy = router.priority
    priority_header = policy.header
    priority_value: bytes | None = None
    tenant_headers = router.identity.headers  # (empty with client keys: the key names the tenant)
    tenant_value: bytes | None = None
    tenant_rank = len(tenant_headers)  # the rank of the header tenant_value came from (lower decides)
    # One pass over the headers finds the routed ones and builds the upstream header lines.
    lines: list[bytes] = []
    drop = router.request_drop
    for name, value in request.headers:
        if name in drop:
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
        elif name == priority_header:
            priority_value = value
        elif name in tenant_headers:
            rank = tenant_headers[name]
            if rank < tenant_rank:  # the configured header over the alias; a repeated one: its first
                tenant_value, tenant_rank = value, rank
        lines += (name, b": ", value, b"\r\n")
    if connection is not None:  # rare: headers the client declared hop-by-hop stay on this hop
        listed = connection_listed(request.headers)
        if listed:
            lines = _header_lines(request.headers, drop | listed)
            if b"x-request-id" in listed:  # the client's id was for this hop only: the router's own
                request_id = None
    if request_id is None:
        request_id = new_request_id()
        lines += (b"x-request-id: ", request_id, b"\r\n")
    path = request.path
    try:  # the API key was checked on the head (api.head), before the body was read
        ctx = resolve(
            router, path, request.body, content_type, session_value, priority_value, request.headers
        )
    except RouterError as err:
        router.metrics.observe_request(
            UNKNOWN_MODEL_LABEL, "none", str(err.status), time.perf_counter() - started
        )
        tracer = router.director.tracer
        if tracer is not None:
            tracer.answered_early(request.method, path, request.headers, started, err.status)
        conn.send_error(err, request_id, request.keep_alive)
        return
    ctx.request_id = request_id
    ctx.arrived = started
    identity = router.identity
    if identity.keyed:  # the key the head check passed (request.holder: the key offered)
        ctx.tenant = identity.of_key(request.holder)
    elif tenant_value is not None:
        ctx.tenant = identity.of_header(tenant_value)
    director = router.director
    key = director.settings.engine_auth
    provider_tail = None
    if ctx.model in router.external_models:  # a provider's legs: its key (the leg's head), its model id
        aliased = provider_body(router, ctx)
        provider_tail = b"".join(lines) + b"content-length: %d\r\n\r\n" % len(aliased) + aliased
    if key:  # a local engine's legs (a provider's model may be served locally too)
        lines += (b"authorization: ", key, b"\r\n")
    body = ctx.body
    lines += (b"content-length: ", b"%d" % len(body), b"\r\n\r\n", body)
    # Everything after the request line, Host and plugins' headers: the same for every leg of a kind.
    tail = b"".join(lines)
    ProxiedRequest(director, conn, request, ctx, tail, provider_tail)  # starts it
