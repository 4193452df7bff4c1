"""The router's Batch API in the chart (routerSpec.batch, README "Batch API"): off by default; on, the router
gets `--batch-api --batch-dir /var/lib/vllm-stack/batch` and the settings given, a claim kept on uninstall (or
an existing one) mounted there, the database URL from its Secret (never a literal), and a Recreate rollout
where one router owns the volume. Several replicas without a database, or with a volume they cannot all mount,
are refused at render time with the reason."""

from __future__ import annotations

import kubernetes_validate
import pytest

from tests.helm.chart import (
    NAMESPACE,
    RELEASE,
    container,
    env_of,
    find,
    flag,
    one,
    render,
    render_error,
    router_name,
    run_helm,
    values_file,
)
from tests.helm.test_production_stack_files import manifest_and_notes
from tests.helm.test_validate_objects import validate
from vllm_stack.router_cli import build_parser

pytestmark = pytest.mark.helm

HELMS = ["helm3", "helm4"]
BATCH_DIR = "/var/lib/vllm-stack/batch"
CLAIM = router_name("PersistentVolumeClaim")
DATABASE = {"secretName": "batch-db", "secretKey": "dsn"}


def batch_values(replicas: int = 1, **batch) -> dict:
    return {"routerSpec": {"replicaCount": replicas, "batch": {"enabled": True, **batch}}}


def router(objs: list[dict]) -> dict:
    return one(objs, "Deployment", router_name("Deployment"))


def batch_args(args: list[str]) -> list[str]:
    """The Batch API's flags and their values, in order."""
    out, keep = [], False
    for word in args:
        if word.startswith("--"):
            keep = word.startswith("--batch-")
        if keep:
            out.append(word)
    return out


def batch_volume(deployment: dict) -> dict | None:
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    return next((v for v in volumes if v["name"] == "batch"), None)


def test_off_by_default():
    objs = render()
    d = router(objs)
    c = container(d)
    assert not batch_args(c["args"])
    assert not find(objs, "PersistentVolumeClaim")
    assert batch_volume(d) is None and "batch" not in [m["name"] for m in c["volumeMounts"]]
    assert "VLLM_STACK_BATCH_DATABASE_URL" not in env_of(c)
    assert d["spec"]["strategy"] == {"rollingUpdate": {"maxSurge": "100%", "maxUnavailable": 0}}


