"""An engine container on a read-only root file system gets a writable /tmp from the chart: Python's tempfile,
torch and vLLM need one (the CPU engine exits at import with "No usable temporary directory" without it, as the
node tier saw), and vLLM's cache and config roots move there (XDG_CACHE_HOME, XDG_CONFIG_HOME). Engines with a
writable root, and models that mount their own /tmp, are rendered as before."""

from __future__ import annotations

import pytest
import yaml

from tests.helm.chart import EXAMPLES, container, engine_name, one, render, values_file

pytestmark = pytest.mark.helm


def _engine(tmp_path, values: dict) -> dict:
    objs = render([values_file(tmp_path, values)])
    return one(objs, "Deployment", engine_name(values["servingEngineSpec"]["modelSpec"][0]["name"]))


def _tmp_mounts(deployment: dict) -> list[str]:
    pod = deployment["spec"]["template"]["spec"]
    mounts = [m["name"] for m in container(deployment)["volumeMounts"] if m["mountPath"] == "/tmp"]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    return [name for name in mounts if "emptyDir" in volumes[name]]


def test_read_only_root_gets_an_empty_dir_at_tmp_and_the_cache_roots_there(tmp_path):
    values = yaml.safe_load((EXAMPLES / "real-node" / "cpu-node.yaml").read_text())
    assert values["servingEngineSpec"]["containerSecurityContext"]["readOnlyRootFilesystem"] is True
    deployment = _engine(tmp_path, values)
    assert _tmp_mounts(deployment) == ["tmp"]
    env = {e["name"]: e.get("value") for e in container(deployment)["env"]}
    assert env["XDG_CACHE_HOME"] == "/tmp/.cache" and env["XDG_CONFIG_HOME"] == "/tmp/.config"
    assert container(deployment)["securityContext"]["readOnlyRootFilesystem"] is True


def test_writable_root_is_rendered_as_before(tmp_path):
    values = yaml.safe_load((EXAMPLES / "local-default.yaml").read_text())
    deployment = _engine(tmp_path, values)
    assert _tmp_mounts(deployment) == []
    assert "XDG_CACHE_HOME" not in {e["name"] for e in container(deployment)["env"]}


def test_a_model_that_mounts_its_own_tmp_keeps_it(tmp_path):
    values = yaml.safe_load((EXAMPLES / "real-node" / "cpu-node.yaml").read_text())
    model = values["servingEngineSpec"]["modelSpec"][0]
    model["extraVolumes"] = [{"name": "scratch", "emptyDir": {"sizeLimit": "1Gi"}}]
    model["extraVolumeMounts"] = [{"name": "scratch", "mountPath": "/tmp"}]
    deployment = _engine(tmp_path, values)
    assert _tmp_mounts(deployment) == ["scratch"]
