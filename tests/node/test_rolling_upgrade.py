"""Rolling upgrades under load on a real node (issue 47, item 3 (a)): the router Deployment rolled by `helm
upgrade` while a client sends steady traffic through the router Service, and not one request fails.

The client (tests/node/traffic.py) runs in the node's network namespace with a Pod's resolv.conf: it
reaches the router Service by the name CoreDNS resolves, through kube-proxy: four workers on a pool of
keep-alive connections as an OpenAI SDK client keeps, two on a new connection for every request (each one
resolved and routed by kube-proxy anew), half the requests streamed (20 chunks 0.1 s apart, so that a
stream spans a router Pod's termination). The engines are stubs (tests/node/stub_engine.py), two of them,
which do not change here: the engines' own roll is a separate step.

Steps, each counted: steady traffic; the router rolled at 2 replicas (a changed pod annotation); a settle
step; the router scaled 2 -> 1; rolled again at 1 replica, where the Deployment's strategy (maxSurge 100%,
maxUnavailable 0) must keep a ready router; a last settle step. The old Pods must really go (new names),
and every request of every step must be a complete 200 answer.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.node import RealNode
from vllm_stack_dev.cluster.releases import Helm, wait_workloads_ready
from vllm_stack_dev.images import ROUTER
from vllm_stack_dev.paths import repo_root

from tests.node.stub_engine import MODEL, stub_engine_objects
from tests.node.traffic import Traffic, pod_resolv_conf

pytestmark = pytest.mark.node

RELEASE = "roll"
NAMESPACE = "node-roll"
CHART = repo_root() / "helm"
VALUES = CHART / "examples" / "no-models.yaml"
POOLED, FRESH = 4, 2  # workers on a keep-alive pool, workers opening a connection per request
WORKERS = POOLED + FRESH
ROLL_TIMEOUT = 180.0  # a new router Pod started and Ready, the old ones through preStop and drain


def _router_pods(cluster: Cluster) -> dict[str, bool]:
    """Router Pod name -> terminating."""
    pods = cluster.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=router")["items"]
    return {p["metadata"]["name"]: bool(p["metadata"].get("deletionTimestamp")) for p in pods}  # type: ignore[union-attr]


@dataclass
class Stopped:
    """What a replaced router Pod logged of its stop."""

    pod: str
    under_way: int | None  # requests being read or answered at SIGTERM; None: its log was not caught
    drained: str | None  # "drained in 1.2 s", or the cut it reported


class RouterLogs:
    """The router containers' logs of the test's namespace, read every 0.2 s by a thread while the test
    runs: the kubelet keeps them in the node's `pod-logs` folder and removes a Pod's with the Pod, a moment
    after its router logged how its stop went."""

    def __init__(self, node: RealNode) -> None:
        self.folder = node.workdir / "pod-logs"
        self.logs: dict[str, str] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="router-logs", daemon=True)

    def __enter__(self) -> RouterLogs:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(timeout=10)

    def _run(self) -> None:
        while not self.done.wait(0.2):
            for path in self.folder.glob(f"{NAMESPACE}_*/router/*.log"):
                pod = path.parent.parent.name.split("_")[1]
                with contextlib.suppress(OSError):
                    text = path.read_text(errors="replace")
                    with self.lock:
                        self.logs[pod] = max(self.logs.get(pod, ""), text, key=len)

    def stopped(self, pods: set[str]) -> list[Stopped]:
        found = []
        with self.lock:
            logs = {pod: self.logs.get(pod, "") for pod in sorted(pods)}
        for pod, text in logs.items():
            start = re.search(r"stopping: (\d+) requests under way", text)
            end = re.search(r"(drained in [0-9.]+ s|grace period .* cut)", text)
            found.append(Stopped(pod, int(start.group(1)) if start else None, end.group(1) if end else None))
        return found


def _wait_gone(cluster: Cluster, names: set[str], what: str) -> None:
    deadline = time.monotonic() + ROLL_TIMEOUT
    while (left := names & set(_router_pods(cluster))) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"{what}: router Pods {sorted(left)} still there after {ROLL_TIMEOUT:.0f}s"


def _upgrade(
    cluster: Cluster, logs: RouterLogs, helm: Helm, traffic: Traffic, step: str, replicas: int, roll: str
) -> tuple[set[str], list[Stopped]]:
    """`helm upgrade` in step ``step`` (the pod annotation ``roll`` changes the template, so the Deployment
    rolls; the same value with other replicas only scales it); returns when the rollout is over and the
    Pods it replaced are gone: the router Pods then running, and what the replaced ones logged."""
    before = set(_router_pods(cluster))
    traffic.step(step)
    helm.upgrade(RELEASE, CHART, NAMESPACE, VALUES, sets=_sets(replicas, roll))
    wait_workloads_ready(cluster, NAMESPACE, timeout=ROLL_TIMEOUT)
    now = {name for name, terminating in _router_pods(cluster).items() if not terminating}
    _wait_gone(cluster, before - now, f"{step}: the replaced router Pods to end")
    assert len(now) == replicas, (step, now)
    return now, logs.stopped(before - now)


def _sets(replicas: int, roll: str) -> tuple[str, ...]:
    """The release's values: ``replicas`` routers, the pod annotation ``roll``; a CPU request of 100m, as
    the node's 2 CPUs must hold the surge of a roll (twice the routers) beside other tests' Pods (the
    chart's 500m would leave the new Pods Pending)."""
    return (f"routerSpec.replicaCount={replicas}", f"routerSpec.podAnnotations.roll={roll}",
            "routerSpec.resources.requests.cpu=100m")  # fmt: skip


@pytest.fixture
def release(node_cluster: tuple[Cluster, RealNode]) -> Iterator[tuple[Cluster, RealNode, Helm]]:
    """Two stub engines and the chart's router (2 replicas) in NAMESPACE; all of it deleted at the end,
    also when the test fails, so that later tests of the package find the node's CPU free."""
    cluster, node = node_cluster
    helm = Helm(cluster, 4)
    cluster.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}])
    try:
        cluster.apply(stub_engine_objects(ROUTER.reference(), NAMESPACE, RELEASE, replicas=2))
        helm.install(RELEASE, CHART, NAMESPACE, VALUES, sets=_sets(2, "r0"))
        wait_workloads_ready(cluster, NAMESPACE, timeout=300)
        yield cluster, node, helm
    finally:
        helm.run("uninstall", RELEASE, "-n", NAMESPACE, check=False)
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def test_router_rolls_under_load(release: tuple[Cluster, RealNode, Helm], tmp_path: Path) -> None:
    cluster, node, helm = release
    first = set(_router_pods(cluster))

    url = f"http://{RELEASE}-router-service"  # a Pod's short name: the search domains, CoreDNS, kube-proxy
    stops: dict[str, list[Stopped]] = {}
    with RouterLogs(node) as logs, Traffic(node, tmp_path / "traffic", url, MODEL, concurrency=POOLED,
                                           fresh=FRESH, resolv_conf=pod_resolv_conf(NAMESPACE)) as traffic:  # fmt: skip
        traffic.start("steady", first=2 * WORKERS)
        step = "roll router, 2 replicas"
        rolled, stops[step] = _upgrade(cluster, logs, helm, traffic, step, 2, "r1")
        assert not rolled & first, (first, rolled)
        traffic.step("settle")
        traffic.wait_for(2 * WORKERS, 60, "complete answers after the roll at 2 replicas")
        step = "scale router 2 -> 1"
        one, stops[step] = _upgrade(cluster, logs, helm, traffic, step, 1, "r1")
        assert one < rolled, (rolled, one)
        step = "roll router, 1 replica"
        last, stops[step] = _upgrade(cluster, logs, helm, traffic, step, 1, "r2")
        assert not last & one, (one, last)
        traffic.step("settle again")
        traffic.wait_for(2 * WORKERS, 60, "complete answers after the roll at 1 replica")
        report = traffic.stop()

    table = report.table()
    said = "\n".join(f"{step}: {s.pod} had {s.under_way} requests under way at SIGTERM, {s.drained}"
                     for step, stopped in stops.items() for s in stopped)  # fmt: skip
    (tmp_path / "table.md").write_text(f"{table}\n{said}\n")
    print(f"\n{table}\n{said}")
    assert not report.failures, report.explain()
    assert all(step.requests for step in report.steps), table
    # The rolls are the test: the replaced routers had requests under way (streams span 2 s) when SIGTERM
    # came, and drained them, none cut by the grace period; and their preStop sleep ran.
    for step in ("roll router, 2 replicas", "roll router, 1 replica"):
        assert report.step(step).streamed, table
        assert sum(s.under_way or 0 for s in stops[step]) > 0, said
    assert not any(s.drained and "cut" in s.drained for stopped in stops.values() for s in stopped), said
    events = cluster.get("events", "-n", NAMESPACE)["items"]
    hooks = [e["message"] for e in events if e.get("reason") == "FailedPreStopHook"]  # type: ignore[union-attr]
    assert not hooks, hooks
