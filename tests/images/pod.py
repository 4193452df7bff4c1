"""A rendered Pod template run with podman as a kubelet would run it: the container's image, entrypoint
and args, its user and group, a read-only root file system with only the chart's mounts writable,
capabilities dropped, no privilege escalation.

What a kubelet does that this does not: probes, resource limits (podman would need cgroup settings of its
own here), projected ServiceAccount tokens, Pod networking (the container shares the host's loopback).
Volumes: `emptyDir` becomes a tmpfs of its `sizeLimit` (mode 0777, as an emptyDir), `configMap` a
read-only bind mount of the rendered ConfigMap's files, `persistentVolumeClaim` a bind mount of the host
folder the test gives for that claim (read-only where the volume or the mount says so); `secretKeyRef`
environment variables take the values the test gives. Any other kind fails the test rather than being
skipped silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from vllm_stack_dev.images import image_id, podman, run_limits

QUANTITY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "k": 10**3, "M": 10**6, "G": 10**9}


def require_podman() -> None:
    """Skip where no container can run (podman or runc absent); `make install` installs both as root."""
    missing = [tool for tool in ("podman", "runc") if not shutil.which(tool)]
    if missing:
        pytest.skip(
            f"{', '.join(missing)} not installed: containers cannot run here (`make install` as root installs them)"
        )


def require_image(reference: str) -> None:
    require_podman()
    if image_id(reference) is None:
        pytest.fail(f"image {reference} missing: run `make install` (vllm_stack_dev.images builds it)")


def set_flag(args: list[str], name: str, value: str) -> list[str]:
    """`args` with the value after `name` replaced (as a test adapts a rendered argument list)."""
    out = list(args)
    out[out.index(name) + 1] = value
    return out


def drop_flag(args: list[str], name: str) -> list[str]:
    i = args.index(name)
    return args[:i] + args[i + 2 :]


def _bytes(quantity: str) -> int:
    for suffix, factor in QUANTITY.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * factor)
    return int(quantity)


def podman_run_args(
    pod_spec: dict,
    container: dict,
    config_maps: dict[str, dict],
    workdir: Path,
    fields: dict[str, str] | None = None,
    claims: dict[str, Path] | None = None,
    secrets: dict[str, dict[str, str]] | None = None,
) -> list[str]:
    """`podman run` options for one container of a Pod spec (the image and args come after them).

    fields: the values of `fieldRef` environment variables (`status.podIP`: the test's loopback).
    claims: claim name -> the host folder that backs it. secrets: Secret name -> its data (plain text)."""
    pod_sc = pod_spec.get("securityContext") or {}
    sc = container.get("securityContext") or {}
    user = sc.get("runAsUser", pod_sc.get("runAsUser"))
    group = sc.get("runAsGroup", pod_sc.get("runAsGroup"))
    args = ["--network", "host", "--no-healthcheck", *run_limits()]
    if user is not None:
        args += ["--user", f"{user}:{group}" if group is not None else str(user)]
    if pod_sc.get("fsGroup") is not None:
        args += ["--group-add", str(pod_sc["fsGroup"])]
    if sc.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]  # podman would add /tmp, /run, /var/tmp
    caps = sc.get("capabilities") or {}
    args += [f"--cap-drop={cap}" for cap in caps.get("drop", [])]
    args += [f"--cap-add={cap}" for cap in caps.get("add", [])]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    for env in container.get("env", []):
        field = ((env.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        secret = (env.get("valueFrom") or {}).get("secretKeyRef") or {}
        if "value" in env:
            args += ["--env", f"{env['name']}={env['value']}"]
        elif field in (fields or {}):
            args += ["--env", f"{env['name']}={(fields or {})[field]}"]
        elif secret.get("key") in (secrets or {}).get(secret.get("name"), {}):
            args += ["--env", f"{env['name']}={(secrets or {})[secret['name']][secret['key']]}"]
        else:
            pytest.fail(f"env {env['name']} comes from {env.get('valueFrom')}: not supported here")
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        target = mount["mountPath"]
        if "emptyDir" in volume:
            size = (volume["emptyDir"] or {}).get("sizeLimit")
            spec = f"type=tmpfs,destination={target},tmpfs-mode=0777"
            args += ["--mount", spec + (f",tmpfs-size={_bytes(size)}" if size else "")]
        elif "configMap" in volume:
            data = config_maps[volume["configMap"]["name"]].get("data") or {}
            folder = workdir / f"volume-{mount['name']}"
            folder.mkdir(mode=0o755)
            for key, text in data.items():
                (folder / key).write_text(text)
                (folder / key).chmod(0o644)
            args += ["--volume", f"{folder}:{target}:ro"]
        elif (claim := volume.get("persistentVolumeClaim") or {}).get("claimName") in (claims or {}):
            folder = (claims or {})[claim["claimName"]]
            read_only = mount.get("readOnly") or claim.get("readOnly")
            args += ["--volume", f"{folder}:{target}" + (":ro" if read_only else "")]
        else:
            pytest.fail(f"volume {mount['name']} ({sorted(volume)}) is not supported by tests/images/pod.py")
    return args


async def _podman(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = await asyncio.to_thread(subprocess.run, [*podman(), *args], capture_output=True, text=True)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")
    return result


@contextlib.asynccontextmanager
async def running(
    pod_spec: dict,
    container: dict,
    config_maps: dict[str, dict],
    workdir: Path,
    args: list[str],
    *,
    command: list[str] | None = None,
    extra: tuple[str, ...] = (),
    fields: dict[str, str] | None = None,
    claims: dict[str, Path] | None = None,
    secrets: dict[str, dict[str, str]] | None = None,
) -> AsyncIterator[str]:
    """The container started detached with `args` (the rendered ones, as the test adapted them; with
    `command`, the rendered command, as the test adapted it, replaces the image's entrypoint, as
    Kubernetes' `command` does); yields its ID; removed (by ID) on exit, its log printed first so that a
    failing test shows it. `extra`: more `podman run` options (a test's own volume); `fields`, `claims`,
    `secrets`: as for podman_run_args."""
    if container.get("command") and command is None:
        pytest.fail("the chart sets a command: pass it (adapted) as `command`")
    options = podman_run_args(pod_spec, container, config_maps, workdir, fields, claims, secrets)
    if command:
        options += ["--entrypoint", json.dumps(command)]
    started = await _podman("run", "--detach", *options, *extra, container["image"], *args)
    cid = started.stdout.strip().splitlines()[-1]
    try:
        yield cid
    finally:
        logs = await _podman("logs", cid, check=False)
        print(f"--- container {cid[:12]} log ---\n{logs.stdout[-4000:]}{logs.stderr[-4000:]}")
        await _podman("rm", "--force", "--time", "2", cid, check=False)


async def exec_in(cid: str, *command: str) -> subprocess.CompletedProcess[str]:
    return await _podman("exec", cid, *command, check=False)


async def is_running(cid: str) -> bool:
    state = await _podman("inspect", "--format", "{{.State.Running}}", cid, check=False)
    return state.stdout.strip() == "true"


async def log_of(cid: str) -> str:
    """The container's output so far (stdout and stderr)."""
    logs = await _podman("logs", cid, check=False)
    return logs.stdout + logs.stderr


async def exit_code(cid: str) -> int:
    """The exit status of a container that has stopped."""
    state = await _podman("inspect", "--format", "{{.State.ExitCode}}", cid)
    return int(state.stdout.strip())
