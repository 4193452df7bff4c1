"""A request's priority: asked for in a header or in vLLM's ``priority`` body field, defaulted by its
model or adapter, and allowed to rise only for keys that may raise it.

- the header (``priority_header``, default ``x-request-priority``): ``critical``, ``standard``,
  ``sheddable`` or an integer (the Gateway API Inference Extension's sense: higher is more important);
- else the body's ``priority`` (vLLM's sense, lower is handled first, so it is negated here);
- else the adapter's ``criticality``, else the model's (router setting ``models``), else 0 (standard).

Asking for more than the default needs a key listed in ``priority_api_keys_file``
(``VLLM_STACK_PRIORITY_API_KEYS``); any other request may only lower it, and one that asks for more
is answered 403 ``priority_not_allowed``, so no client gets more than it was granted without
knowing. For a model whose engines schedule by priority (``engine_priority``: vLLM's
``--scheduling-policy priority``, SGLang's ``--enable-priority-scheduling``), the body the engine gets
carries the resolved priority in its kind's sense (vLLM: lower first; SGLang: higher first).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from vllm_stack.api.auth import ApiKeyAuth
from vllm_stack.api.parsing import with_top_level
from vllm_stack.config import RouterConfig
from vllm_stack.engines.adapters import AdapterSpec
from vllm_stack.engines.kinds import kind_named
from vllm_stack.errors import RouterError
from vllm_stack.priority import MAX_PRIORITY, ServedModel, parse_priority, served_models


class PriorityPolicy:
    """The router's priority settings, built once per configuration."""

    __slots__ = ("header", "models", "raisers", "defaults", "engine_signs")

    def __init__(self, config: RouterConfig) -> None:
        self.header = config.priority_header.lower().encode("latin-1")
        self.models: dict[str, ServedModel] = served_models(config.models)
        self.raisers = ApiKeyAuth(config.priority_api_keys)
        # Models whose engines schedule by priority -> the sign of its sense there (the engines' kind,
        # resolved here once: vLLM -1, lower first; SGLang +1, higher first). A ValueError names an
        # unknown kind.
        self.engine_signs: dict[str, int] = {
            name: kind_named(m.engine_kind).priority_sign
            for name, m in self.models.items()
            if m.engine_priority
        }
        # The hot path asks only when a request names a priority or some model has a default.
        self.defaults = any(m.priority or m.engine_priority for m in self.models.values()) or any(
            isinstance(a, Mapping) and a.get("criticality") is not None for a in config.lora_adapters
        )

    def default(self, model: str, spec: AdapterSpec | None) -> int:
        if spec is not None and spec.priority is not None:
            return spec.priority
        served = self.models.get(spec.base_model if spec is not None else model)
        return served.priority if served is not None else 0

    def resolve(
        self,
        model: str,
        spec: AdapterSpec | None,
        header: bytes | None,
        body_priority: object,
        headers: Iterable[tuple[bytes, bytes]],
    ) -> int:
        """The request's priority, or a 400 (malformed) / 403 (a rise this key may not ask for)."""
        default = self.default(model, spec)
        if header is not None:
            try:
                asked = parse_priority(header.decode("latin-1"))
            except ValueError as exc:
                raise RouterError(
                    400, f"Header '{self.header.decode()}': {exc}", code="invalid_priority"
                ) from None
        elif body_priority is not None:
            if isinstance(body_priority, bool) or not isinstance(body_priority, int):
                raise RouterError(
                    400, "'priority' must be an integer", param="priority", code="invalid_priority"
                )
            if abs(body_priority) > MAX_PRIORITY:
                raise RouterError(
                    400,
                    f"'priority' must be within +-{MAX_PRIORITY}",
                    param="priority",
                    code="invalid_priority",
                )
            asked = -body_priority
        else:
            return default
        if asked > default and not (self.raisers.enabled and self.raisers.check(headers)):
            raise RouterError(
                403,
                f"This API key may not raise the priority of '{model}' above {default}.",
                code="priority_not_allowed",
            )
        return asked

    def engine_body(self, pool: str, priority: int, body: bytes, body_priority: object) -> bytes:
        """``body`` as the engines of ``pool`` get it: with ``priority`` in their kind's sense when they
        schedule by it (vLLM's: negated)."""
        sign = self.engine_signs.get(pool)
        if sign is None or body_priority == sign * priority:
            return body
        if priority == 0 and body_priority is None:
            return body
        return with_top_level(body, "priority", sign * priority)
