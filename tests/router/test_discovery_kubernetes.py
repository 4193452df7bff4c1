"""Kubernetes discovery against a local fake of the Kubernetes API server (fast tier).

The same behaviour against the real API server, with the chart's Role and real engines at Pod IPs, is in
tests/cluster/test_discovery.py: Pods joining (scale-up) and leaving (scale-down under load), Ready flips,
an API server restart, a real 410 Gone, a Role without `list` or without `watch`, the kubeconfig fallback.
The fake (``tests/fakes/k8s_api.py``) stays for what a real API server cannot be made to show, or not in a
test's time:
- a Pod that stays Terminating, or Pending with an IP (kwok finishes deletions at once and starts Pods at
  once): ``test_terminating_pod_is_excluded_as_soon_as_deletion_starts``, the filter cases of
  ``test_initial_list_reports_only_ready_running_pods_of_the_namespace_and_selector``;
- a server or proxy that ends every watch at once (``test_watches_closed_at_once_do_not_make_a_tight_loop``),
  or ends it cleanly early (``test_watch_that_ends_normally_is_restarted_from_a_fresh_list``: a real server
  ends it at timeoutSeconds, 300 s);
- the retry schedule itself, every attempt timed at the server while it refuses
  (``test_retries_back_off_exponentially_up_to_the_cap``), and an outage of a chosen length
  (``test_api_server_down_for_a_while_then_back_recovers``);
- a watch gap held open while a Pod is deleted, with stub engines counting what reaches the deleted one
  (``test_pod_deleted_during_a_watch_gap_gets_no_traffic_after_the_relist``; the cluster tier shows the same
  with real engines after a scale-down);
- the rest are fast-tier duplicates of what the cluster tier shows, kept because they run in seconds.

Everything else is real: ``KubernetesDiscovery`` talks to the fake through ``kubernetes_asyncio`` over
HTTP on 127.0.0.1, with the list/watch semantics a watcher depends on (resourceVersions, replay, 410 Gone,
selector transitions, dropped connections, an unreachable server).

Every wait is on a condition with a timeout, never a fixed sleep, except where the scenario itself is
"the API server stays down for a while".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration

from tests.fakes.k8s_api import FakeKubeApi
from vllm_stack.engines.discovery.base import EndpointInfo
from vllm_stack.engines.discovery.kubernetes import KubernetesDiscovery

NS = "llm"
LABELS = {"app.kubernetes.io/name": "vllm", "vllm-stack/model": "tiny"}
SELECTOR = "app.kubernetes.io/name=vllm,vllm-stack/model=tiny"
PORT = 8000
WAIT_S = 3.0

Snapshot = list[EndpointInfo]


def names(snapshot: Snapshot) -> list[str]:
    return [ep.name for ep in snapshot]


async def eventually(predicate: Callable[[], bool], within: float = WAIT_S) -> None:
    """Wait until ``predicate()`` holds (for observations of the fake, which has no change signal)."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


class Recorder:
    """The sink: records every snapshot and lets a test await one that satisfies a condition."""

    def __init__(self) -> None:
        self.snapshots: list[Snapshot] = []
        self._changed = asyncio.Condition()
        self.task: asyncio.Task[None] | None = None

    async def __call__(self, endpoints: Snapshot) -> None:
        async with self._changed:
            self.snapshots.append(endpoints)
            self._changed.notify_all()

    @property
    def history(self) -> list[list[str]]:
        return [names(s) for s in self.snapshots]

    async def wait_for(self, predicate: Callable[[Snapshot], bool], within: float = WAIT_S) -> Snapshot:
        """The latest snapshot once it satisfies ``predicate``; fails fast if discovery itself died."""

        async def satisfied() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: bool(self.snapshots) and predicate(self.snapshots[-1]))

        waiter = asyncio.ensure_future(satisfied())
        assert self.task is not None
        done, _ = await asyncio.wait({waiter, self.task}, timeout=within, return_when=asyncio.FIRST_COMPLETED)
        if waiter not in done:
            waiter.cancel()
            if self.task in done:
                self.task.result()  # re-raises why discovery stopped
            raise AssertionError(f"no matching snapshot within {within}s; history: {self.history}")
        return self.snapshots[-1]

    async def wait_names(self, *expected: str) -> Snapshot:
        return await self.wait_for(lambda s: names(s) == sorted(expected))


Start = Callable[..., Awaitable[Recorder]]


@pytest.fixture
async def api() -> AsyncIterator[FakeKubeApi]:
    async with FakeKubeApi(namespace=NS) as fake:
        yield fake


