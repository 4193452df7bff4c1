"""A production-stack release taken to this chart in place with `helm upgrade`, and back with `helm rollback`.

What a production-stack user does (helm/README.md, "Coming from production-stack"), on the real API server,
with Helm 3 and with Helm 4:
1. `helm install vllm <production-stack's chart> -f <file>` (its own chart, ../shared/production-stack-chart),
   for three of its files: the minimal one, one with a PVC and a Secret key (basic config), one with a
   PVC, a PDB, a chat-template ConfigMap and session routing;
2. `helm upgrade vllm ./helm -f <the same file>`: every Service keeps its name, selector and the ports a
   client names (those dropped on purpose are listed below, and in helm/README.md), and Ready Pods of the
   new release stand behind each; every PVC is the same object (same UID) bound to the same volume; every
   Secret keeps its name and keys;
3. a client addresses the router by production-stack's Service name, before and after the upgrade (and after
   the rollback). There is
   no kube-proxy here, so the test bed resolves the name as kube-proxy would (the Service's selector, its
   Ready Pods' loopback IPs, the target port: vllm_stack_dev.cluster.services), and a router process is
   started at that Pod's IP and port, in front of one real vLLM engine. It stands in for the container
   the Pod would run (no container runtime here): before the upgrade production-stack's router image,
   which cannot run here at all, afterwards this project's router;
4. `helm rollback vllm 1` returns to production-stack's chart, the same objects kept.

Every other production-stack file that renders goes through 1, 2 and 4 too, with one Helm each (alternating).
One cannot be rolled back, by a fault of production-stack's own rendering (ROLLBACK_REFUSED); the test
holds that it still upgrades, and that the rollback fails for that reason and no other.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_stack_dev.cluster.control_plane import Cluster, tool_env
from vllm_stack_dev.cluster.releases import Helm, place, wait_workloads_ready
from vllm_stack_dev.cluster.services import Backend, service_backends
from vllm_stack_dev.testbed.engines import (
    Engine,
    EngineSpec,
    default_cpus,
    launch,
    spawn_logged,
    stop_group,
    wait_ready,
)
from vllm_stack_dev.waiting import wait_http_ok

from tests import shared_data
from tests.cluster.cases import ConcurrentCases, selected
from tests.cluster.test_install import (
    NODE_PORTS,
    RELEASE,
    discard,
    fresh_namespace,
    rendering_production_stack_files,
)
from tests.conftest import CHAT_MODEL, READY_TIMEOUT
from tests.helm.chart import CHART

pytestmark = pytest.mark.cluster

FILES = (
    "tutorials__values-01-minimal-example.yaml",
    "tutorials__values-02-basic-config.yaml",
    "tests__values-06-session-routing.yaml",
)
ROUTER_CLI = Path(sys.executable).parent / "vllm-stack"
ROUTER_SERVICE = "vllm-router-service"
ROUTER_PORT = "router-sport"
#: Service ports production-stack has and this chart leaves out, with the reason (helm/README.md, "Deviations
#: kept on purpose"): no client of the release names them.
DROPPED_PORTS = {
    "lmcache-port": "production-stack's router hosts LMCache's controller there; here it is its own Service",
    "zmq-port": "production-stack's PD transfer port on every engine Service; LMCache PD talks pod to pod",
    "ucx-port": "the same, for UCX",
}
#: Where production-stack's own chart cannot be gone back to: (what Helm says, why). Its rendering of this
#: file has HF_HOME twice in the engine's env; the upgrade to this chart (one entry per name) works.
ROLLBACK_REFUSED = {
    "tutorials__values-17-kv-aware.yaml": (
        "doesn't match $setElementOrder list",
        "Helm 3's strategic merge patch back to an env list with a duplicate name fails",
    ),
}
#: production-stack's rendering that Helm 4 refuses to install (server-side apply: the duplicate HF_HOME).
HELM3_ONLY = {"tutorials__values-17-kv-aware.yaml"}
#: Secrets Kubernetes and Helm keep for themselves, not the release's.
OWN_SECRET_TYPES = {"helm.sh/release.v1", "kubernetes.io/service-account-token"}


@dataclass(frozen=True)
class Held:
    """What a client or a user's data depends on: Services, claims, Secrets, as the API server holds them."""

    services: dict[str, tuple[tuple[tuple[str, str], ...], frozenset[tuple[str, int, str]]]]
    claims: dict[str, tuple[str, str]]  # name -> (uid, bound volume)
    secrets: dict[str, frozenset[str]]  # name -> keys
    served: frozenset[str]  # the Services with a Ready Pod behind them


