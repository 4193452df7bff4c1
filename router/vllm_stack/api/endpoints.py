"""The router's own endpoints and the ones it answers from the registry instead of one engine."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from vllm_stack.api.http import Receive, Send, read_body, send_bytes, send_json
from vllm_stack.api.state import RouterState
from vllm_stack.errors import RouterError, model_not_found, no_healthy_engine
from vllm_stack.version import router_version


async def health(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Liveness: the process answers."""
    await send_json(send, 200, {"status": "ok"})


async def ready(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Readiness: discovery runs and reported at least once, and at least one engine is healthy."""
    discovery_ok = router.discovery_running()
    healthy = router.registry.healthy_count
    ok = discovery_ok and healthy > 0
    await send_json(
        send, 200 if ok else 503, {"ready": ok, "discovery_running": discovery_ok, "healthy_engines": healthy}
    )


async def version(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    await send_json(send, 200, {"version": router_version()})


async def metrics(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    body, content_type = router.metrics.exposition()
    await send_bytes(send, 200, body, content_type.encode())


async def engines(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Engines, their models, health, circuit breaker and load (router in-flight and scraped queue)."""
    await send_json(
        send,
        200,
        {
            "routing_logic": router.config.routing_logic,
            "scheduling": router.scheduling_description(),
            "engines": [e.describe() for e in sorted(router.registry.engines(), key=lambda e: e.name)],
        },
    )


async def models(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """``GET /v1/models``: union over healthy engines, deduplicated, vLLM's fields kept."""
    await send_json(send, 200, {"object": "list", "data": router.registry.model_cards()})


async def lora_fanout(router: RouterState, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` sent to every engine of the base model.

    Load: the engines serving ``base_model`` (a router-only field, removed before forwarding), or, when
    it is absent and one base model is served, all of them. Unload: the engines that have the adapter.
    All succeed -> the first engine's answer unchanged; otherwise the first failure's status with every
    engine's result in the message. Targeted engines are re-probed so ``/v1/models`` shows the change now.
    """
    headers = scope["headers"]
    content_length = next((v for k, v in headers if k == b"content-length"), None)
    body = await read_body(receive, router.max_body_bytes, content_length)
    if body is None:
        return
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RouterError(400, f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("lora_name"), str):
        raise RouterError(
            400, "The request must name a 'lora_name'.", param="lora_name", code="missing_lora_name"
        )
    registry = router.registry
    unload = scope["path"].endswith("unload_lora_adapter")
    base = doc.pop("base_model", None)
    if unload:
        targets = list(registry.candidates(doc["lora_name"]))
        if not targets:
            raise RouterError(
                404,
                f"The LoRA adapter '{doc['lora_name']}' is not loaded on any healthy engine.",
                code="model_not_found",
            )
    else:
        if base is None:
            bases = registry.base_models()
            if len(bases) != 1:
                raise RouterError(
                    400,
                    f"Several base models are served ({', '.join(bases) or 'none'}); name one in 'base_model'.",
                    param="base_model",
                )
            base = bases[0]
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
            async with session.post(engine.url + scope["path"], data=payload, headers=up_headers) as resp:
                return engine, resp.status, await resp.read(), resp.headers.get("content-type", "text/plain")
        except Exception as exc:  # noqa: BLE001 - reported per engine
            return engine, 502, f"{type(exc).__name__}: {exc}".encode(), "text/plain"

    results = await asyncio.gather(*(call(e) for e in targets))
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