@pytest.fixture
async def start(api: FakeKubeApi) -> AsyncIterator[Start]:
    """Start a discovery against the fake (small backoff so that reconnects take milliseconds)."""
    recorders: list[Recorder] = []

    async def api_client() -> ApiClient:
        return ApiClient(configuration=Configuration(host=api.url))

    async def _start(selector: str = SELECTOR, **options: float) -> Recorder:
        options = {"backoff_initial": 0.02, "backoff_max": 0.1, **options}
        discovery = KubernetesDiscovery(NS, selector, PORT, api_client_factory=api_client, **options)  # type: ignore[arg-type]
        recorder = Recorder()
        recorder.task = asyncio.create_task(discovery.run(recorder))
        recorders.append(recorder)
        return recorder

    yield _start
    for recorder in recorders:
        assert recorder.task is not None
        recorder.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await recorder.task


async def test_initial_list_reports_only_ready_running_pods_of_the_namespace_and_selector(
    api: FakeKubeApi, start: Start
) -> None:
    api.add_pod("ready", labels=LABELS, ip="10.1.2.3")
    api.add_pod("not-ready", labels=LABELS, ready=False)
    api.add_pod("pending", labels=LABELS, ready=False, phase="Pending", ip=None)
    api.add_pod("terminating", labels=LABELS)
    api.set_terminating("terminating")
    api.add_pod("other-model", labels={**LABELS, "vllm-stack/model": "mid"})
    api.add_pod("elsewhere", labels=LABELS, namespace="other-namespace")

    recorder = await start()

    snapshot = await recorder.wait_for(lambda s: True)
    assert snapshot == [EndpointInfo(name="ready", url="http://10.1.2.3:8000", ready=True)]
    assert len(recorder.snapshots) == 1
    assert {r.params.get("labelSelector") for r in api.requests} == {SELECTOR}  # filtered by the server


async def test_empty_initial_list_is_reported_once(api: FakeKubeApi, start: Start) -> None:
    recorder = await start()

    assert await recorder.wait_for(lambda s: True) == []
    await eventually(lambda: api.open_watches == 1)
    assert recorder.snapshots == [[]]


async def test_pod_joins_when_it_becomes_ready(api: FakeKubeApi, start: Start) -> None:
    api.add_pod("a", labels=LABELS)
    recorder = await start()
    await recorder.wait_names("a")

    api.add_pod("b", labels=LABELS, ready=False, phase="Pending", ip=None)
    api.set_running("b", "10.9.9.9")
    api.annotate("a", "note", "changes nothing for routing")
    api.set_ready("b", True)

    snapshot = await recorder.wait_names("a", "b")
    assert snapshot[1] == EndpointInfo(name="b", url="http://10.9.9.9:8000", ready=True)
    # No snapshot for the steps that changed nothing routable, and no re-list: the watch delivered it.
    assert recorder.history == [["a"], ["a", "b"]]
    assert api.list_count == 1


async def test_readiness_flip_removes_and_restores_a_pod(api: FakeKubeApi, start: Start) -> None:
    api.add_pod("a", labels=LABELS)
    api.add_pod("b", labels=LABELS)
    recorder = await start()
    await recorder.wait_names("a", "b")

    api.send_bookmarks()
    api.set_ready("b", False)
    await recorder.wait_names("a")
    api.set_ready("b", True)
    await recorder.wait_names("a", "b")

    assert recorder.history == [["a", "b"], ["a"], ["a", "b"]]
    assert api.list_count == 1


async def test_terminating_pod_is_excluded_as_soon_as_deletion_starts(api: FakeKubeApi, start: Start) -> None:
    api.add_pod("a", labels=LABELS)
    api.add_pod("b", labels=LABELS)
    recorder = await start()
    await recorder.wait_names("a", "b")

    # A MODIFIED event with deletionTimestamp set; the pod is still Running and Ready.
    api.set_terminating("b")
    await recorder.wait_names("a")

    api.delete_pod("b")  # the final DELETED changes nothing more
    api.add_pod("c", labels=LABELS)
    await recorder.wait_names("a", "c")
    assert recorder.history == [["a", "b"], ["a"], ["a", "c"]]


async def test_deleted_pod_leaves(api: FakeKubeApi, start: Start) -> None:
    api.add_pod("a", labels=LABELS)
    api.add_pod("b", labels=LABELS)
    recorder = await start()
    await recorder.wait_names("a", "b")

    api.delete_pod("a")

    await recorder.wait_names("b")
    assert api.list_count == 1


