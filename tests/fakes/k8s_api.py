"""A small local fake of the Kubernetes API server's pod list/watch endpoint.

No Kubernetes API server can run on the test machines, so the router's Kubernetes discovery is tested
against this fake instead. It serves ``GET /api/v1/namespaces/{ns}/pods`` with the query parameters the
real server honours for list and watch (``labelSelector``, ``watch``, ``resourceVersion``,
``timeoutSeconds``, ``allowWatchBookmarks``) and keeps the semantics that matter to a watcher:

- every change bumps one global resourceVersion; a list returns the collection's resourceVersion;
- a watch from resourceVersion N replays the retained changes after N, then streams live ones; a watch
  from a version older than the retained history gets an ``ERROR`` event with a 410 ``Expired`` Status,
  exactly like a real server after etcd compaction; a watch without a version (or ``"0"``) starts with
  synthetic ``ADDED`` events for the current objects and never reports objects deleted before it;
- a label-selector watch sees ``DELETED`` when an object stops matching and ``ADDED`` when it starts.

Test controls: add/update/delete pods, set ready / running / terminating, send bookmarks, drop every
watch connection, make the next watch fail with 410 Gone, cut watches short, answer every request with
an error status, hold requests (a slow network), and take the whole server down and bring it back on
the same port.
State lives in the :class:`FakeKubeApi` instance, so two fakes can run in one process.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

Pod = dict[str, Any]
LabelRequirement = Callable[[dict[str, str]], bool]

_DROP = object()  # queue sentinel: abort this watch connection


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request the fake received: what it asked for, and when (``time.monotonic()``)."""

    kind: str  # "list" or "watch"
    namespace: str
    params: dict[str, str]
    at: float


@dataclass(frozen=True, slots=True)
class _Change:
    """One change to one pod, at one resourceVersion (``obj`` is the pod after it; ``prev`` before)."""

    rv: int
    kind: str  # ADDED, MODIFIED, DELETED
    prev: Pod | None
    obj: Pod


@dataclass(slots=True, eq=False)  # identity-hashed: kept in a set
class _Watcher:
    namespace: str
    selector: list[LabelRequirement]
    bookmarks: bool
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    closed: asyncio.Event = field(default_factory=asyncio.Event)


class SelectorError(ValueError):
    """An unparseable label selector (answered with 400 like the real server)."""


def parse_label_selector(text: str) -> list[LabelRequirement]:
    """Parse a Kubernetes label selector: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``,
    ``k notin (a,b)``, comma-separated (commas inside parentheses belong to the set)."""
    requirements: list[LabelRequirement] = []
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    for raw in parts:
        part = raw.strip()
        if not part:
            continue
        if m := re.fullmatch(r"([\w./-]+)\s+(in|notin)\s*\(([^)]*)\)", part):
            values = frozenset(v.strip() for v in m.group(3).split(",") if v.strip())
            requirements.append(_in_set(m.group(1), values, negate=m.group(2) == "notin"))
        elif m := re.fullmatch(r"([\w./-]+)\s*!=\s*([\w.-]*)", part):
            requirements.append(_in_set(m.group(1), frozenset({m.group(2)}), negate=True))
        elif m := re.fullmatch(r"([\w./-]+)\s*==?\s*([\w.-]*)", part):
            requirements.append(_in_set(m.group(1), frozenset({m.group(2)}), negate=False))
        elif m := re.fullmatch(r"!\s*([\w./-]+)", part):
            requirements.append(_exists(m.group(1), negate=True))
        elif re.fullmatch(r"[\w./-]+", part):
            requirements.append(_exists(part, negate=False))
        else:
            raise SelectorError(f"unable to parse requirement: {part!r}")
    return requirements


def _in_set(key: str, values: frozenset[str], *, negate: bool) -> LabelRequirement:
    """``key in (values)``; negated, ``notin`` / ``!=``, which a pod without the label also satisfies."""
    return lambda labels: (labels.get(key) in values) != negate


def _exists(key: str, *, negate: bool) -> LabelRequirement:
    return lambda labels: (key in labels) != negate


