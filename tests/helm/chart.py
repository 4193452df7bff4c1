"""Rendering the chart with the real Helm binaries, shared by the chart tests.

Binaries and paths are located relative to the repository root (`make install` puts Helm 3 and Helm 4
under .tools/). Rendering is cached per (helm, values files, --set) because many tests look at the same
output.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

import pytest
import yaml

from tests import shared_data

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm"
EXAMPLES = CHART / "examples"
TUTORIALS = ROOT / "tutorials"
CRDS = shared_data.CRDS  # the upstream CRD schemas, in ../shared (read through shared_data.require)
HELMS = {"helm3": ROOT / ".tools" / "helm3" / "helm", "helm4": ROOT / ".tools" / "helm4" / "helm"}
RELEASE = "vllm-stack"
NAMESPACE = "llm"


# Object names: production-stack's (helm/templates/_helpers.tpl), by kind.
ENGINE_SUFFIX = {
    "Deployment": "deployment-vllm",
    "Service": "engine-service",
    "PersistentVolumeClaim": "storage-claim",
    "PodDisruptionBudget": "pdb-vllm",
    "ScaledObject": "scaledobject",
    "ConfigMap": "chat-templates",
    "InferencePool": "inference-pool",
    "InferenceObjective": "inference-objective",
}
ROUTER_SUFFIX = {
    "Deployment": "deployment-router",
    "Service": "router-service",
    "ServiceAccount": "router-service-account",
    "Role": "reader",
    "RoleBinding": "deployment-access-binding",
    "HorizontalPodAutoscaler": "router-hpa",
    "PodDisruptionBudget": "pdb-router",
    "Ingress": "ingress-router",
    "HTTPRoute": "router",
    "ServiceMonitor": "router-servicemonitor",
    "ConfigMap": "router-config",
    "NetworkPolicy": "router",
    "Pod": "router-test",
    "PersistentVolumeClaim": "router-batch",
}
CACHE_SERVER_SUFFIX = {
    "Deployment": "deployment-cache-server",
    "Service": "cache-server-service",
    "NetworkPolicy": "cache-server",
}


def engine_name(model: str, kind: str = "Deployment", release: str = RELEASE) -> str:
    """The name the chart gives a model's object of this kind (production-stack's)."""
    return f"{release}-{model}-{ENGINE_SUFFIX[kind]}"


def router_name(kind: str = "Deployment", release: str = RELEASE) -> str:
    return f"{release}-{ROUTER_SUFFIX[kind]}"


def cache_server_name(kind: str = "Deployment", release: str = RELEASE) -> str:
    return f"{release}-{CACHE_SERVER_SUFFIX[kind]}"


def helm_path(name: str) -> Path:
    path = HELMS[name]
    if not path.exists():
        pytest.fail(
            f"{path.relative_to(ROOT)} missing: run `make install` (unpacks the Helm binaries into .tools)"
        )
    return path


def values_files() -> list[Path]:
    """Every values file the chart must accept: helm/examples/ and tutorials/."""
    return sorted(EXAMPLES.glob("*.yaml")) + sorted(TUTORIALS.glob("*.yaml"))


def file_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def run_helm(helm: str, *args: str, chart: Path = CHART) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm_path(helm)), *args], capture_output=True, text=True, timeout=120, cwd=chart
    )


def _template_args(values: tuple[str, ...], sets: tuple[str, ...], release: str) -> list[str]:
    args = ["template", release, ".", "--namespace", NAMESPACE]
    for v in values:
        args += ["-f", v]
    for s in sets:
        args += ["--set-json" if s.startswith("json:") else "--set", s.removeprefix("json:")]
    return args


@functools.cache
def _render_cached(helm: str, values: tuple[str, ...], sets: tuple[str, ...], release: str) -> str:
    proc = run_helm(helm, *_template_args(values, sets, release))
    if proc.returncode != 0:
        raise AssertionError(f"helm template failed ({helm}, {values}, {sets}):\n{proc.stderr}")
    return proc.stdout


def render(
    values: list[Path | str] | None = None,
    sets: list[str] | None = None,
    *,
    helm: str = "helm4",
    release: str = RELEASE,
) -> list[dict]:
    """Rendered objects (test hooks included). `sets` items are `--set` strings, or `json:k=v` for --set-json."""
    text = _render_cached(helm, tuple(str(v) for v in values or []), tuple(sets or []), release)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render_error(
    values: list[Path | str] | None = None, sets: list[str] | None = None, *, helm: str = "helm4"
) -> str:
    """The error text of a render that must fail."""
    proc = run_helm(helm, *_template_args(tuple(str(v) for v in values or []), tuple(sets or []), RELEASE))
    assert proc.returncode != 0, f"render unexpectedly succeeded: {values} {sets}"
    return proc.stderr


def values_file(tmp_path: Path, data: dict, name: str = "values.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def find(objs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(objs, kind, name)
    assert len(found) == 1, (
        f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    )
    return found[0]


def container(deployment: dict, name: str | None = None) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    return containers[0] if name is None else next(c for c in containers if c["name"] == name)


def env_of(c: dict) -> dict[str, dict]:
    """Container env as name -> the EnvVar (value or valueFrom)."""
    return {e["name"]: e for e in c.get("env", [])}


def flag(args: list[str], name: str) -> str | None:
    """The value following `name` in an argument list (None when absent)."""
    return args[args.index(name) + 1] if name in args else None


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """A Dockerfile as (INSTRUCTION, rest) pairs: continuations joined, comments and blank lines left out."""
    text = path.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out