async def test_label_selector_filtering_follows_relabelled_pods(api: FakeKubeApi, start: Start) -> None:
    api.add_pod("a", labels=LABELS)
    recorder = await start()
    await recorder.wait_names("a")

    api.add_pod("stranger", labels={"app.kubernetes.io/name": "vllm"})  # lacks the model label
    api.add_pod("b", labels=LABELS, namespace="other-namespace")
    api.set_labels("stranger", LABELS)  # now it matches: the watch reports ADDED
    await recorder.wait_names("a", "stranger")
    api.set_labels("a", {"app.kubernetes.io/name": "vllm"})  # no longer matches: the watch reports DELETED
    await recorder.wait_names("stranger")

    assert recorder.history == [["a"], ["a", "stranger"], ["stranger"]]


async def test_dropped_watch_relists_and_sees_changes_made_while_disconnected(
    api: FakeKubeApi, start: Start
) -> None:
    """The production-stack bug: a pod deleted while the watch was down kept receiving traffic."""
    api.add_pod("a", labels=LABELS)
    api.add_pod("b", labels=LABELS)
    recorder = await start()
    await recorder.wait_names("a", "b")
    await eventually(lambda: api.open_watches == 1)
    seen_before = len(api.requests)

    async with api.holding_requests():  # the reconnect cannot get through until the changes are made
        await api.drop_watches()
        api.delete_pod("a")
        api.add_pod("c", labels=LABELS)
        rv_after_changes = api.resource_version
        await eventually(lambda: api.held_requests >= 1)

    await recorder.wait_names("b", "c")
    await eventually(lambda: api.open_watches == 1)
    # The reconnect was a list, and the new watch starts from that list, after the missed changes.
    reconnect = list(api.requests)[seen_before:]
    assert [r.kind for r in reconnect] == ["list", "watch"]
    assert reconnect[1].params["resourceVersion"] == str(rv_after_changes)

    api.add_pod("d", labels=LABELS)  # and the new watch carries live changes again
    await recorder.wait_names("b", "c", "d")


async def test_410_gone_relists(api: FakeKubeApi, start: Start) -> None:
    api.add_pod("a", labels=LABELS)

    def changes_the_expired_watch_never_reports() -> None:
        api.delete_pod("a")
        api.add_pod("b", labels=LABELS)

    api.expire_next_watch(before=changes_the_expired_watch_never_reports)
    recorder = await start()

    await recorder.wait_names("b")
    assert recorder.history == [["a"], ["b"]]
    assert api.gone_served == 1
    assert api.list_count == 2

    api.add_pod("c", labels=LABELS)
    await recorder.wait_names("b", "c")


async def test_api_server_down_for_a_while_then_back_recovers(api: FakeKubeApi, start: Start) -> None:
    api.add_pod("a", labels=LABELS)
    api.add_pod("b", labels=LABELS)
    recorder = await start()
    await recorder.wait_names("a", "b")

    async with api.down():  # connection refused on the same port
        api.delete_pod("a")
        api.add_pod("c", labels=LABELS)
        await asyncio.sleep(0.4)  # the outage itself: several reconnect attempts (backoff <= 0.1 s)
        # While the API server is unreachable the last known endpoints stay: no engine is dropped
        # because the control plane is away.
        assert recorder.history == [["a", "b"]]
        assert not recorder.task.done()  # type: ignore[union-attr]

    await recorder.wait_names("b", "c")
    api.add_pod("d", labels=LABELS)
    await recorder.wait_names("b", "c", "d")


async def test_retries_back_off_exponentially_up_to_the_cap(api: FakeKubeApi, start: Start) -> None:
    api.add_pod("a", labels=LABELS)
    api.fail_requests(503)
    recorder = await start(backoff_initial=0.02, backoff_max=0.16)

    await eventually(lambda: api.list_count >= 9)
    times = [r.at for r in api.requests if r.kind == "list"][:9]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    # Delays are drawn from [cap/2, cap], cap = min(0.16, 0.02 * 2**(n-1)): never a tight loop, the
    # later ones at least half the cap (so the delay did grow), and bounded by the cap (plus slack for
    # a loaded machine; without the cap the 8th delay alone would be 2.56 s).
    assert min(gaps) >= 0.01 * 0.95, gaps
    assert min(gaps[4:]) >= 0.08 * 0.95, gaps
    assert max(gaps) <= 0.16 + 0.5, gaps
    assert recorder.snapshots == []

    api.fail_requests(None)
    await recorder.wait_names("a")