def held(cluster: Cluster, namespace: str) -> Held:
    listed = _items(cluster, "services", namespace)
    services = {
        s["metadata"]["name"]: (
            tuple(sorted((s["spec"].get("selector") or {}).items())),
            frozenset((p.get("name", ""), p["port"], p.get("protocol", "TCP")) for p in s["spec"]["ports"]),
        )
        for s in listed
    }
    served = frozenset(
        s["metadata"]["name"]
        for s in listed
        if service_backends(cluster, namespace, s["metadata"]["name"], s["spec"]["ports"][0]["port"])
    )
    claims = {
        c["metadata"]["name"]: (c["metadata"]["uid"], c["spec"].get("volumeName", ""))
        for c in _items(cluster, "persistentvolumeclaims", namespace)
    }
    secrets = {
        s["metadata"]["name"]: frozenset((s.get("data") or {}).keys())
        for s in _items(cluster, "secrets", namespace)
        if s.get("type") not in OWN_SECRET_TYPES
    }
    return Held(services, claims, secrets, served)


def _items(cluster: Cluster, kind: str, namespace: str) -> list[dict[str, Any]]:
    return cluster.get(kind, "-n", namespace)["items"]  # type: ignore[return-value]


def assert_kept(cluster: Cluster, namespace: str, before: Held, after: Held, chart: str) -> None:
    """Every Service, claim and Secret of ``before`` is still there as a client or the data needs it."""
    for name, (selector, ports) in before.services.items():
        assert name in after.services, f"{chart}: Service {name} is gone"
        assert after.services[name][0] == selector, f"{chart}: Service {name}'s selector changed"
        for port_name, number, protocol in ports:
            if port_name in DROPPED_PORTS:
                continue
            assert (port_name, number, protocol) in after.services[name][1], (
                f"{chart}: Service {name} lost port {port_name} {number}/{protocol}: {after.services[name][1]}"
            )
            if name in before.served:  # a disabled model's Service has no Pods, in either chart
                assert service_backends(cluster, namespace, name, port_name), (
                    f"{chart}: no Ready Pod behind Service {name} port {port_name}"
                )
    for name, (uid, volume) in before.claims.items():
        assert after.claims.get(name) == (uid, volume), (
            f"{chart}: claim {name} was {uid} on {volume}, now {after.claims.get(name)}"
        )
    for name, keys in before.secrets.items():
        assert name in after.secrets, f"{chart}: Secret {name} is gone"
        assert keys <= after.secrets[name], (
            f"{chart}: Secret {name} had keys {sorted(keys)}, now {sorted(after.secrets.get(name, ()))}"
        )


@contextmanager
def router_at(backend: Backend, engine: Engine, log: Path) -> Iterator[None]:
    """This project's router listening at ``backend``'s Pod IP and port, in front of ``engine``."""
    command = [
        str(ROUTER_CLI), "router", "--host", backend.ip, "--port", str(backend.port),
        "--service-discovery", "static", "--static-backends", engine.url, "--log-level", "warning",
    ]  # fmt: skip
    process = spawn_logged(command, log, tool_env())
    try:
        wait_http_ok(f"{backend.url}/ready", 60.0, process)
        yield
    finally:
        stop_group(process)


def ask_by_service_name(cluster: Cluster, namespace: str, engine: Engine, log: Path) -> None:
    """A chat completion sent to production-stack's router Service name, resolved to its Ready Pod."""
    (backend,) = service_backends(cluster, namespace, ROUTER_SERVICE, ROUTER_PORT)
    with router_at(backend, engine, log):
        answer = httpx.post(
            f"{backend.url}/v1/chat/completions",
            json={"model": CHAT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        )
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] is not None


