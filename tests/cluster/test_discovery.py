"""The router discovers real engine Pods through a real API server, as the chart's own ServiceAccount.

One release of the chart (two engine Pods of one model, the router with Kubernetes discovery) on a control
plane of its own (its API server is restarted here, which the other cluster tests must not see). For each
Pod the chart creates, kwok reports it Running at a loopback IP, and the test bed starts what its container
would run there (vllm_stack_dev.cluster.pod_processes): a real vLLM engine at the engine Pod's IP and port,
and the router at the router Pod's, with the chart's rendered arguments and a token of the chart's
ServiceAccount from the TokenRequest API (never the admin's). No Service, ClusterIP or endpoint is used:
the router finds Pods by its label selector, as it does in a cluster.

What is shown, each against the real API server:
- discovery works with exactly the chart's Role (list and watch on pods);
- with either verb taken away, discovery fails, and says so in its log, in `GET /engines` and in a metric,
  and follows again within 10 s of the Role being restored;
- the engine set follows a Pod's Ready condition within 2 s (both ways), a scale-up (a new Pod, its engine
  started, requests served by it) and a scale-down under load, after which no request reaches the removed
  Pod's engine later than 2 s after its deletion (it keeps running, as a terminating container serves on);
- a restarted API server (every watch cut) is followed again;
- a watch from a compacted resourceVersion gets the API server's 410 Gone, and the re-list catches up.

All the router's API traffic passes through a pass-through proxy (vllm_stack_dev.cluster.api_proxy: it
drops the router's connections when the API server goes away, as they would drop without it); only the 410
test makes it do more, holding one watch request while etcd is compacted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_stack_dev.cluster.api_proxy import ApiProxy, compact_etcd
from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.pod_processes import PodProcesses
from vllm_stack_dev.cluster.releases import Helm, place, pod_ready, wait_workloads_ready
from vllm_stack_dev.waiting import wait_http_ok

from tests.cluster.serving import Load, arrivals, requests_in, wait_for
from tests.cluster.test_install import RELEASE
from tests.conftest import CHAT_MODEL, READY_TIMEOUT
from tests.helm.chart import CHART

pytestmark = pytest.mark.cluster

NAMESPACE = "discovery"
ENGINES = f"{RELEASE}-tiny-deployment-vllm"  # the engine Deployment's name for model `tiny`
ROLE = f"{RELEASE}-reader"
SERVICE_ACCOUNT = f"{RELEASE}-router-service-account"
FOLLOW_S = 2.0  # the bound on following a Pod's Ready condition
RECOVER_S = 10.0  # ... and on recovering once the Role is restored
VALUES = {
    "servingEngineSpec": {
        "modelSpec": [{"name": "tiny", "modelURL": CHAT_MODEL, "replicaCount": 2}],
    },
    "routerSpec": {"routingLogic": "roundrobin", "healthCheckInterval": 1},
}


class Stack:
    """The release as a client and an operator see it: the router's URL, its view, the engines."""

    def __init__(
        self, cluster: Cluster, pods: PodProcesses, router_url: str, router_log: Path, proxy: ApiProxy
    ) -> None:
        self.cluster = cluster
        self.pods = pods
        self.proxy = proxy
        self.url = router_url
        self.router_log = router_log
        self.client = httpx.Client(base_url=router_url, timeout=60)

    def view(self) -> dict[str, Any]:
        self.pods.check()  # a Pod's process that failed to start fails the test now, not at a timeout
        return self.client.get("/engines", timeout=5).json()

    def discovered(self) -> set[str]:
        return {e["name"] for e in self.view()["engines"]}

    def routable(self) -> set[str]:
        return {e["name"] for e in self.view()["engines"] if e["healthy"] and CHAT_MODEL in e["models"]}

    def metric(self, line_start: str) -> str | None:
        for line in self.client.get("/metrics", timeout=5).text.splitlines():
            if line.startswith(line_start):
                return line
        return None

    def chat(self, text: str = "hello") -> httpx.Response:
        """A chat completion through the router."""
        body = {"model": CHAT_MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        return self.client.post("/v1/chat/completions", json=body)

    def pod_ready(self, name: str) -> bool:
        """Whether the API server has the engine Pod Running and Ready, with an IP."""
        return any(
            p["metadata"]["name"] == name and pod_ready(p) and bool(p["status"].get("podIP"))
            for p in self.engine_pods()
        )

    def engine_pods(self) -> list[dict]:
        return [
            p for p in self.pods.pods()
            if p["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "serving-engine"
        ]  # fmt: skip


@pytest.fixture(scope="module")
def stack(
    scaling_cluster: Cluster,
    tiny_model_dir: Path,
    engine_logs_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    cluster = scaling_cluster
    work = tmp_path_factory.mktemp("discovery")
    values = work / "values.yaml"
    values.write_text(json.dumps(VALUES))
    helm = Helm(cluster, 4)
    documents = helm.template(RELEASE, CHART, NAMESPACE, values)
    with place(cluster, documents, NAMESPACE):
        helm.install(RELEASE, CHART, NAMESPACE, values)
        wait_workloads_ready(cluster, NAMESPACE)
    proxy = ApiProxy(cluster, work)  # passes everything through; the 410 test holds one watch there
    try:
        token = cluster.service_account_token(NAMESPACE, SERVICE_ACCOUNT)
        kubeconfig = proxy.kubeconfig(token, NAMESPACE, work / "router.kubeconfig")
        pods = PodProcesses(
            cluster, NAMESPACE, documents, model_dir=tiny_model_dir, workdir=work / "pods",
            log_dir=engine_logs_dir, router_env={"KUBECONFIG": str(kubeconfig)}, keep_deleted=True,
        )  # fmt: skip
        with pods, pods.follow():
            wait_for(lambda: pods.check() or pods.routers, 30, "the router Pod's process started")
            (router,) = pods.routers.values()
            wait_http_ok(f"{router.url}/health", 60, router.process)
            stack = Stack(cluster, pods, router.url, router.log, proxy)
            try:
                wait_for(lambda: stack.routable() == set(pods.live_engines()) and len(pods.live_engines()) == 2,
                         READY_TIMEOUT, "both engine Pods routable through the router")  # fmt: skip
                yield stack
            finally:
                stack.client.close()
    finally:
        proxy.close()


def test_the_router_finds_the_engine_pods_with_exactly_the_charts_role(stack: Stack) -> None:
    role = stack.cluster.get("role", ROLE, "-n", NAMESPACE)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    assert stack.discovered() == {p["metadata"]["name"] for p in stack.engine_pods()}
    for pod in stack.engine_pods():  # each engine stands at its Pod's own IP
        (engine,) = [e for e in stack.view()["engines"] if e["name"] == pod["metadata"]["name"]]
        assert engine["url"] == f"http://{pod['status']['podIP']}:8000"
    answers = [stack.chat(f"question {i}") for i in range(6)]
    assert [a.status_code for a in answers] == [200] * 6, answers[-1].text
    assert all(a.json()["choices"][0]["message"]["content"] is not None for a in answers)
    served = {
        name: e.metric_value("vllm:request_success_total") for name, e in stack.pods.live_engines().items()
    }
    assert all(count > 0 for count in served.values()), f"round robin reached only some engines: {served}"
    assert stack.view()["discovery"]["healthy"] is True
    assert stack.metric('vllm_stack_router_discovery_healthy{source="k8s"}').endswith(" 1.0")


def _set_verbs(cluster: Cluster, verbs: list[str]) -> None:
    patch = [{"op": "replace", "path": "/rules/0/verbs", "value": verbs}]
    cluster.kubectl("patch", "role", ROLE, "-n", NAMESPACE, "--type=json", "-p", json.dumps(patch))


@pytest.mark.parametrize("verb", ["watch", "list"])
def test_a_role_without_a_verb_fails_visibly_and_recovers_once_restored(stack: Stack, verb: str) -> None:
    """The Role loses one verb; the router meets it at its next list and watch, here forced by restarting
    the API server (which ends every watch). Discovery then fails, with the verb named in the log, in
    `GET /engines` and in the metric, while the last known engines keep serving; restored, it follows
    again within 10 s."""
    _set_verbs(stack.cluster, [v for v in ("list", "watch") if v != verb])
    try:
        stack.cluster.restart_api_server()
        failing = wait_for(
            lambda: (d := stack.view()["discovery"])["reason"] == "forbidden" and d, 30,
            f"the router reports discovery forbidden without {verb}",
        )  # fmt: skip
        assert failing["healthy"] is False
        assert f"refused to {verb} pods in namespace {NAMESPACE}" in failing["error"]
        assert f'cannot {verb} resource "pods"' in failing["error"]  # the API server's own words
        assert stack.metric('vllm_stack_router_discovery_healthy{source="k8s"}').endswith(" 0.0")
        assert stack.metric('vllm_stack_router_discovery_failures_total{reason="forbidden",source="k8s"}')
        assert f"refused to {verb} pods" in stack.router_log.read_text()
        assert stack.chat().status_code == 200  # the last known engines still serve
    finally:
        _set_verbs(stack.cluster, ["list", "watch"])
    restored = time.monotonic()
    wait_for(lambda: stack.view()["discovery"]["healthy"], RECOVER_S, "discovery healthy after the restore")
    assert time.monotonic() - restored <= RECOVER_S
    assert stack.metric('vllm_stack_router_discovery_healthy{source="k8s"}').endswith(" 1.0")


def _patch_ready(cluster: Cluster, pod: str, ready: bool) -> None:
    condition = {"type": "Ready", "status": "True" if ready else "False"}
    cluster.kubectl("patch", "pod", pod, "-n", NAMESPACE, "--subresource=status", "--type=strategic",
                    "-p", json.dumps({"status": {"conditions": [condition]}}))  # fmt: skip


def assert_ready_condition_followed(stack: Stack) -> None:
    """A Pod turned unready leaves the router's engine set within 2 s, and rejoins within 2 s of turning
    ready again (the patch returns once the API server has stored it: the clock starts no later)."""
    pod = sorted(stack.discovered())[0]
    for ready in (False, True):
        _patch_ready(stack.cluster, pod, ready)
        changed = time.monotonic()
        wait_for(
            lambda r=ready: (pod in stack.discovered()) == r, FOLLOW_S, f"{pod} followed to ready={ready}"
        )
        assert time.monotonic() - changed <= FOLLOW_S


def test_the_engine_set_follows_a_pods_ready_condition_within_2_s(stack: Stack) -> None:
    assert_ready_condition_followed(stack)


def test_a_watch_from_a_compacted_revision_is_410_gone_and_the_relist_catches_up(stack: Stack) -> None:
    """The router's watch is cut; its re-list passes, its next watch is held at the proxy
    (vllm_stack_dev.cluster.api_proxy says why a proxy); meanwhile a Pod turns unready and etcd is compacted
    past the list's resourceVersion. Released, the watch meets the real API server's 410 Gone (no watch
    cache: the watch goes to etcd). The router counts it, lists again, and its engine set has the change
    made while it was not watching."""
    gone_before = stack.view()["discovery"]["failures_total"].get("gone", 0)
    pod = sorted(stack.discovered())[0]
    stack.proxy.hold_next_watch()
    try:
        stack.proxy.cut_watches()
        wait_for(stack.proxy.held.is_set, 30, "the router's next watch held (its list has passed)")
        _patch_ready(stack.cluster, pod, False)
        # One more write, so that the compaction passes the watch's first revision (list + 1, the patch): a
        # compaction exactly at it keeps that event but not the one before, and the API server answers 500
        # "etcd event received with PrevKv=nil" instead (seen here; the router re-lists after that too).
        stack.cluster.kubectl("create", "configmap", "revision-bump", "-n", NAMESPACE)
        compact_etcd(stack.cluster)
    finally:
        stack.proxy.release()
    try:
        wait_for(lambda: stack.view()["discovery"]["failures_total"].get("gone", 0) > gone_before, 10,
                 "the router meets 410 Gone")  # fmt: skip
        wait_for(lambda: pod not in stack.discovered(), 10, f"{pod}'s change, made while not watching, seen")
        wait_for(lambda: stack.view()["discovery"]["healthy"], 10, "discovery healthy again")
        assert "expired resourceVersion (410 Gone)" in stack.router_log.read_text()
    finally:
        _patch_ready(stack.cluster, pod, True)
    wait_for(lambda: pod in stack.discovered(), FOLLOW_S, f"{pod} back")


def test_scale_up_and_down_under_load_and_an_api_server_restart(stack: Stack) -> None:
    """A third Pod joins (its engine started by the test bed) and is served; the Deployment is scaled back
    to two under load: the removed Pod's engine gets nothing later than 2 s after the deletion, and no
    request fails. Then the API server is restarted under load and a Pod's readiness change is still
    followed within 2 s."""
    before = set(stack.discovered())
    stack.cluster.kubectl("scale", "deployment", ENGINES, "-n", NAMESPACE, "--replicas=3")
    new_pod = wait_for(lambda: ({p["metadata"]["name"] for p in stack.engine_pods()} - before) or None, 30,
                       "a third engine Pod")  # fmt: skip
    (new_pod,) = new_pod
    # Scheduled, Running with an IP and Ready (kwok's part, which takes seconds on a busy machine: CI once
    # saw the router discover the Pod about 10 s after the scale command, just past a bound of 10 s taken
    # from the Pod's creation), then the router's part, from then on.
    wait_for(lambda: stack.pod_ready(new_pod), 60, f"{new_pod} Ready in the API server")
    wait_for(lambda: new_pod in stack.discovered(), 10, f"{new_pod} discovered once Ready")
    wait_for(lambda: new_pod in stack.routable(), READY_TIMEOUT, f"{new_pod}'s engine routable")
    engine = stack.pods.engine_of(new_pod)
    with Load(stack.url) as load:
        wait_for(lambda: arrivals(engine) > 0, 30, f"requests served by {new_pod}")

        scaled_down = time.time()  # the deletion comes after this: the bound below is, if anything, earlier
        stack.cluster.kubectl("scale", "deployment", ENGINES, "-n", NAMESPACE, "--replicas=2")
        deleted = wait_for(stack.pods.gone_pods, 30, "a Pod removed")
        (gone_pod,) = deleted
        gone_engine = stack.pods.engine_of(gone_pod)
        wait_for(lambda: gone_pod not in stack.discovered(), FOLLOW_S, f"{gone_pod} out of the router")
        # Nothing may reach the engine after deletion + 2 s: wait for that instant (a bound, not a state),
        # then for what it still holds to finish, and count; 40 more answers of the load must add nothing.
        time.sleep(max(0.0, scaled_down + FOLLOW_S - time.time()))
        settled = wait_for(lambda: (c := requests_in(gone_engine))[1] == 0 and c, 30, f"{gone_pod} idle")
        answered = len(load.codes)
        wait_for(lambda: len(load.codes) >= answered + 40, 60, "40 more answers after the scale-down")
        assert requests_in(gone_engine) == settled, f"{gone_pod}'s engine got requests after deletion + 2 s"

        restarted = time.time()
        stack.cluster.restart_api_server()
        wait_for(lambda: (d := stack.view()["discovery"])["since"] > restarted and d["healthy"], 30,
                 "discovery healthy again after noticing the restart")  # fmt: skip
        assert_ready_condition_followed(stack)
        wait_for(lambda: len(stack.routable()) == 2, 10, "both engines routable again")
    stack.pods.stop_gone()
    assert load.codes and set(load.codes) == {200}, f"answers other than 200: {sorted(set(load.codes))}"
