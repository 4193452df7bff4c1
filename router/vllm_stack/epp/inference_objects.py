"""The Inference Extension's objects the endpoint picker reads from the API server.

- InferencePool (``inference.networking.k8s.io/v1``): its ``selector.matchLabels`` and first
  ``targetPorts`` number become the Kubernetes discovery's label selector and port, read once at start
  (a changed pool takes a restart, as the router's other discovery settings do).
- InferenceObjective (``inference.networking.x-k8s.io/v1alpha2``): the ``priority`` of each objective
  of this pool, by name, for the ``x-gateway-inference-objective`` header; listed, then watched, and
  listed again after any watch failure. An objective that is missing or has no priority leaves the
  request's own priority (the router's rules: its header, its model's default), as the upstream picker
  leaves 0. The Extension's integer priorities have the router's sense (higher first, below 0 sheddable).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from vllm_stack.engines.discovery.kubernetes import default_api_client
from vllm_stack.priority import MAX_PRIORITY

log = logging.getLogger(__name__)

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
OBJECTIVE_GROUP, OBJECTIVE_VERSION, OBJECTIVE_PLURAL = (
    "inference.networking.x-k8s.io",
    "v1alpha2",
    "inferenceobjectives",
)
RETRY_DELAY = 2.0


class PoolError(RuntimeError):
    """The InferencePool cannot be read or does not say which pods and port."""


def pool_selector(pool: Mapping[str, Any]) -> tuple[str, int]:
    """(label selector, port) of an InferencePool object."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = spec.get("targetPorts") or []
    if not labels or not ports or not isinstance(ports[0], Mapping) or not ports[0].get("number"):
        raise PoolError(
            f"InferencePool {pool.get('metadata', {}).get('name')!r} has no selector.matchLabels or targetPorts"
        )
    if len(ports) > 1:
        log.warning(
            "InferencePool has %d target ports; this picker uses the first, %s",
            len(ports),
            ports[0]["number"],
        )
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())), int(ports[0]["number"])


async def read_pool(namespace: str, name: str) -> tuple[str, int]:
    """The pool's (label selector, port), read from the API server."""
    from kubernetes_asyncio.client import CustomObjectsApi
    from kubernetes_asyncio.client.exceptions import ApiException

    api = await default_api_client()
    try:
        pool = await CustomObjectsApi(api).get_namespaced_custom_object(
            POOL_GROUP, POOL_VERSION, namespace, POOL_PLURAL, name
        )
    except ApiException as error:
        raise PoolError(f"InferencePool {namespace}/{name}: {error.status} {error.reason}") from error
    finally:
        await api.close()
    return pool_selector(pool)


class Objectives:
    """InferenceObjective priorities by name (empty, and never watched, without a pool)."""

    def __init__(self, namespace: str = "", pool: str = "") -> None:
        self.namespace = namespace
        self.pool = pool
        self.priorities: dict[str, int] = {}

    def priority(self, name: str, default: int) -> int:
        return self.priorities.get(name, default)

    def apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        """One object listed or watched (``kind``: ADDED, MODIFIED, DELETED)."""
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            return
        spec = obj.get("spec") or {}
        pool = (spec.get("poolRef") or {}).get("name")
        priority = spec.get("priority")
        if kind == "DELETED" or (self.pool and pool != self.pool) or not isinstance(priority, int):
            self.priorities.pop(name, None)
        else:
            self.priorities[name] = max(-MAX_PRIORITY, min(MAX_PRIORITY, priority))

    async def run(self) -> None:
        """List, then watch, for as long as the picker runs; a failure is logged and retried."""
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client import CustomObjectsApi

        while True:
            api = None
            try:
                api = await default_api_client()
                custom = CustomObjectsApi(api)
                listed = await custom.list_namespaced_custom_object(
                    OBJECTIVE_GROUP, OBJECTIVE_VERSION, self.namespace, OBJECTIVE_PLURAL
                )
                self.priorities = {}
                for item in listed.get("items") or []:
                    self.apply("ADDED", item)
                version = (listed.get("metadata") or {}).get("resourceVersion")
                stream = watch.Watch().stream(
                    custom.list_namespaced_custom_object,
                    OBJECTIVE_GROUP,
                    OBJECTIVE_VERSION,
                    self.namespace,
                    OBJECTIVE_PLURAL,
                    resource_version=version,
                    timeout_seconds=300,
                )
                async for event in stream:
                    self.apply(event["type"], event["object"])
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001 - any failure: list again after a pause
                log.warning(
                    "InferenceObjectives in %s: %s; listing again in %gs", self.namespace, error, RETRY_DELAY
                )
                await asyncio.sleep(RETRY_DELAY)
            finally:
                if api is not None:
                    await api.close()
