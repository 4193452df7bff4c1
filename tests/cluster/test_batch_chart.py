"""The chart's Batch API (``routerSpec.batch``) installed on the real API server: two router replicas sharing
their batches through a real PostgreSQL database (its URL in a Secret) and their files on one
ReadWriteMany claim.

The test creates the namespace and a Secret (key ``url``: the DSN of a fresh database of the test bed's
PostgreSQL server, vllm_stack_dev.testbed.postgres), then installs one release with Helm 4: model ``tiny``
(one engine Pod), the router at ``replicaCount: 2`` with ``batch.enabled``, ``storage.accessMode:
ReadWriteMany`` and ``database.secretName`` naming that Secret. What is shown:

1. the API server accepted every object: the claim (ReadWriteMany, the requested size, kept on uninstall,
   bound by the cluster's provisioner), the router Deployment (2 replicas, both Ready, the RollingUpdate
   strategy a database on a ReadWriteMany volume allows), its ``VLLM_STACK_BATCH_DATABASE_URL`` from the
   Secret by ``secretKeyRef``; the DSN (and its password) appears in neither the Deployment, its Pods nor
   the release's manifest (``helm get manifest``);
2. both router Pods run (vllm_stack_dev.cluster.pod_processes: the router with the Pod's rendered arguments
   at the Pod's IP), each with ``--batch-dir`` made the one local folder standing for the claim and the
   database URL read from the Secret the API server holds;
3. a batch uploaded through router Pod A and created through router Pod B completes on the real vLLM engine
   with every line in its output once; its files are in the shared folder and no SQLite file is: the two
   replicas share the database and the volume.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.pod_processes import PodProcesses, RouterProcess
from vllm_stack_dev.cluster.releases import Helm, namespace_object, place, wait_workloads_ready
from vllm_stack_dev.testbed.engines import log_tail, wait_ready
from vllm_stack_dev.testbed.postgres import PostgresError, PostgresServer, find_binaries
from vllm_stack_dev.waiting import wait_http_ok

from tests.batch.helpers import create_batch, file_lines, input_lines, jsonl, upload, wait_batch
from tests.cluster.serving import wait_for
from tests.cluster.test_install import RELEASE
from tests.conftest import CHAT_MODEL, READY_TIMEOUT
from tests.helm.chart import CHART

pytestmark = [pytest.mark.cluster, pytest.mark.postgres]

NAMESPACE = "batch-chart"
SECRET = "batch-db"
ROUTERS = f"{RELEASE}-deployment-router"
CLAIM = f"{RELEASE}-router-batch"
SERVICE_ACCOUNT = f"{RELEASE}-router-service-account"
DATABASE_ENV = "VLLM_STACK_BATCH_DATABASE_URL"
BATCH_DIR = "/var/lib/vllm-stack/batch"
SIZE = "2Gi"
# From the engine answering /health to both routers listing it healthy: discovery's watch, then a probe.
ROUTABLE_S = 120
LINES = 6
VALUES = {
    "servingEngineSpec": {"modelSpec": [{"name": "tiny", "modelURL": CHAT_MODEL, "replicaCount": 1}]},
    "routerSpec": {
        "replicaCount": 2,
        "routingLogic": "roundrobin",
        "healthCheckInterval": 1,
        "batch": {
            "enabled": True,
            "storage": {"accessMode": "ReadWriteMany", "size": SIZE},
            "database": {"secretName": SECRET},  # the key: the chart's default, `url`
        },
    },
}


@dataclass
class Database:
    dsn: str
    password: str


@dataclass
class Stack:
    cluster: Cluster
    helm: Helm
    pods: PodProcesses
    routers: list[RouterProcess]
    database: Database
    shared: Path  # the local folder standing for the claim


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Database]:
    """A fresh database on the test bed's PostgreSQL server (started for this module: tests/batch's
    session fixtures are not visible from this package)."""
    try:
        find_binaries()
    except PostgresError as error:
        pytest.fail(str(error), pytrace=False)
    with PostgresServer(tmp_path_factory.mktemp("postgres")) as server:
        yield Database(server.new_database("batch_chart"), server.password)


def secret_object(dsn: str) -> dict[str, Any]:
    """The user's Secret holding the database URL, created before the install (the chart renders none)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": SECRET, "namespace": NAMESPACE},
        "type": "Opaque",
        "data": {"url": base64.b64encode(dsn.encode()).decode()},
    }