def migrate_case(cluster: Cluster, engine: Engine, logs: Path, values: Path, major: int) -> None:
    """Install production-stack's chart, upgrade to this one, roll back; a client by Service name at each
    stage for FILES (the others: what the API server holds only)."""
    shared_data.require(values)
    theirs_chart = shared_data.require(shared_data.PS_CHART)
    helm = Helm(cluster, major)
    namespace = fresh_namespace(f"ps{major}")
    documents = helm.template(RELEASE, theirs_chart, namespace, values)
    documents += helm.template(RELEASE, CHART, namespace, values)
    log = logs / f"{namespace}-router.log"
    client = values.name in FILES
    with place(cluster, documents, namespace, NODE_PORTS):
        try:
            helm.install(RELEASE, theirs_chart, namespace, values)
            wait_workloads_ready(cluster, namespace)
            theirs = held(cluster, namespace)
            if client:
                ask_by_service_name(cluster, namespace, engine, log)

            helm.upgrade(RELEASE, CHART, namespace, values)
            assert helm.status(RELEASE, namespace) == ("deployed", 2)
            wait_workloads_ready(cluster, namespace)
            assert_kept(cluster, namespace, theirs, held(cluster, namespace), "after the upgrade")
            if client:
                ask_by_service_name(cluster, namespace, engine, log)

            if values.name in ROLLBACK_REFUSED:
                refused = helm.run("rollback", RELEASE, "1", "-n", namespace, check=False)
                assert refused.returncode != 0 and ROLLBACK_REFUSED[values.name][0] in refused.stderr, (
                    refused.stderr
                )
                return
            helm.rollback(RELEASE, namespace, 1)
            assert helm.status(RELEASE, namespace) == ("deployed", 3)
            wait_workloads_ready(cluster, namespace)
            assert_kept(cluster, namespace, theirs, held(cluster, namespace), "after the rollback")
            if client:
                ask_by_service_name(cluster, namespace, engine, log)
        finally:
            discard(cluster, helm, namespace)


def other_files() -> list[Path]:
    """Every other production-stack file that renders, each with one Helm (alternating, so each Helm meets
    half of them; both Helms for every file would add minutes to the tier and find nothing new: run once
    with both, all kept), except where production-stack's own chart needs Helm 3 (HELM3_ONLY)."""
    return [path for path in rendering_production_stack_files() if path.name not in FILES]


def one_helm(index: int, path: Path) -> int:
    return 3 if path.name in HELM3_ONLY else (3, 4)[index % 2]


#: The three files with both Helms in `make test`; every other file production-stack ships, with one Helm,
#: in `make test-cluster` (marker cluster_full)
CASES = [
    pytest.param(shared_data.PS_VALUES / name, major, id=f"{name}-helm{major}")
    for name in FILES
    for major in (3, 4)
] + [
    pytest.param(
        path, one_helm(i, path), marks=pytest.mark.cluster_full, id=f"{path.name}-helm{one_helm(i, path)}"
    )
    for i, path in enumerate(other_files())
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, engine_logs_dir: Path) -> Iterator[Engine]:
    """One real vLLM engine (tiny model) behind every stand-in router of this module."""
    spec = EngineSpec(tiny_model_dir, CHAT_MODEL, enable_lora=False, kv_events=False)
    started = launch(spec, name="from-production-stack", cpu=default_cpus(1)[0], log_dir=engine_logs_dir)
    try:
        wait_ready([started], READY_TIMEOUT)
        yield started
    finally:
        stop_group(started.process)


@pytest.fixture(scope="module")
def migrations(
    cluster: Cluster, engine: Engine, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ConcurrentCases]:
    logs = tmp_path_factory.mktemp("from-production-stack")
    chosen = selected(
        request, "test_a_production_stack_release_upgrades_in_place_and_rolls_back", ("values", "major")
    )
    cases = ConcurrentCases(lambda case: migrate_case(cluster, engine, logs, *case), chosen)  # type: ignore[misc]
    yield cases
    cases.close()


@pytest.mark.parametrize(("values", "major"), CASES)
def test_a_production_stack_release_upgrades_in_place_and_rolls_back(
    migrations: ConcurrentCases, values: Path, major: int
) -> None:
    migrations.result((values, major))
