"""Stub engine Pods for the node tests: tests/node/stub_engine_server.py (standard library only) run by the
router image's Python, in a Deployment labelled as the chart labels a release's engines, so that the chart's
router discovers them. They stand in for the CPU vLLM engines where a test is about the router (its
Pods' roll, its Service), and answer chat completions plain and streamed at a steady pace.
"""

from __future__ import annotations

from pathlib import Path

SERVER = Path(__file__).with_name("stub_engine_server.py")
MODEL = "stub-model"


def engine_labels(release: str) -> dict[str, str]:
    """The labels the chart's router selects engines by (`--k8s-label-selector`), and the stub's name."""
    return {"app.kubernetes.io/instance": release, "app.kubernetes.io/component": "serving-engine",
            "app.kubernetes.io/name": "stub-engine"}  # fmt: skip


def stub_engine_objects(
    image: str,
    namespace: str,
    release: str,
    replicas: int = 1,
    chunk_interval: float = 0.1,
    pre_stop_seconds: int = 0,
    grace_seconds: int = 30,
    labels: dict[str, str] | None = None,
) -> list[dict[str, object]]:
    """A ConfigMap holding the server and a Deployment of ``replicas`` stub engines (non-root, read-only
    root file system, no capabilities, as the chart's router runs). ``pre_stop_seconds``: a native
    preStop sleep, as the chart gives its engines (the stub itself stops at SIGTERM at once). ``labels``:
    the Pods' labels, if not :func:`engine_labels` (an InferencePool's selector, for instance)."""
    labels = labels or engine_labels(release)
    probe = {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 2}
    container: dict[str, object] = {
        "name": "engine",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "/stub/engine.py"],
        "env": [
            {"name": "STUB_MODEL", "value": MODEL},
            {"name": "STUB_CHUNK_INTERVAL", "value": str(chunk_interval)},
        ],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": probe,
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },  # fmt: skip
        "volumeMounts": [{"name": "stub", "mountPath": "/stub"}],
    }
    if pre_stop_seconds:
        container["lifecycle"] = {"preStop": {"sleep": {"seconds": pre_stop_seconds}}}
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "stub-engine", "namespace": namespace},
            "data": {"engine.py": SERVER.read_text()},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "stub-engine", "namespace": namespace},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "automountServiceAccountToken": False,
                        "terminationGracePeriodSeconds": grace_seconds,
                        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001},
                        "containers": [container],
                        "volumes": [{"name": "stub", "configMap": {"name": "stub-engine"}}],
                    },
                },
            },
        },
    ]