async def test_watches_closed_at_once_do_not_make_a_tight_loop(api: FakeKubeApi, start: Start) -> None:
    api.add_pod("a", labels=LABELS)
    api.cut_watches_after(0)  # every watch ends cleanly, with no event, as soon as it opens
    recorder = await start(backoff_initial=0.02, backoff_max=0.16)
    await recorder.wait_names("a")

    await eventually(lambda: api.list_count >= 7)
    times = [r.at for r in api.requests if r.kind == "list"][:7]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert min(gaps[4:]) >= 0.08 * 0.95, gaps  # backed off like failures, not re-listed at once
    assert recorder.history == [["a"]]


async def test_watch_that_ends_normally_is_restarted_from_a_fresh_list(
    api: FakeKubeApi, start: Start
) -> None:
    api.add_pod("a", labels=LABELS)
    recorder = await start(watch_timeout_seconds=1)
    await recorder.wait_names("a")

    await eventually(lambda: api.list_count >= 2)  # the server ended the watch after 1 s
    watches = [r for r in api.requests if r.kind == "watch"]
    assert {w.params["timeoutSeconds"] for w in watches} == {"1"}
    assert {w.params["allowWatchBookmarks"].lower() for w in watches} == {"true"}
    api.add_pod("b", labels=LABELS)
    await recorder.wait_names("a", "b")
    assert recorder.history == [["a"], ["a", "b"]]  # the re-list alone emits nothing


