"""One env entry per name in every container the chart renders, for every values file (the chart's examples,
the tutorials and every production-stack file that renders): Helm 4 installs with server-side apply, which
refuses a container with two entries of one name (`helm install --dry-run=client` never sees it). A user's
entry replaces the chart's entry of the same name."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from tests.helm.chart import container, env_of, find, render, values_file, values_files
from tests.helm.test_production_stack_names import rendering
from tests.shared_data import PS_VALUES, require

pytestmark = pytest.mark.helm

FILES = [str(p) for p in values_files()] + [str(PS_VALUES / n) for n in rendering()]


def _containers(objs: list[dict]):
    for obj in objs:
        spec = obj.get("spec") or {}
        pod = (spec.get("template") or {}).get("spec") or (spec if obj["kind"] == "Pod" else {})
        for c in [*pod.get("containers", []), *pod.get("initContainers", [])]:
            yield f"{obj['kind']}/{obj['metadata']['name']}/{c['name']}", c


@pytest.mark.parametrize("path", FILES, ids=lambda p: Path(p).name)
def test_every_container_has_one_env_entry_per_name(path):
    dupes = {}
    if path.startswith(str(PS_VALUES)):
        require(Path(path))
    for where, c in _containers(render([path])):
        counts = collections.Counter(e["name"] for e in c.get("env", []))
        if twice := [n for n, k in counts.items() if k > 1]:
            dupes[where] = twice
    assert not dupes, dupes


def test_a_users_entry_replaces_the_charts(tmp_path):
    values = {
        "servingEngineSpec": {
            "env": [{"name": "HF_HOME", "value": "/engine-wide"}, {"name": "A", "value": "spec"}],
            "modelSpec": [
                {
                    "name": "m",
                    "modelURL": "org/m",
                    "lmcacheConfig": {"enabled": True, "diskOffloadingBufferSize": 10},
                    "env": [
                        {"name": "LMCACHE_LOCAL_DISK", "value": "file:///mine/"},
                        {"name": "A", "value": "model"},
                    ],
                    "initContainer": {
                        "name": "i",
                        "image": "busybox",
                        "env": [{"name": "RELEASE_NAME", "value": "x"}],
                    },
                }
            ],
        },
        "routerSpec": {"env": [{"name": "TMPDIR", "value": "/scratch"}]},
    }
    objs = render([values_file(tmp_path, values)])
    engine = next(d for d in find(objs, "Deployment") if d["metadata"]["name"].endswith("-m-deployment-vllm"))
    env = env_of(container(engine))
    assert (
        env["HF_HOME"]["value"] == "/engine-wide"
    )  # production-stack's servingEngineSpec.env, over the chart's
    assert env["LMCACHE_LOCAL_DISK"]["value"] == "file:///mine/"  # the model's, over the chart's
    assert env["A"]["value"] == "model"  # the model's env over the engine-wide one
    init = engine["spec"]["template"]["spec"]["initContainers"][0]
    assert env_of(init)["RELEASE_NAME"]["value"] == "x"
    router = next(d for d in find(objs, "Deployment") if d["metadata"]["name"].endswith("-deployment-router"))
    assert env_of(container(router))["TMPDIR"]["value"] == "/scratch"
    for _, c in _containers(objs):
        names = [e["name"] for e in c.get("env", [])]
        assert len(names) == len(set(names)), names