def _matches(pod: Pod, namespace: str, selector: list[LabelRequirement]) -> bool:
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    return meta["namespace"] == namespace and all(req(labels) for req in selector)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeKubeApi:
    """The fake API server. Use as ``async with FakeKubeApi() as api:``; point a client at ``api.url``."""

    def __init__(self, *, namespace: str = "default", history_limit: int = 1000) -> None:
        self.namespace = namespace  # default namespace for the pod controls
        self.requests: deque[RecordedRequest] = deque(maxlen=10_000)
        self.held_requests = 0
        self.gone_served = 0
        self._pods: dict[tuple[str, str], Pod] = {}
        self._rv = 1
        self._history: deque[_Change] = deque(maxlen=history_limit)
        self._compacted_rv = 0  # changes at or below this version are no longer retained
        self._watchers: set[_Watcher] = set()
        self._next_ip = 1
        self._expire_next: list[Callable[[], None] | None] = []
        self._fail_status: int | None = None
        self._fail_watches_only = False
        self._cut_watches_after: float | None = None
        self._gate: asyncio.Event | None = None
        self._runner: web.AppRunner | None = None
        self._port = 0

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> FakeKubeApi:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Listen on 127.0.0.1 (a random port the first time, the same port after a restart)."""
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{namespace}/pods", self._handle_pods)
        # handler_cancellation: a watch handler ends when its client disconnects, as on a real server.
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self._port, reuse_address=True)
        await site.start()
        self._port = runner.addresses[0][1]
        self._runner = runner

    async def stop(self) -> None:
        """Stop listening and close every connection (clients then get connection refused)."""
        if self._gate is not None:
            self._gate.set()
        await self.drop_watches()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    @asynccontextmanager
    async def down(self) -> AsyncIterator[None]:
        """The API server is unreachable inside the block, and back on the same port after it."""
        await self.stop()
        try:
            yield
        finally:
            await self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    # ------------------------------------------------------------------ observations
    @property
    def list_count(self) -> int:
        return sum(1 for r in self.requests if r.kind == "list")

    @property
    def watch_count(self) -> int:
        return sum(1 for r in self.requests if r.kind == "watch")

    @property
    def open_watches(self) -> int:
        return len(self._watchers)

    @property
    def resource_version(self) -> int:
        return self._rv

    # ------------------------------------------------------------------ pod controls
    def add_pod(
        self,
        name: str,
        *,
        labels: dict[str, str] | None = None,
        ready: bool = True,
        phase: str = "Running",
        ip: str | None = "auto",
        namespace: str | None = None,
    ) -> None:
        """Create a pod. ``ip="auto"`` assigns a fresh 10.0.x.y address; ``None`` leaves it unset."""
        ns = namespace or self.namespace
        if (ns, name) in self._pods:
            raise ValueError(f"pod {ns}/{name} exists")
        if ip == "auto":
            ip = f"10.0.{self._next_ip // 250}.{self._next_ip % 250 + 1}"
            self._next_ip += 1
        pod: Pod = {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {
                "name": name,
                "namespace": ns,
                "uid": str(uuid.uuid4()),
                "labels": dict(labels or {}),
                "creationTimestamp": _now_rfc3339(),
            },
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            "status": {"phase": phase},
        }
        if ip:
            pod["status"]["podIP"] = ip
        _set_ready_condition(pod, ready)
        self._commit("ADDED", None, pod)

    def update_pod(self, name: str, mutate: Callable[[Pod], None], *, namespace: str | None = None) -> None:
        """Apply ``mutate`` to a copy of the pod and publish it as a MODIFIED change."""
        prev = self._pods[(namespace or self.namespace, name)]
        pod = copy.deepcopy(prev)
        mutate(pod)
        self._commit("MODIFIED", prev, pod)

    def set_ready(self, name: str, ready: bool, *, namespace: str | None = None) -> None:
        self.update_pod(name, lambda pod: _set_ready_condition(pod, ready), namespace=namespace)

    def set_running(self, name: str, ip: str, *, namespace: str | None = None) -> None:
        """Pending -> Running with a pod IP (not yet Ready: that is a separate condition)."""

        def mutate(pod: Pod) -> None:
            pod["status"]["phase"] = "Running"
            pod["status"]["podIP"] = ip

        self.update_pod(name, mutate, namespace=namespace)

    def set_labels(self, name: str, labels: dict[str, str], *, namespace: str | None = None) -> None:
        self.update_pod(
            name, lambda pod: pod["metadata"].__setitem__("labels", dict(labels)), namespace=namespace
        )

    def annotate(self, name: str, key: str, value: str, *, namespace: str | None = None) -> None:
        """A change that does not affect routing (a watcher gets MODIFIED all the same)."""
        self.update_pod(
            name,
            lambda pod: pod["metadata"].setdefault("annotations", {}).__setitem__(key, value),
            namespace=namespace,
        )

    def set_terminating(self, name: str, *, namespace: str | None = None) -> None:
        """Graceful deletion started: deletionTimestamp set; the pod is still Running and Ready for now."""

        def mutate(pod: Pod) -> None:
            pod["metadata"]["deletionTimestamp"] = _now_rfc3339()
            pod["metadata"]["deletionGracePeriodSeconds"] = 30

        self.update_pod(name, mutate, namespace=namespace)

    def delete_pod(self, name: str, *, namespace: str | None = None) -> None:
        prev = self._pods[(namespace or self.namespace, name)]
        self._commit("DELETED", prev, copy.deepcopy(prev))

    # ------------------------------------------------------------------ watch and failure controls
    def send_bookmarks(self) -> None:
        """Send a BOOKMARK event (current resourceVersion) to every watch that allowed bookmarks."""
        event = {
            "type": "BOOKMARK",
            "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": str(self._rv)}},
        }
        for watcher in self._watchers:
            if watcher.bookmarks:
                watcher.queue.put_nowait(event)

    async def drop_watches(self) -> None:
        """Abort every open watch connection mid-stream (a network drop, not a clean end of stream)."""
        watchers = list(self._watchers)
        for watcher in watchers:
            watcher.queue.put_nowait(_DROP)
        if watchers:
            await asyncio.wait_for(asyncio.gather(*(w.closed.wait() for w in watchers)), 2.0)

    def expire_next_watch(self, before: Callable[[], None] | None = None) -> None:
        """Answer the next watch request with an ERROR event carrying 410 Gone (Expired), as a real
        server does when the requested resourceVersion was compacted away. ``before`` runs just before
        the error is sent, so a test can change pods that the failed watch will never report."""
        self._expire_next.append(before)

    def compact(self) -> None:
        """Forget the change history: a watch from any older resourceVersion now gets 410 Gone."""
        self._history.clear()
        self._compacted_rv = self._rv

    def cut_watches_after(self, seconds: float | None) -> None:
        """End every new watch cleanly after ``seconds`` whatever its timeoutSeconds (a proxy that cuts
        long streams; 0 closes them at once), or honour timeoutSeconds again (None)."""
        self._cut_watches_after = seconds

    def fail_requests(self, status: int | None, *, watches_only: bool = False) -> None:
        """Answer every request (or only watches: a Role without `watch`) with this HTTP status (a
        Status body), or serve normally again (None)."""
        self._fail_status = status
        self._fail_watches_only = watches_only

    @asynccontextmanager
    async def holding_requests(self) -> AsyncIterator[None]:
        """Requests that arrive inside the block wait, unanswered, until the block ends."""
        gate = asyncio.Event()
        self._gate = gate
        try:
            yield
        finally:
            self._gate = None
            gate.set()

    # ------------------------------------------------------------------ internals
    def _commit(self, kind: str, prev: Pod | None, pod: Pod) -> None:
        self._rv += 1
        pod["metadata"]["resourceVersion"] = str(self._rv)
        key = (pod["metadata"]["namespace"], pod["metadata"]["name"])
        if kind == "DELETED":
            del self._pods[key]
        else:
            self._pods[key] = pod
        if len(self._history) == self._history.maxlen:
            self._compacted_rv = self._history[0].rv
        change = _Change(self._rv, kind, prev, pod)
        self._history.append(change)
        for watcher in self._watchers:
            event = _event_for(change, watcher)
            if event is not None:
                watcher.queue.put_nowait(event)

    def _record(self, request: web.Request, kind: str) -> None:
        self.requests.append(
            RecordedRequest(kind, request.match_info["namespace"], dict(request.query), time.monotonic())
        )

    async def _handle_pods(self, request: web.Request) -> web.StreamResponse:
        is_watch = request.query.get("watch", "").lower() in ("true", "1")
        self._record(request, "watch" if is_watch else "list")
        if self._gate is not None:
            self.held_requests += 1
            await self._gate.wait()
        if self._fail_status is not None and (is_watch or not self._fail_watches_only):
            return web.json_response(
                _status(self._fail_status, "ServiceUnavailable", "injected failure"), status=self._fail_status
            )
        namespace = request.match_info["namespace"]
        try:
            selector = parse_label_selector(request.query.get("labelSelector", ""))
        except SelectorError as exc:
            return web.json_response(_status(400, "BadRequest", str(exc)), status=400)
        if is_watch:
            return await self._watch(request, namespace, selector)
        items = [
            copy.deepcopy(p) for key, p in sorted(self._pods.items()) if _matches(p, namespace, selector)
        ]
        return web.json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self._rv)},
                "items": items,
            }
        )

    async def _watch(
        self, request: web.Request, namespace: str, selector: list[LabelRequirement]
    ) -> web.StreamResponse:
        query = request.query
        timeout = float(query.get("timeoutSeconds", "1800"))
        if self._cut_watches_after is not None:
            timeout = min(timeout, self._cut_watches_after)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        async def send(event: dict[str, Any]) -> None:
            await response.write(json.dumps(event).encode() + b"\n")

        # Everything from here to the registration of the watcher is synchronous, so no change can
        # slip between the replayed history and the live queue.
        if self._expire_next:
            before = self._expire_next.pop(0)
            if before is not None:
                before()
            self.gone_served += 1
            await send({"type": "ERROR", "object": _status(410, "Expired", "too old resource version")})
            await response.write_eof()
            return response
        rv_param = query.get("resourceVersion", "")
        watcher = _Watcher(namespace, selector, query.get("allowWatchBookmarks", "").lower() in ("true", "1"))
        if rv_param in ("", "0"):
            initial = [
                {"type": "ADDED", "object": copy.deepcopy(p)}
                for _, p in sorted(self._pods.items())
                if _matches(p, namespace, selector)
            ]
        else:
            since = int(rv_param)
            if since < self._compacted_rv:
                self.gone_served += 1
                await send(
                    {"type": "ERROR", "object": _status(410, "Expired", f"too old resource version: {since}")}
                )
                await response.write_eof()
                return response
            initial = [e for c in self._history if c.rv > since and (e := _event_for(c, watcher)) is not None]
        for event in initial:
            watcher.queue.put_nowait(event)
        self._watchers.add(watcher)
        deadline = asyncio.get_running_loop().time() + timeout
        try:
            while True:
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                try:
                    item = await asyncio.wait_for(watcher.queue.get(), remaining)
                except TimeoutError:
                    break
                if item is _DROP:
                    if request.transport is not None:
                        request.transport.abort()
                    return response
                await send(item)
            await response.write_eof()  # the server-side timeout: a clean end of stream
        except ConnectionError:
            pass  # the client went away
        finally:
            self._watchers.discard(watcher)
            watcher.closed.set()
        return response


def _set_ready_condition(pod: Pod, ready: bool) -> None:
    conditions = [c for c in pod["status"].get("conditions", []) if c["type"] != "Ready"]
    conditions.append({"type": "Ready", "status": "True" if ready else "False"})
    pod["status"]["conditions"] = conditions


def _event_for(change: _Change, watcher: _Watcher) -> dict[str, Any] | None:
    """What a watcher with this namespace and selector sees of a change (None: nothing)."""
    now = _matches(change.obj, watcher.namespace, watcher.selector)
    if change.kind == "DELETED":
        kind = "DELETED" if now else None
    else:
        before = change.prev is not None and _matches(change.prev, watcher.namespace, watcher.selector)
        kind = {(True, True): "MODIFIED", (False, True): "ADDED", (True, False): "DELETED"}.get((before, now))
    return None if kind is None else {"type": kind, "object": copy.deepcopy(change.obj)}