async def test_default_client_falls_back_to_kubeconfig(
    api: FakeKubeApi, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside a cluster (no service account), the client comes from $KUBECONFIG."""
    api.add_pod("a", labels=LABELS, ip="10.3.3.3")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                "users": [{"name": "tester", "user": {"token": "not-checked"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "tester"}}],
                "current-context": "fake",
            }
        )
    )
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    recorder = Recorder()
    discovery = KubernetesDiscovery(NS, SELECTOR, PORT, backoff_initial=0.02, backoff_max=0.1)
    recorder.task = asyncio.create_task(discovery.run(recorder))
    try:
        assert await recorder.wait_names("a") == [EndpointInfo("a", "http://10.3.3.3:8000")]
    finally:
        recorder.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await recorder.task


async def test_cancel_stops_discovery_and_closes_the_watch(api: FakeKubeApi, start: Start) -> None:
    recorder = await start()
    await recorder.wait_for(lambda s: True)
    await eventually(lambda: api.open_watches == 1)

    assert recorder.task is not None
    recorder.task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await recorder.task
    assert recorder.task.cancelled()
    await eventually(lambda: api.open_watches == 0)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        KubernetesDiscovery(NS, SELECTOR, 0)
    with pytest.raises(ValueError):
        KubernetesDiscovery(NS, SELECTOR, PORT, backoff_initial=5, backoff_max=1)
    with pytest.raises(ValueError):
        KubernetesDiscovery("", SELECTOR, PORT)


async def test_pod_deleted_during_a_watch_gap_gets_no_traffic_after_the_relist(api: FakeKubeApi) -> None:
    """End to end through the router: a pod deleted while the watch was down (its process still
    serving, as a terminating pod's may) gets no request within 5 s of the re-list. The pods' stub
    engines listen on 127.0.0.2 and 127.0.0.3 at one port, as pods share a container port."""
    from tests.fakes.stub_engine import StubEngine, serve
    from tests.router.helpers import FAST, http, serving, wait_for
    from vllm_stack.app import build_router

    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    a, b = StubEngine("a", ["tiny"]), StubEngine("b", ["tiny"])

    async def api_client() -> ApiClient:
        return ApiClient(configuration=Configuration(host=api.url))

    discovery = KubernetesDiscovery(
        NS, SELECTOR, port, api_client_factory=api_client, backoff_initial=0.02, backoff_max=0.1
    )  # type: ignore[arg-type]
    cli = {**FAST, "routing_logic": "roundrobin", "service_discovery": "k8s", "k8s_namespace": NS}
    router = build_router(cli, discovery=discovery, environ={})
    api.add_pod("a", labels=LABELS, ip="127.0.0.2")
    api.add_pod("b", labels=LABELS, ip="127.0.0.3")
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    async with (
        serve(a, host="127.0.0.2", port=port),
        serve(b, host="127.0.0.3", port=port),
        serving(router) as url,
    ):
        await wait_for(lambda: router.registry.healthy_count == 2, what="both pods routable")
        async with http(url) as h:
            for _ in range(4):
                assert (await h.post("/v1/completions", json=body)).status_code == 200
            assert a.completed > 0 and b.completed > 0
            await eventually(lambda: api.open_watches == 1)
            async with api.holding_requests():
                await api.drop_watches()
                api.delete_pod("a")
                await eventually(lambda: api.held_requests >= 1)
            relisted = time.monotonic()
            await wait_for(lambda: router.registry.get("a") is None, 5, "pod a gone after the re-list")
            assert time.monotonic() - relisted <= 5
            served_by_a = a.completed
            codes = [(await h.post("/v1/completions", json=body)).status_code for _ in range(20)]
    assert codes == [200] * 20
    assert a.completed == served_by_a, "the deleted pod still got traffic"


async def test_a_pods_kv_event_ports_are_reported(api: FakeKubeApi, start: Start) -> None:
    """The chart names the engine container's KV-event publisher and replay ports; the router
    subscribes to them (vllm_stack.scheduling.index.feed) without asking the engine."""
    api.add_pod("a", labels=LABELS, ip="10.1.2.3")

    def ports(pod: dict) -> None:
        pod["spec"]["containers"][0]["ports"] = [
            {"name": "http", "containerPort": PORT},
            {"name": "kv-events", "containerPort": 5557},
            {"name": "kv-replay", "containerPort": 5558},
        ]

    api.update_pod("a", ports)
    recorder = await start()
    (endpoint,) = await recorder.wait_for(lambda s: bool(s))
    assert (endpoint.kv_events, endpoint.kv_replay) == ("tcp://10.1.2.3:5557", "tcp://10.1.2.3:5558")


async def test_a_refused_watch_is_reported_until_the_verb_is_back(api: FakeKubeApi, start: Start) -> None:
    """A Role without `watch` lets every list through: the endpoints are right once, then silently stale.
    The status says so (unhealthy, reason forbidden, the verb named) while the last known endpoints stay,
    and turns healthy again with the next accepted watch. (The same on the real API server, with the
    chart's Role: tests/cluster/test_discovery.py.)"""
    api.add_pod("a", labels=LABELS, ip="10.0.0.1")
    api.fail_requests(403, watches_only=True)

    async def api_client() -> ApiClient:
        return ApiClient(configuration=Configuration(host=api.url))

    discovery = KubernetesDiscovery(NS, SELECTOR, PORT, api_client_factory=api_client,
                                    backoff_initial=0.02, backoff_max=0.1)  # fmt: skip
    recorder = Recorder()
    recorder.task = asyncio.create_task(discovery.run(recorder))
    try:
        await recorder.wait_names("a")
        status = discovery.status
        await eventually(lambda: status.failures_total.get("forbidden", 0) >= 2)
        assert not status.healthy and status.reason == "forbidden"
        assert status.error is not None and "refused to watch pods in namespace llm" in status.error
        assert "list and watch" in status.error
        assert status.last_synced is not None  # the lists went through
        assert recorder.history[-1] == ["a"]  # the last known endpoints stay

        api.fail_requests(None)
        await eventually(lambda: status.healthy)
        assert status.error is None and status.consecutive_failures == 0
        api.add_pod("b", labels=LABELS, ip="10.0.0.2")
        await recorder.wait_names("a", "b")
    finally:
        recorder.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await recorder.task


async def test_the_router_shows_discovery_failures_in_engines_and_metrics(api: FakeKubeApi) -> None:
    """What an operator sees of a refused list: `discovery` in GET /engines, and the two metrics."""
    from tests.router.helpers import FAST, http, serving
    from vllm_stack.app import build_router

    async def api_client() -> ApiClient:
        return ApiClient(configuration=Configuration(host=api.url))

    api.fail_requests(403)
    discovery = KubernetesDiscovery(NS, SELECTOR, PORT, api_client_factory=api_client,
                                    backoff_initial=0.02, backoff_max=0.1)  # fmt: skip
    cli = {**FAST, "service_discovery": "k8s", "k8s_namespace": NS}
    router = build_router(cli, discovery=discovery, environ={})
    async with serving(router) as url, http(url) as h:
        await eventually(lambda: discovery.status.consecutive_failures >= 1)
        shown = (await h.get("/engines")).json()["discovery"]
        assert shown["source"] == "k8s" and shown["healthy"] is False and shown["reason"] == "forbidden"
        assert "refused to list pods" in shown["error"]
        metrics = (await h.get("/metrics")).text
        assert 'vllm_stack_router_discovery_healthy{source="k8s"} 0.0' in metrics
        assert 'vllm_stack_router_discovery_failures_total{reason="forbidden",source="k8s"}' in metrics

        api.fail_requests(None)
        await eventually(lambda: discovery.status.healthy)
        assert (await h.get("/engines")).json()["discovery"]["healthy"] is True
        assert 'vllm_stack_router_discovery_healthy{source="k8s"} 1.0' in (await h.get("/metrics")).text