@pytest.mark.parametrize("helm", HELMS)
def test_one_router_with_sqlite_on_a_kept_claim(tmp_path, helm):
    objs = render([values_file(tmp_path, batch_values())], helm=helm)
    d = router(objs)
    c = container(d)
    # The settings left null are the router's defaults: only the switch and the dir are rendered.
    assert batch_args(c["args"]) == ["--batch-api", "--batch-dir", BATCH_DIR]
    build_parser().parse_args(c["args"])
    pvc = one(objs, "PersistentVolumeClaim", CLAIM)
    assert pvc["metadata"]["namespace"] == NAMESPACE
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert pvc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    assert pvc["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}}
    assert batch_volume(d) == {"name": "batch", "persistentVolumeClaim": {"claimName": CLAIM}}
    assert {"name": "batch", "mountPath": BATCH_DIR} in c["volumeMounts"]
    # One router owns the SQLite file and the ReadWriteOnce volume: the old pod stops before the new starts.
    assert d["spec"]["strategy"] == {"type": "Recreate"} and d["spec"]["replicas"] == 1
    assert "VLLM_STACK_BATCH_DATABASE_URL" not in env_of(c)


def test_the_non_root_router_can_write_the_volume():
    """The pod's fsGroup makes the mounted volume group-writable for the router's user; its root file
    system stays read-only (the mount is a volume, not the image)."""
    d = router(render([], ["routerSpec.batch.enabled=true"]))
    pod = d["spec"]["template"]["spec"]["securityContext"]
    c = container(d)
    assert pod["runAsNonRoot"] and pod["fsGroup"] == 10001
    assert c["securityContext"]["runAsUser"] == 10001 and c["securityContext"]["readOnlyRootFilesystem"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == "batch")
    assert not mount.get("readOnly")


def test_settings_become_flags(tmp_path):
    values = batch_values(
        completionWindowSeconds=3600, maxFileBytes=104857600, concurrency=16, leaseSeconds=45, reserveSlots=2
    )
    args = container(router(render([values_file(tmp_path, values)])))["args"]
    assert flag(args, "--batch-completion-window") == "3600"
    assert flag(args, "--batch-max-file-bytes") == "104857600"  # no exponent: YAML numbers are floats in Helm
    assert flag(args, "--batch-concurrency") == "16"
    assert flag(args, "--batch-lease-seconds") == "45"
    assert flag(args, "--batch-reserve-slots") == "2"
    assert args.count("--batch-api") == 1 and flag(args, "--batch-dir") == BATCH_DIR
    build_parser().parse_args(args)


def test_storage_class_size_and_existing_claim(tmp_path):
    values = batch_values(
        storage={"size": "50Gi", "storageClassName": "fast", "accessMode": "ReadWriteOncePod"}
    )
    pvc = one(render([values_file(tmp_path, values)]), "PersistentVolumeClaim", CLAIM)
    assert pvc["spec"]["storageClassName"] == "fast"
    assert pvc["spec"]["accessModes"] == ["ReadWriteOncePod"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    objs = render([values_file(tmp_path, batch_values(storage={"existingClaim": "my-batches"}), "e.yaml")])
    assert not find(objs, "PersistentVolumeClaim")
    assert batch_volume(router(objs))["persistentVolumeClaim"] == {"claimName": "my-batches"}


def test_the_database_url_comes_from_its_secret_and_is_never_written(tmp_path):
    objs = render(
        [values_file(tmp_path, batch_values(3, database=DATABASE, storage={"accessMode": "ReadWriteMany"}))]
    )
    d = router(objs)
    entry = env_of(container(d))["VLLM_STACK_BATCH_DATABASE_URL"]
    assert entry == {
        "name": "VLLM_STACK_BATCH_DATABASE_URL",
        "valueFrom": {"secretKeyRef": {"name": "batch-db", "key": "dsn"}},
    }
    assert not [a for a in container(d)["args"] if "postgres" in a.lower()]
    text = run_helm(
        "helm4",
        "template", RELEASE, ".", "--namespace", NAMESPACE,
        "--set", "routerSpec.batch.enabled=true", "--set", "routerSpec.batch.database.secretName=batch-db",
    ).stdout  # fmt: skip
    assert "VLLM_STACK_BATCH_DATABASE_URL" in text and "postgresql://" not in text
    # The chart renders no Secret of its own for it (the user's holds the password).
    assert not [s for s in find(objs, "Secret") if "dsn" in (s.get("data") or {})]
    # Shared through the database, on a volume every replica mounts: the rolling update stays.
    assert d["spec"]["replicas"] == 3
    assert d["spec"]["strategy"] == {"rollingUpdate": {"maxSurge": "100%", "maxUnavailable": 0}}
    assert one(objs, "PersistentVolumeClaim", CLAIM)["spec"]["accessModes"] == ["ReadWriteMany"]


def test_the_default_secret_key_is_url(tmp_path):
    objs = render([values_file(tmp_path, batch_values(database={"secretName": "batch-db"}))])
    ref = env_of(container(router(objs)))["VLLM_STACK_BATCH_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "batch-db", "key": "url"}


def test_a_database_on_a_read_write_once_volume_is_recreated(tmp_path):
    d = router(render([values_file(tmp_path, batch_values(database=DATABASE))]))
    assert d["spec"]["strategy"] == {"type": "Recreate"}


def test_an_explicit_recreate_strategy_is_kept(tmp_path):
    values = batch_values()
    values["routerSpec"]["strategy"] = {"type": "Recreate"}
    assert router(render([values_file(tmp_path, values)]))["spec"]["strategy"] == {"type": "Recreate"}


def test_hpa_with_a_database_and_a_read_write_many_volume(tmp_path):
    values = batch_values(database=DATABASE, storage={"accessMode": "ReadWriteMany"})
    values["routerSpec"]["hpa"] = {"enabled": True, "maxReplicas": 4}
    objs = render([values_file(tmp_path, values)])
    assert "replicas" not in router(objs)["spec"]
    assert one(objs, "HorizontalPodAutoscaler", router_name("HorizontalPodAutoscaler"))


@pytest.mark.parametrize(
    "values, words",
    [
        (
            batch_values(2),
            ["routerSpec.batch.enabled with routerSpec.replicaCount 2", "SQLite", "database.secretName"],
        ),
        (
            {"routerSpec": {"batch": {"enabled": True}, "hpa": {"enabled": True}}},
            ["routerSpec.batch.enabled with routerSpec.hpa.enabled", "SQLite"],
        ),
        (  # production-stack's spelling of the HPA
            {"routerSpec": {"batch": {"enabled": True}, "autoscaling": {"enabled": True}}},
            ["routerSpec.batch.enabled with routerSpec.hpa.enabled (or autoscaling.enabled)", "SQLite"],
        ),
        (
            batch_values(2, database=DATABASE),
            [
                "routerSpec.batch.storage.accessMode ReadWriteOnce with routerSpec.replicaCount 2",
                "ReadWriteMany",
            ],
        ),
        (
            {"routerSpec": {"batch": {"enabled": True, "database": DATABASE}, "hpa": {"enabled": True}}},
            [
                "routerSpec.batch.storage.accessMode ReadWriteOnce with routerSpec.hpa.enabled",
                "ReadWriteMany",
            ],
        ),
        (
            batch_values(2, database=DATABASE, storage={"accessMode": "ReadWriteOncePod"}),
            ["routerSpec.batch.storage.accessMode ReadWriteOncePod", "ReadWriteMany"],
        ),
        (
            {"routerSpec": {"batch": {"enabled": True}, "strategy": {"type": "RollingUpdate"}}},
            ["routerSpec.strategy", "must be Recreated", "one router owns the batches' SQLite file"],
        ),
        (
            {
                "routerSpec": {
                    "batch": {"enabled": True, "database": DATABASE},
                    "strategy": {"rollingUpdate": {"maxSurge": 1}},
                }
            },
            ["routerSpec.strategy", "must be Recreated", "a ReadWriteOnce volume cannot be mounted"],
        ),
        (
            {"routerSpec": {"extraArgs": ["--batch-api"]}},
            ["routerSpec.extraArgs: --batch-api", "routerSpec.batch"],
        ),
        (
            {"routerSpec": {"batch": {"enabled": True}, "extraArgs": ["--batch-concurrency", "4"]}},
            ["routerSpec.extraArgs: --batch-concurrency", "routerSpec.batch"],
        ),
        (
            {"routerSpec": {"extraArgs": ["--enable-batch-api"]}},
            ["--enable-batch-api", "set routerSpec.batch.enabled instead"],
        ),
    ],
)
def test_what_cannot_work_is_refused_with_the_reason(tmp_path, values, words):
    err = render_error([values_file(tmp_path, values)])
    for word in words:
        assert word in err, err


@pytest.mark.parametrize(
    "batch, where",
    [
        ({"storage": {"accessMode": "ReadOnlyMany"}}, "accessMode"),
        ({"storage": {"size": "lots"}}, "size"),
        ({"concurrency": 0}, "concurrency"),
        ({"leaseSeconds": 1.5}, "leaseSeconds"),
        ({"database": {"secretName": "db", "secretKey": ""}}, "secretKey"),
        ({"databaseUrl": "postgresql://u:p@h/db"}, "databaseUrl"),  # no such key: the URL lives in a Secret
    ],
)
def test_the_schema_checks_the_settings(tmp_path, batch, where):
    err = render_error([values_file(tmp_path, {"routerSpec": {"batch": {"enabled": True, **batch}}})])
    assert where in err and "schema" in err, err


def test_no_router_no_batch(tmp_path):
    values = batch_values()
    values["routerSpec"]["enableRouter"] = False
    objs = render([values_file(tmp_path, values)])
    assert not find(objs, "PersistentVolumeClaim") and not find(objs, "Deployment", router_name("Deployment"))


def test_notes_say_where_the_batches_are():
    _, notes = manifest_and_notes(batch_values())
    (line,) = [n for n in notes if n.startswith("Batch API")]
    assert CLAIM in line and "kept on helm uninstall" in line and "SQLite" in line
    _, notes = manifest_and_notes(batch_values(database=DATABASE, storage={"existingClaim": "mine"}))
    (line,) = [n for n in notes if n.startswith("Batch API")]
    assert "mine" in line and "kept" not in line and "PostgreSQL (Secret batch-db, key dsn)" in line


@pytest.mark.parametrize(
    "values",
    [
        batch_values(completionWindowSeconds=3600, concurrency=4, storage={"storageClassName": "fast"}),
        batch_values(3, database=DATABASE, storage={"accessMode": "ReadWriteMany"}),
        batch_values(database=DATABASE, storage={"existingClaim": "mine"}),
    ],
    ids=["sqlite", "postgresql-rwx", "existing-claim"],
)
def test_kubernetes_accepts_the_objects(tmp_path, values):
    for obj in render([values_file(tmp_path, values)]):
        try:
            validate(obj)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']}: {exc}") from None
