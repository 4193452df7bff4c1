"""Kubernetes discovery: the engine pods of one namespace and label selector, by list + watch.

Why it is built this way:

- **A full re-list before every watch.** A watch only reports changes; whatever happened while no watch
  was open (a dropped connection, an API server restart, a 410 Gone after compaction) is only learnt by
  listing again. production-stack's router re-opened its watch without re-listing, and a deleted pod kept
  receiving traffic for hours. Here every watch, including the one after a normal server-side timeout,
  starts from a fresh list and from that list's resourceVersion, and the list *replaces* the known set,
  so a pod deleted while disconnected disappears.
- **Only routable pods are reported** (a choice; the interface allows ``ready=False`` entries): a pod is
  reported when its phase is Running, it has a pod IP, its ``Ready`` condition is True and it is not
  terminating. The registry learns model names from each reported pod's ``/v1/models``; reporting pods it
  may not route to would only make it probe engines that are still loading. Readiness already includes
  the engine's readiness probe.
- **Terminating pods go at once.** ``metadata.deletionTimestamp`` is set (a MODIFIED event) as soon as
  deletion starts, while the pod is still Ready and before the endpoints controller reacts; new requests
  must stop then, not when the pod finally disappears.
- **Bounded memory.** Only routable pods of this namespace and selector are held, one small
  :class:`EndpointInfo` each; the API objects are dropped as soon as they are read.
- **The last known endpoints stay while the API server is unreachable.** Engines keep serving when the
  control plane is away (an upgrade, an outage); the set is corrected by the list that follows.
- **Bounded exponential backoff with jitter** between failed attempts, so that a broken API server is not
  hammered by every router replica in step, and a recovered one is found again within ``backoff_max``
  (5 s: a Role given back its verb, or an API server back from a restart, is followed within seconds; a
  list of one namespace's engine pods every few seconds per replica costs the API server little).
- **Failures are visible, not only logged.** :class:`DiscoveryStatus` says whether discovery works now and
  why not (``GET /engines``, and the router's ``discovery_healthy`` / ``discovery_failures_total``
  metrics); a refusal names the verb the ServiceAccount lacks and quotes the API server. It is healthy
  only once the list succeeded *and* the watch was accepted: a Role without ``watch`` lets every list
  through, and the set would silently stop following the pods. (A watch accepted and then ended by an
  ERROR event, 410 Gone, shows healthy for that instant. A connection that dies silently is noticed at
  the watch's end, ``watch_timeout_seconds`` plus a grace: until then discovery is shown healthy.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.client import ApiClient, ApiException, Configuration, V1Pod

from vllm_stack.engines.discovery.base import DiscoveryStatus, EndpointInfo, SnapshotSink
from vllm_stack.engines.engine import ROLES
from vllm_stack.engines.kinds import KIND_LABEL

logger = logging.getLogger(__name__)

_LIST_TIMEOUT_S = 30.0  # a list of one namespace's engine pods is small; longer means the server is stuck
_CONNECT_TIMEOUT_S = 10.0
KV_EVENTS_PORT = "kv-events"  # container port names of the engine's KV-event publisher and its replay
KV_REPLAY_PORT = "kv-replay"
#: The pod label that gives an engine's role in disaggregated serving (prefill, decode, both).
ROLE_LABEL = "vllm-stack.io/role"
_WATCH_GRACE_S = 30.0  # past timeoutSeconds + this, a silent watch connection is considered dead


async def default_api_client() -> ApiClient:
    """An API client from the in-cluster service account, or else from the local kubeconfig.

    The configuration is a private :class:`Configuration` object, never the library's global default, so
    that two discoveries (or a test) in one process do not share or overwrite each other's settings.
    """
    configuration = Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        # $KUBECONFIG is read now (the library reads it once, at import); None means ~/.kube/config.
        await config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG") or None,
            client_configuration=configuration,
            persist_config=False,
        )
    return ApiClient(configuration=configuration)


def pod_endpoint(
    pod: V1Pod, port: int, roles_by_model_label: dict[str, str] | None = None
) -> EndpointInfo | None:
    """The endpoint of a pod that may receive traffic now, or None (see the module docstring)."""
    meta, status = pod.metadata, pod.status
    if meta is None or not meta.name or meta.deletion_timestamp is not None:
        return None
    if status is None or status.phase != "Running" or not status.pod_ip:
        return None
    if not any(c.type == "Ready" and c.status == "True" for c in status.conditions or ()):
        return None
    host = f"[{status.pod_ip}]" if ":" in status.pod_ip else status.pod_ip  # IPv6 pod IPs
    ports = named_ports(pod)
    events, replay = ports.get(KV_EVENTS_PORT), ports.get(KV_REPLAY_PORT)
    return EndpointInfo(
        name=meta.name,
        url=f"http://{host}:{port}",
        ready=True,
        kv_events=f"tcp://{host}:{events}" if events else None,
        kv_replay=f"tcp://{host}:{replay}" if replay else None,
        role=pod_role(pod, roles_by_model_label or {}),
        kind=(meta.labels or {}).get(KIND_LABEL),
    )


def pod_role(pod: V1Pod, roles_by_model_label: dict[str, str]) -> str | None:
    """The engine's role from its ``vllm-stack.io/role`` label, else from its ``model`` label by
    production-stack's ``--prefill-model-labels`` / ``--decode-model-labels`` (None: neither; an
    unknown role value is logged and treated the same: the engine serves whole requests)."""
    labels = (pod.metadata.labels if pod.metadata is not None else None) or {}
    role = labels.get(ROLE_LABEL)
    if role is None:
        return roles_by_model_label.get(labels.get("model", ""))
    if role not in ROLES:
        logger.warning("pod %s: unknown %s label %r (known: %s)", pod.metadata.name, ROLE_LABEL, role, ROLES)
        return None
    return role


def named_ports(pod: V1Pod) -> dict[str, int]:
    """The pod's named container ports (the chart names the KV-event publisher's ``kv-events``)."""
    spec = pod.spec
    found: dict[str, int] = {}
    for container in (spec.containers if spec is not None else None) or ():
        for p in container.ports or ():
            if p.name and p.container_port:
                found.setdefault(p.name, p.container_port)
    return found


class _WatchProtocolError(Exception):
    """The watch stream carried something that is not a watch event (e.g. a proxy's error page)."""


@dataclass(slots=True)
class _Attempt:
    """What one list + watch attempt achieved, kept even when it ends in an exception."""

    listed: bool = False
    events: int = 0  # watch events received, bookmarks included
    watch_started: float = 0.0


class _EndpointSet:
    """The routable pods of one run, and the last snapshot given to the sink."""

    def __init__(self, sink: SnapshotSink, port: int, roles_by_model_label: dict[str, str]) -> None:
        self._sink = sink
        self._port = port
        self._roles = roles_by_model_label
        self._endpoints: dict[str, EndpointInfo] = {}
        self._emitted: list[EndpointInfo] | None = None

    def replace(self, pods: list[V1Pod]) -> None:
        """A fresh list: whatever it does not contain is gone."""
        self._endpoints = {
            ep.name: ep for pod in pods if (ep := pod_endpoint(pod, self._port, self._roles)) is not None
        }

    def upsert(self, pod: V1Pod) -> None:
        name = pod.metadata.name if pod.metadata else None
        if not name:
            return
        endpoint = pod_endpoint(pod, self._port, self._roles)
        if endpoint is None:
            self._endpoints.pop(name, None)
        else:
            self._endpoints[name] = endpoint

    def remove(self, pod: V1Pod) -> None:
        if pod.metadata and pod.metadata.name:
            self._endpoints.pop(pod.metadata.name, None)

    async def publish(self) -> None:
        """Give the sink the full list if it changed (and always the first time)."""
        snapshot = sorted(self._endpoints.values(), key=lambda ep: ep.name)
        if snapshot == self._emitted:
            return
        previous = {ep.name for ep in self._emitted or ()}
        current = {ep.name for ep in snapshot}
        logger.info(
            "kubernetes discovery: %d endpoint(s); joined %s; left %s",
            len(snapshot),
            sorted(current - previous) or "-",
            sorted(previous - current) or "-",
        )
        await self._sink(list(snapshot))
        self._emitted = snapshot  # only once delivered: a failed sink call is retried after the re-list


class KubernetesDiscovery:
    """Reports the ready engine pods of one namespace and label selector (see the module docstring).

    ``api_client_factory`` builds the API client once per :meth:`run` (default: in-cluster service
    account, falling back to the kubeconfig); tests pass one pointed at a fake API server.
    """

    def __init__(
        self,
        namespace: str,
        label_selector: str,
        port: int,
        *,
        api_client_factory: Callable[[], Awaitable[ApiClient]] | None = None,
        backoff_initial: float = 0.5,
        backoff_max: float = 5.0,
        watch_timeout_seconds: int = 300,
        roles_by_model_label: dict[str, str] | None = None,
    ) -> None:
        if not namespace:
            raise ValueError("namespace is required")
        if not 0 < port < 65536:
            raise ValueError(f"port out of range: {port}")
        if not 0 < backoff_initial <= backoff_max:
            raise ValueError("need 0 < backoff_initial <= backoff_max")
        if watch_timeout_seconds < 1:
            raise ValueError("watch_timeout_seconds must be >= 1")
        self.namespace = namespace
        self.label_selector = label_selector
        self.port = port
        self.roles_by_model_label = roles_by_model_label or {}  # production-stack's model labels -> role
        self._api_client_factory = api_client_factory or default_api_client
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._watch_timeout_seconds = watch_timeout_seconds
        self._rng = random.Random()
        self.status = DiscoveryStatus("k8s")

    async def run(self, sink: SnapshotSink) -> None:
        """List, report, watch, and on any end of the watch start again from a list; until cancelled.

        Failures (API server unreachable, HTTP errors, 410 Gone, a dropped stream) never end the loop;
        they are logged and retried after a backoff. A failure to build the API client (no in-cluster
        service account and no kubeconfig) is a configuration error and is raised.
        """
        api_client = await self._api_client_factory()
        try:
            api = client.CoreV1Api(api_client)
            endpoints = _EndpointSet(sink, self.port, self.roles_by_model_label)
            failures = 0
            while True:
                attempt = _Attempt()
                error: Exception | None = None
                try:
                    await self._list_and_watch(api, endpoints, attempt)
                except Exception as exc:  # noqa: BLE001 - discovery must outlive any failure; re-list
                    error = exc
                progressed = self._made_progress(attempt)
                if progressed:
                    failures = 0
                    if error is None:
                        continue  # the watch ran its course: re-list at once
                failures += 1
                delay = self._backoff_delay(failures)
                reason, message = self._failure(error, attempt)
                self.status.failed(reason, message)
                self._log_failure(error, message, failures, delay)
                await asyncio.sleep(delay)
        finally:
            await api_client.close()

    async def _list_and_watch(
        self, api: client.CoreV1Api, endpoints: _EndpointSet, attempt: _Attempt
    ) -> None:
        pods = await api.list_namespaced_pod(
            self.namespace,
            label_selector=self.label_selector,
            _request_timeout=aiohttp.ClientTimeout(total=_LIST_TIMEOUT_S, sock_connect=_CONNECT_TIMEOUT_S),
        )
        attempt.listed = True
        self.status.listed()
        endpoints.replace(pods.items or [])
        await endpoints.publish()
        resource_version = pods.metadata.resource_version if pods.metadata else None

        async def open_watch(*args: object, **kwargs: object) -> object:
            """The watch request; once the API server has accepted it, discovery works."""
            response = await api.list_namespaced_pod(*args, **kwargs)  # type: ignore[arg-type]
            self.status.watching()
            return response

        attempt.watch_started = time.monotonic()
        async with watch.Watch(return_type="V1Pod") as stream:
            events = stream.stream(
                open_watch,
                self.namespace,
                label_selector=self.label_selector,
                resource_version=resource_version,
                allow_watch_bookmarks=True,
                # With timeout_seconds set, the library ends the stream instead of silently re-opening
                # it without a list; the re-list is ours to do.
                timeout_seconds=self._watch_timeout_seconds,
                _request_timeout=aiohttp.ClientTimeout(
                    total=self._watch_timeout_seconds + _WATCH_GRACE_S, sock_connect=_CONNECT_TIMEOUT_S
                ),
            )
            async for event in events:
                if not isinstance(event, dict) or "type" not in event:
                    raise _WatchProtocolError(f"not a watch event: {str(event)[:200]!r}")
                attempt.events += 1
                kind, obj = event["type"], event.get("object")
                if kind == "BOOKMARK":
                    continue
                if not isinstance(obj, V1Pod):
                    raise _WatchProtocolError(f"{kind} event without a pod")
                if kind == "DELETED":
                    endpoints.remove(obj)
                else:  # ADDED, MODIFIED
                    endpoints.upsert(obj)
                await endpoints.publish()

    def _made_progress(self, attempt: _Attempt) -> bool:
        """Did the watch work, so that the backoff starts again from ``backoff_initial``?

        It did if it delivered an event (bookmarks count), or if it stayed open for at least
        ``min(watch_timeout_seconds / 2, backoff_max)``, however it ended. A successful list alone does
        not count: a watch that fails or is closed at once (no watch permission, a proxy that cuts
        streams) would otherwise make a tight list/watch loop.
        """
        if attempt.events > 0:
            return True
        if not attempt.watch_started:
            return False
        threshold = min(self._watch_timeout_seconds / 2, self._backoff_max)
        return time.monotonic() - attempt.watch_started >= threshold

    def _backoff_delay(self, failures: int) -> float:
        """Exponential in the number of consecutive failures, capped, with "equal jitter": a uniformly
        random delay in [cap/2, cap], so replicas spread out yet never retry in a tight loop."""
        cap = min(self._backoff_max, self._backoff_initial * 2 ** min(failures - 1, 30))
        return cap / 2 + self._rng.uniform(0, cap / 2)

    def _failure(self, error: Exception | None, attempt: _Attempt) -> tuple[str, str]:
        """The failure's class (a metric label) and the one line an operator reads."""
        verb = "watch" if attempt.listed else "list"
        where = f"pods in namespace {self.namespace} (selector {self.label_selector!r})"
        if error is None:
            return "closed_early", f"the API server ended the watch of {where} early, without an event"
        if isinstance(error, ApiException):
            said = _status_message(error)
            if error.status == 403:
                return "forbidden", (
                    f"the API server refused to {verb} {where} (403 Forbidden: {said}); the router's "
                    "ServiceAccount needs list and watch on pods in its namespace (the chart's router Role "
                    "grants them)"
                )
            if error.status == 401:
                return "unauthorized", (
                    f"the API server did not accept the router's credentials to {verb} {where} "
                    f"(401 Unauthorized: {said}); check the ServiceAccount token"
                )
            if error.status == 410:
                return "gone", f"the {verb} of {where} started from an expired resourceVersion (410 Gone)"
            kind = "server_error" if error.status and error.status >= 500 else f"http_{error.status}"
            return kind, f"the {verb} of {where} failed: HTTP {error.status} {error.reason}: {said}"
        if isinstance(error, aiohttp.ClientError | TimeoutError | OSError):
            return "unreachable", (
                f"the API server could not be reached to {verb} {where}: {type(error).__name__}: "
                f"{_describe(error)}"
            )
        if isinstance(error, _WatchProtocolError):
            return "protocol", f"the watch of {where} carried something else: {_describe(error)}"
        return "unexpected", f"the {verb} of {where} failed: {type(error).__name__}: {_describe(error)}"

    def _log_failure(self, error: Exception | None, message: str, failures: int, delay: float) -> None:
        if error is None or (isinstance(error, ApiException) and error.status == 410):
            logger.info("kubernetes discovery: %s; re-listing in %.2fs", message, delay)  # routine
        else:
            expected = isinstance(
                error, ApiException | aiohttp.ClientError | TimeoutError | OSError | _WatchProtocolError
            )
            logger.warning(
                "kubernetes discovery: %s (%d in a row); the last known engines stay; retrying in %.2fs",
                message,
                failures,
                delay,
                exc_info=None if expected else error,  # an unexpected error gets its traceback
            )


def _status_message(error: ApiException) -> str:
    """The message of the API server's Status object in an error's body, else its reason."""
    try:
        body = json.loads(error.body) if error.body else None
    except (TypeError, ValueError):
        body = None
    message = body.get("message") if isinstance(body, dict) else None
    return " ".join(str(message or error.reason or "").split())[:400]


def _describe(error: Exception) -> str:
    """One line about an error (an ApiException's str() spans headers and body over many lines)."""
    if isinstance(error, ApiException):
        return f"HTTP {error.status} {error.reason}"
    return " ".join(str(error).split())[:300]
