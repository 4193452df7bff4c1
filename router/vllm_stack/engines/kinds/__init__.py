"""Engine kinds: everything the router knows about one engine implementation, one module per kind.

An engine's kind (:class:`.base.EngineKind`) says where its models, metrics and KV-event sources are,
what its ``/metrics`` series mean, how its KV events are decoded, its LoRA adapter API and the texts of
its answers, its disaggregation hand-over and the sense of its ``priority`` field. Every other part of
the router asks the engine's kind, resolved once when the engine joins (``Engine.kind``), never per
request. A kind is the module ``vllm_stack.engines.kinds.<name>`` holding ``KIND``: a new kind is one
module, named by the router setting and the Pod label that select it.
"""

from __future__ import annotations

import importlib
import re

from vllm_stack.engines.kinds.base import EngineKind

DEFAULT_KIND = "vllm"
KIND_LABEL = "vllm-stack.io/engine-kind"  # the Pod label the chart sets, read by Kubernetes discovery

_NAME = re.compile(r"[a-z][a-z0-9_]*")


def kind_named(name: str | None) -> EngineKind:
    """The kind called ``name`` (``None``: the default, vLLM); ``ValueError`` when there is none."""
    name = name or DEFAULT_KIND
    if name == "base" or not _NAME.fullmatch(name):
        raise ValueError(f"unknown engine kind {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError:
        raise ValueError(f"unknown engine kind {name!r}") from None
    kind = getattr(module, "KIND", None)
    if not isinstance(kind, EngineKind):
        raise ValueError(f"unknown engine kind {name!r}")
    return kind
