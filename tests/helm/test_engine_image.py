"""The engine image recipe (engine-image/engine.Dockerfile) keeps its promises: vLLM and LMCache pinned to the
versions the chart's defaults name, a non-root user, and the commands the chart renders (`vllm` for the engines,
`lmcache_server` for the cache server) present on PATH. Its base (vLLM's CUDA image) cannot be pulled here,
so the Dockerfile is checked as text (the CPU engine image, engine-cpu.Dockerfile, is built and run by
tests/images/), the pins are resolved to the pinned distributions available here (LMCache's wheel in
.cache/wheels, vLLM 0.32's metadata in the engine environment: the CPU build of the same release), and the
rendered commands are looked up among those distributions' console scripts."""

from __future__ import annotations

import configparser
import re
import zipfile
from pathlib import Path

import pytest

from tests.helm.chart import (
    ROOT,
    cache_server_name,
    container,
    dockerfile_instructions,
    engine_name,
    one,
    render,
    values_file,
)

pytestmark = pytest.mark.helm

DOCKERFILE = ROOT / "engine-image" / "engine.Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE)


def _args() -> dict[str, str]:
    return dict(rest.split("=", 1) for word, rest in _instructions() if word == "ARG" and "=" in rest)


def _expand(text: str) -> str:
    args = _args()
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], text)


def _rendered(tmp_path: Path) -> list[dict]:
    values = {
        "servingEngineSpec": {
            "modelSpec": [
                {"name": "plain", "modelURL": "org/plain"},
                {
                    "name": "lm",
                    "modelURL": "org/lm",
                    "requestMemory": "16Gi",
                    "lmcacheConfig": {"enabled": True},
                },
            ]
        },
        "cacheserverSpec": {"enabled": True},
    }
    return render([values_file(tmp_path, values)])


def test_pins_are_the_chart_defaults(tmp_path):
    objs = _rendered(tmp_path)
    plain = container(one(objs, "Deployment", engine_name("plain", "Deployment")))["image"]
    lm = container(one(objs, "Deployment", engine_name("lm", "Deployment")))["image"]
    froms = [_expand(rest) for word, rest in _instructions() if word == "FROM"]
    assert froms == [plain] == ["vllm/vllm-openai:v" + _args()["VLLM_VERSION"]]
    assert lm.endswith(":v" + _args()["LMCACHE_VERSION"])  # the chart's LMCache image names the same release
    runs = " ".join(rest for word, rest in _instructions() if word == "RUN")
    assert '"vllm==${VLLM_VERSION}"' in runs and '"lmcache==${LMCACHE_VERSION}"' in runs


def test_runs_as_non_root():
    users = [rest for word, rest in _instructions() if word == "USER"]
    assert users and not re.match(r"^(0|root)\b", users[-1])


def _console_scripts(entry_points: str) -> set[str]:
    parser = configparser.ConfigParser()
    parser.read_string(entry_points)
    return set(parser["console_scripts"]) if parser.has_section("console_scripts") else set()


def _lmcache_scripts(version: str) -> set[str]:
    wheels = sorted((ROOT / ".cache" / "wheels").glob(f"lmcache-{version}-*.whl"))
    if not wheels:
        pytest.skip(f"LMCache {version} wheel missing in .cache/wheels: run `make install`")
    with zipfile.ZipFile(wheels[0]) as whl:
        return _console_scripts(whl.read(f"lmcache-{version}.dist-info/entry_points.txt").decode())


def _vllm_scripts(version: str) -> set[str]:
    found = sorted((ROOT / ".venv-engine").glob(f"lib/python3*/site-packages/vllm*-{version}.dist-info"))
    if not found:
        pytest.skip(f"vLLM {version} missing in .venv-engine: run `make install`")
    return _console_scripts((found[0] / "entry_points.txt").read_text())


def test_the_commands_the_chart_renders_come_with_the_pinned_wheels(tmp_path):
    objs = _rendered(tmp_path)
    engine_cmd = container(one(objs, "Deployment", engine_name("plain", "Deployment")))["command"][0]
    cache_cmd = container(one(objs, "Deployment", cache_server_name()))["command"][0]
    assert (engine_cmd, cache_cmd) == ("vllm", "lmcache_server")
    assert engine_cmd in _vllm_scripts(_args()["VLLM_VERSION"])
    assert cache_cmd in _lmcache_scripts(_args()["LMCACHE_VERSION"])
    runs = " ".join(rest for word, rest in _instructions() if word == "RUN")
    for cmd in (engine_cmd, cache_cmd):
        assert f"command -v {cmd}" in runs, cmd  # the build fails when it is not on PATH
    assert ("ENTRYPOINT", '["vllm", "serve"]') in _instructions()