def routable(router: RouterProcess, pods: PodProcesses) -> bool:
    pods.check()
    try:
        engines = httpx.get(f"{router.url}/engines", timeout=5).json()["engines"]
    except httpx.HTTPError:
        return False
    return any(e["healthy"] and CHAT_MODEL in e["models"] for e in engines)


def environ(router: RouterProcess) -> dict[str, str]:
    """The router process's environment, as the kernel holds it."""
    raw = Path(f"/proc/{router.process.pid}/environ").read_bytes()
    return dict(entry.decode().partition("=")[::2] for entry in raw.split(b"\0") if entry)


@pytest.fixture(scope="module")
def stack(
    cluster: Cluster,
    database: Database,
    tiny_model_dir: Path,
    engine_logs_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("batch-chart")
    values = work / "values.yaml"
    values.write_text(json.dumps(VALUES))
    helm = Helm(cluster, 4)
    documents = helm.template(RELEASE, CHART, NAMESPACE, values)
    try:
        cluster.apply([namespace_object(NAMESPACE), secret_object(database.dsn)])
        with place(cluster, documents, NAMESPACE):
            helm.install(RELEASE, CHART, NAMESPACE, values)
            wait_workloads_ready(cluster, NAMESPACE)
        kubeconfig = cluster.service_account_kubeconfig(
            NAMESPACE, SERVICE_ACCOUNT, work / "router.kubeconfig"
        )
        pods = PodProcesses(
            cluster, NAMESPACE, documents, model_dir=tiny_model_dir, workdir=work / "pods",
            log_dir=engine_logs_dir, router_env={"KUBECONFIG": str(kubeconfig)},
        )  # fmt: skip
        with pods, pods.follow():
            wait_for(
                lambda: pods.check() or (len(pods.routers) == 2 and pods.engines),
                60,
                "both router Pods' processes and the engine Pod's",
            )
            routers = sorted(pods.routers.values(), key=lambda r: r.pod)
            # The engine's own readiness first: a failed start is reported with its log, not as a router
            # that never finds it.
            wait_ready(list(pods.engines.values()), READY_TIMEOUT)
            for router in routers:
                wait_http_ok(f"{router.url}/health", 60, router.process)
            for router in routers:
                wait_for(
                    lambda router=router: routable(router, pods),
                    ROUTABLE_S,
                    lambda router=router: (
                        f"the ready engine Pod routable by router Pod {router.pod}; "
                        f"its log {router.log}:\n{log_tail(router.log, 40)}"
                    ),
                    interval=0.5,
                )
            yield Stack(cluster, helm, pods, routers, database, work / "pods" / "claims" / CLAIM)
    finally:
        helm.run("uninstall", RELEASE, "-n", NAMESPACE, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", "--ignore-not-found", check=False)


async def run_batch(upload_url: str, create_url: str) -> tuple[str, dict[str, Any], list[dict], list[dict]]:
    """Upload through one router, create the batch through the other, wait for its end there and read its
    files through the first: (the input file's id, the batch, the output lines, the error lines)."""
    async with (
        httpx.AsyncClient(base_url=upload_url, timeout=60) as a,
        httpx.AsyncClient(base_url=create_url, timeout=60) as b,
    ):
        uploaded = await upload(a, jsonl(input_lines(LINES, CHAT_MODEL, max_tokens=8)))
        assert uploaded.status_code == 200, uploaded.text
        file_id = uploaded.json()["id"]
        created = await create_batch(b, file_id)
        assert created.status_code == 200, created.text
        done = await wait_batch(b, created.json()["id"], {"completed", "failed", "expired"}, within=300)
        seen_by_a = (await a.get(f"/v1/batches/{done['id']}")).json()
        assert seen_by_a["status"] == done["status"], (seen_by_a, done)
        return (
            file_id,
            done,
            await file_lines(a, done["output_file_id"]),
            await file_lines(a, done["error_file_id"]),
        )


def test_two_router_replicas_share_batches_through_the_secrets_database_and_one_claim(stack: Stack) -> None:
    cluster, dsn, password = stack.cluster, stack.database.dsn, stack.database.password

    # 1. What the API server holds.
    claim = cluster.get("persistentvolumeclaim", CLAIM, "-n", NAMESPACE)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["resources"]["requests"]["storage"] == SIZE
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert claim["status"]["phase"] == "Bound", claim["status"]
    deployment = cluster.get("deployment", ROUTERS, "-n", NAMESPACE)
    assert deployment["spec"]["replicas"] == 2 and deployment["status"]["readyReplicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate", deployment["spec"]["strategy"]
    template = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in template["containers"] if c["name"] == "router"]
    env = {e["name"]: e for e in container["env"]}
    assert env[DATABASE_ENV] == {
        "name": DATABASE_ENV,
        "valueFrom": {"secretKeyRef": {"name": SECRET, "key": "url"}},
    }
    assert {"name": "batch", "mountPath": BATCH_DIR} in container["volumeMounts"]
    assert {"name": "batch", "persistentVolumeClaim": {"claimName": CLAIM}} in template["volumes"]
    args = container["args"]
    assert "--batch-api" in args and args[args.index("--batch-dir") + 1] == BATCH_DIR
    pods = [
        p for p in stack.pods.pods() if p["metadata"]["labels"].get("app.kubernetes.io/component") == "router"
    ]
    assert len(pods) == 2
    manifest = stack.helm.run("get", "manifest", RELEASE, "-n", NAMESPACE).stdout
    assert f"name: {CLAIM}" in manifest and DATABASE_ENV in manifest
    for where, text in [
        ("the Deployment", json.dumps(deployment)),
        ("the router Pods", json.dumps(pods)),
        ("the release's manifest", manifest),
    ]:
        assert dsn not in text and password not in text and "postgresql://" not in text, where

    # 2. Both router Pods run, on one folder for the claim and with the URL from the Secret.
    assert sorted(r.pod for r in stack.routers) == sorted(p["metadata"]["name"] for p in pods)
    for router in stack.routers:
        argv = [str(a) for a in router.process.args]  # type: ignore[union-attr]
        assert argv[argv.index("--batch-dir") + 1] == str(stack.shared), argv
        assert environ(router)[DATABASE_ENV] == dsn
    assert stack.routers[0].url != stack.routers[1].url

    # 3. Upload through A, create through B: one batch, every line once.
    a, b = stack.routers
    file_id, done, output, errors = asyncio.run(run_batch(a.url, b.url))
    stack.pods.check()
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}, done
    assert not errors, errors
    assert sorted(line["custom_id"] for line in output) == sorted(f"req-{n}" for n in range(LINES))
    assert all(line["response"]["status_code"] == 200 for line in output), output
    assert all(line["response"]["body"]["usage"]["completion_tokens"] > 0 for line in output)
    # The files are on the shared folder; the batches' state is in PostgreSQL, not in a SQLite file there.
    for name in (file_id, done["output_file_id"]):
        assert (stack.shared / "files" / name).is_file(), sorted(p.name for p in stack.shared.rglob("*"))
    assert not list(stack.shared.glob("batch.sqlite3*"))
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT state, sends, COUNT(*) FROM vs_lines WHERE batch_id = %s GROUP BY state, sends",
            (done["id"],),
        ).fetchall()
        (status,) = conn.execute("SELECT status FROM vs_batches WHERE id = %s", (done["id"],)).fetchone()
    assert rows == [("done", 1, LINES)], rows  # each line sent once, its result stored once
    assert status == "completed"
