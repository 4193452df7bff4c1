"""The router's own endpoints and the ones it answers from the registry instead of one engine."""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qsl

import orjson

from vllm_stack.api.http import Receive, Send, read_json_object, send_bytes, send_json
from vllm_stack.api.state import RouterState
from vllm_stack.engines.external import ENGINE_PREFIX
from vllm_stack.engines.sleep import valid_level
from vllm_stack.errors import RouterError, model_not_found, no_healthy_engine
from vllm_stack.version import router_version


async def health(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Liveness: the process answers."""
    await send_json(send, 200, {"status": "ok"})


async def ready(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Readiness: discovery runs and reported at least once, at least one engine is healthy, and where
    routing follows the engines' KV events, every healthy engine's are followed (or it has none): a
    replica that took requests before would place them without knowing what the engines cache."""
    discovery_ok = router.discovery_running()
    healthy = router.registry.healthy_count
    following = router.kv_feed.following()
    ok = discovery_ok and healthy > 0 and following
    await send_json(
        send,
        200 if ok else 503,
        {
            "ready": ok,
            "discovery_running": discovery_ok,
            "healthy_engines": healthy,
            "kv_events_following": following,
        },
    )


async def version(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    await send_json(send, 200, {"version": router_version()})


async def metrics(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    accept = next((v for k, v in scope["headers"] if k == b"accept"), b"").decode("latin-1")
    body, content_type = router.metrics.exposition(accept)
    await send_bytes(send, 200, body, content_type.encode())


async def engines(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Engines, their models, health, circuit breaker and load (router in-flight and scraped queue)."""
    await send_json(
        send,
        200,
        {
            "routing_logic": router.config.routing_logic,
            "discovery": router.discovery.status.describe(),
            "scheduling": router.scheduling_description(),
            "engines": [e.describe() for e in sorted(router.registry.engines(), key=lambda e: e.name)],
        },
    )


async def models(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """``GET /v1/models``: union over healthy engines, deduplicated, vLLM's fields kept; registered
    adapters (with their base model as ``parent``) and weighted names too, loaded anywhere or not."""
    cards = router.registry.model_cards()
    if router.catalog is not None:
        seen = {c["id"] for c in cards}
        cards += [c for c in router.catalog.cards() if c["id"] not in seen]
        cards.sort(key=lambda c: c["id"])
    await send_json(send, 200, {"object": "list", "data": cards})


def _check_admin(router: RouterState, headers: list[tuple[bytes, bytes]]) -> None:
    """Adapter loads and unloads through the router need an admin key (refused when none is set)."""
    if not router.admin_auth.enabled:
        raise RouterError(
            403,
            "Loading and unloading adapters through the router is off: no admin key is configured "
            "(admin_api_keys_file or VLLM_STACK_ADMIN_API_KEYS).",
            code="admin_key_required",
        )
    if not router.admin_auth.check(headers):
        raise RouterError(403, "This endpoint needs an admin API key.", code="admin_key_required")


def admin_if_keys_refusal(router: RouterState, headers: list[tuple[bytes, bytes]]) -> RouterError | None:
    """The sleep endpoints' rule: an admin key when admin keys are configured; else a client key when
    client keys are (as every other route: keys on must not leave engines open to put to sleep); open
    only when the router has no keys at all, as production-stack's router serves them."""
    if router.admin_auth.enabled:
        if not router.admin_auth.check(headers):
            return RouterError(403, "This endpoint needs an admin API key.", code="admin_key_required")
        return None
    if not router.auth.check(headers):
        return RouterError(401, "Invalid or missing API key.", code="invalid_api_key")
    return None


async def lora_fanout(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` sent to every engine of the base model.

    Both need an admin key. Load takes registered adapters only (``lora_adapters``; a ``lora_path``
    other than the registered source is refused, so no client key can make engines read an arbitrary
    path) and goes to every engine of the adapter's base model. Unload: the engines that have it.
    Each engine is called at its kind's adapter path, and its kind says which answers mean success.
    All succeed -> the first engine's answer unchanged; otherwise the first failure's status with every
    engine's result in the message. Targeted engines are re-probed so ``/v1/models`` shows the change now.
    """
    headers = scope["headers"]
    _check_admin(router, headers)
    doc = await read_json_object(receive, router.max_body_bytes, headers)
    if doc is None:
        return
    if not isinstance(doc.get("lora_name"), str):
        raise RouterError(
            400, "The request must name a 'lora_name'.", param="lora_name", code="missing_lora_name"
        )
    registry = router.registry
    unload = scope["path"].endswith("unload_lora_adapter")
    base = doc.pop("base_model", None)
    spec = None
    if unload:
        targets = list(registry.candidates(doc["lora_name"]))
        if not targets:
            raise RouterError(
                404,
                f"The LoRA adapter '{doc['lora_name']}' is not loaded on any healthy engine.",
                code="model_not_found",
            )
    else:
        spec = router.adapters.catalog.get(doc["lora_name"])
        if spec is None:
            raise RouterError(
                400,
                f"The LoRA adapter '{doc['lora_name']}' is not registered in the router's lora_adapters.",
                param="lora_name",
                code="adapter_not_registered",
            )
        if doc.get("lora_path") not in (None, spec.lora_path, spec.source):
            raise RouterError(
                400,
                f"'lora_path' differs from the registered source of '{spec.name}'.",
                param="lora_path",
                code="adapter_source_mismatch",
            )
        if base is not None and base != spec.base_model:
            raise RouterError(
                400, f"'{spec.name}' is registered for base model '{spec.base_model}'.", param="base_model"
            )
        doc["lora_path"] = spec.lora_path
        base = spec.base_model
        targets = list(registry.candidates(str(base)))
        if not targets and not registry.is_known(str(base)) and registry.healthy_count > 0:
            # as for an unknown model on the proxied paths: retrying cannot help
            raise model_not_found(
                str(base), registry.available_models(), param="base_model", what="base model"
            )
        if not targets:
            raise no_healthy_engine(str(base))
    payload = orjson.dumps(doc)
    up_headers = {"content-type": "application/json"}
    if router.engine_api_key:
        up_headers["authorization"] = "Bearer " + router.engine_api_key
    session = router.control_session

    async def call(engine: Any) -> tuple[Any, int, bytes, str]:
        try:
            api = engine.kind.adapters
            path = api.unload_path if unload else api.load_path
            async with session.post(engine.url + path, data=payload, headers=up_headers) as resp:
                return engine, resp.status, await resp.read(), resp.headers.get("content-type", "text/plain")
        except Exception as exc:  # noqa: BLE001 - reported per engine
            return engine, 502, f"{type(exc).__name__}: {exc}".encode(), "text/plain"

    results = await asyncio.gather(*(call(e) for e in targets))
    # an engine that has it already (a hot adapter, an earlier load) counts as loaded
    results = [
        (e, 200, b, t) if not unload and e.kind.adapters.load_ok(st, b) else (e, st, b, t)
        for e, st, b, t in results
    ]
    for engine, status, _, _ in results:
        if status != 200:
            continue
        if spec is None:
            registry.forget_adapter(engine, doc["lora_name"])
        else:
            registry.learn_adapter(engine, spec.card())
    registry.refresh_soon(targets)
    failures = [r for r in results if r[1] >= 300]
    if not failures:
        _, status, rbody, ctype = results[0]
        await send_bytes(send, status, rbody, ctype.encode())
        return
    detail = "; ".join(f"{e.name}: {st} {b[:200].decode(errors='replace')}" for e, st, b, _ in results)
    raise RouterError(
        failures[0][1] if failures[0][1] < 600 else 502,
        f"LoRA operation failed on some engines: {detail}",
        code="lora_fanout_failed",
    )


async def sleep_control(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """``POST /sleep``, ``POST /wake_up``, ``GET /is_sleeping`` with ``?id=ENGINE_ID``, as production-stack's
    router answers them: sent to that one engine with the other query parameters (vLLM's ``level``,
    ``mode``, ``tags``); ``/is_sleeping`` answers the engine's ``{"is_sleeping": ...}``, the other two
    ``{"status": "success"}`` with the engine's status. Unlike production-stack's (a 500), an engine's
    refusal comes back with its status and text, as an OpenAI-style error naming the engine."""
    path = scope["path"]
    params = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    wanted = next((v for k, v in params if k == "id"), None)
    if not wanted:
        raise RouterError(
            400, "Invalid request: missing target Engine Id.", param="id", code="missing_engine_id"
        )
    engine = router.registry.by_engine_id(wanted)
    if engine is None:
        raise RouterError(400, f"Engine with Id {wanted} not found.", param="id", code="engine_not_found")
    if engine.name.startswith(ENGINE_PREFIX):  # a provider: never sent the engines' key, nor these calls
        raise RouterError(
            400,
            f"Engine with Id {wanted} is an external provider, not an engine that sleeps.",
            param="id",
            code="engine_cannot_sleep",
        )
    forwarded = [(k, v) for k, v in params if k != "id"]
    for key, value in forwarded:
        if key == "level" and not valid_level(value):
            raise RouterError(
                400,
                f"Invalid sleep level {value!r}: vLLM's levels are 0, 1 and 2.",
                param="level",
                code="invalid_sleep_level",
            )
    try:
        status, body, ctype = await router.sleep.forward(engine, scope["method"], path, forwarded)
    except Exception as exc:  # noqa: BLE001 - the engine could not be reached: a 502 that says so
        raise RouterError(
            502,
            f"Engine {engine.name} did not answer {path}: {type(exc).__name__}: {exc}",
            code="upstream_error",
        ) from None
    if status >= 300:
        text = body[:500].decode(errors="replace")
        hint = " (vLLM serves it with VLLM_SERVER_DEV_MODE=1)" if status == 404 else ""
        raise RouterError(
            status if 400 <= status < 500 else 502,  # an engine's failure is a bad gateway here, never a 500
            f"Engine {engine.name} refused {path}{hint}: {status} {text}",
            code="engine_refused",
        )
    if scope["method"] != "POST":  # /is_sleeping: the engine's answer
        await send_bytes(send, status, body, ctype.encode())
        return
    await send_json(send, status, {"status": "success"})
