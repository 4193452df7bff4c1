"""Real Kubernetes control-plane components built from their published Go modules, for tests.

No prebuilt binary can be downloaded here, but the Go module proxy serves the sources of etcd, Kubernetes
and kwok, so the tests run the real etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok
built from them. Nothing built is committed: each tool is built into the git-ignored
`.tools/go/<name>-<version>/bin/`, with a stamp written last that records exactly how it was built, so
an interrupted build is redone and a finished one is never rebuilt (the check is a file read and a few
`stat`s, no `go` invocation). The user's Go module cache and build cache (GOPATH, GOMODCACHE, GOCACHE)
are used as they are, so rebuilding after `.tools` is removed takes seconds of linking, not a compile.

Why a wrapper module per tool: `go install MODULE/cmd/x@VERSION` refuses any module whose go.mod has
replace directives, and both k8s.io/kubernetes (every staging module, `k8s.io/api`, `k8s.io/client-go`...,
replaced by a path under `./staging`) and etcd's server module (its sibling modules replaced by `../api`,
...) have them. The wrapper (`.tools/go/src/<name>-<version>/go.mod`) requires the tool's module and
rewrites its replace block from the tool's own downloaded go.mod, never by hand:
- a replace that points at a published version (KEDA's block) is copied as it is;
- a replace that points at a local path is dropped, so the requirement's published version is used
  (etcd requires its siblings at the same published version);
- with `staging_version` set (k8s.io/kubernetes), each requirement listed at v0.0.0 and replaced by a local
  path is replaced by that published version instead (`k8s.io/api => k8s.io/api v0.37.2`).
The wrapper also takes the tool's `go` and `godebug` lines, so the binaries keep the GODEBUG defaults
upstream built them with.

Later tools (the Gateway API Inference Extension EPP `sigs.k8s.io/gateway-api-inference-extension/cmd/epp`,
an OpenTelemetry collector) are one more `GoTool` each, as KEDA's operator and metrics adapter are (`KEDA`),
and join `CLUSTER_TOOLS` when the tests need them.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vllm_stack_dev.paths import tools_dir

# Bumped when the way tools are built changes, so every stamp written before is redone.
RECIPE_VERSION = "1"
STAMP_NAME = ".vllm-stack-stamp"
TAIL_LINES = 25


class GoBuildError(RuntimeError):
    """A `go` command failed; the message names the command and shows the last lines of its output."""


@dataclass(frozen=True)
class GoTool:
    """One tool built from a published Go module.

    binaries: (name of the installed binary, Go package of its `main`) pairs, all built by one
    `go build` so that packages shared between them are compiled once.
    staging_version: see the module docstring (k8s.io/kubernetes' staging modules); empty for none.
    ldflags: linker flags; `{version}` (v1.37.2), `{major}` (1), `{minor}` (37) and `{time}` (the
    module's publication time from the proxy, ISO 8601, used as a reproducible build date) are filled in.
    assets: (directory in the module, directory under the tool folder) pairs of files (`*.yaml` by
    default, minus `kustomization.yaml`) copied from the module cache at build time.
    version_args: run after the build; the version without its `v` must appear in the output.
    version_args_of: the same for the binaries whose arguments differ (kubectl's `version --client`).
    toolchain: GOTOOLCHAIN for the build; "local" (the machine's Go), or `go1.27.3` for a tool whose go.mod
    needs a newer Go than the machine has.
    """

    name: str
    module: str
    version: str
    binaries: tuple[tuple[str, str], ...]
    staging_version: str = ""
    ldflags: tuple[str, ...] = ()
    assets: tuple[tuple[str, str], ...] = ()
    asset_glob: str = "*.yaml"
    version_args: tuple[str, ...] = ("--version",)
    version_args_of: tuple[tuple[str, tuple[str, ...]], ...] = ()
    toolchain: str = "local"
    cgo: bool = False
    extra_env: tuple[tuple[str, str], ...] = ()

    @property
    def folder(self) -> Path:
        return tools_dir() / "go" / f"{self.name}-{self.version}"

    @property
    def bin_dir(self) -> Path:
        return self.folder / "bin"

    @property
    def wrapper_dir(self) -> Path:
        return tools_dir() / "go" / "src" / f"{self.name}-{self.version}"

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    def recipe(self) -> str:
        """What the stamp records: every field that changes what is built, so any change rebuilds."""
        fields = {
            "recipe": RECIPE_VERSION,
            "module": self.module,
            "version": self.version,
            "binaries": self.binaries,
            "staging_version": self.staging_version,
            "ldflags": self.ldflags,
            "assets": self.assets,
            "asset_glob": self.asset_glob,
            "toolchain": self.toolchain,
            "cgo": self.cgo,
            "extra_env": self.extra_env,
        }
        return json.dumps(fields, indent=1) + "\n"


def _kube_version_ldflags() -> tuple[str, ...]:
    """The `-X` flags Kubernetes' hack/lib/version.sh passes, so `/version` is not `v0.0.0-master`.

    Both packages carry the variables (client-go's for clients, component-base's for the servers). The
    proxy does not give the release's git commit, so gitCommit is left empty rather than made up.
    """
    values = {
        "gitVersion": "{version}",
        "gitMajor": "{major}",
        "gitMinor": "{minor}",
        "gitCommit": "",
        "gitTreeState": "clean",
        "buildDate": "{time}",
    }
    return tuple(
        f"-X {package}.{key}={value}"
        for package in ("k8s.io/client-go/pkg/version", "k8s.io/component-base/version")
        for key, value in values.items()
    )


KUBERNETES_VERSION = "v1.37.2"
# The newest k8s.io/kubernetes the proxy serves whose go.mod (`go 1.26.0`) builds with the machine's
# Go 1.26.8, and whose 31 staging modules are all served at v0.37.2.
KUBERNETES = GoTool(
    name="kubernetes",
    module="k8s.io/kubernetes",
    version=KUBERNETES_VERSION,
    binaries=tuple(
        (name, f"k8s.io/kubernetes/cmd/{name}")
        for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
    ),
    staging_version="v0" + KUBERNETES_VERSION[2:],
    version_args_of=(("kubectl", ("version", "--client")),),
    # As `make release` builds them: stripped, paths trimmed.
    ldflags=("-s", "-w", *_kube_version_ldflags()),
)
# The `etcd` main lives in the server module from 3.6 on (`server/main.go`); the newest 3.6 served.
# Kubernetes 1.37 is tested against etcd 3.6; Debian's etcd-server is 3.4.
ETCD = GoTool(
    name="etcd",
    module="go.etcd.io/etcd/server/v3",
    version="v3.6.17",
    binaries=(("etcd", "go.etcd.io/etcd/server/v3"),),
    ldflags=("-s", "-w"),
)
# kwok simulates kubelets: Nodes and Pods go through the stages in its stage files. Its go.mod has no
# replaces; the wrapper is only for uniformity. The stage files are copied beside the binary.
KWOK_STAGE_SETS = ("node/fast", "node/heartbeat", "node/heartbeat-with-lease", "pod/fast", "pod/general")
KWOK = GoTool(
    name="kwok",
    module="sigs.k8s.io/kwok",
    version="v0.8.0",
    binaries=(("kwok", "sigs.k8s.io/kwok/cmd/kwok"),),
    ldflags=("-s", "-w"),
    assets=tuple(
        (f"kustomize/stage/{stage_set}", "stages/" + stage_set.replace("/", "-"))
        for stage_set in KWOK_STAGE_SETS
    ),
)
CONTROL_PLANE = (ETCD, KUBERNETES, KWOK)
# KEDA's operator (reads ScaledObjects, owns their HPAs) and metrics adapter (serves the external metrics API
# the HPA controller asks). v2.21.0 is the newest the proxy serves whose go.mod (`go 1.26.0`) builds with
# the machine's Go (v2.21.1 wants 1.27.4). Its replace block points at published versions and is copied.
# The binaries have no --version flag; both log `KEDA Version: ...` at start, from these variables.
KEDA = GoTool(
    name="keda",
    module="github.com/kedacore/keda/v2",
    version="v2.21.0",
    binaries=(
        ("keda", "github.com/kedacore/keda/v2/cmd/operator"),
        ("keda-adapter", "github.com/kedacore/keda/v2/cmd/adapter"),
    ),
    ldflags=("-s", "-w", "-X github.com/kedacore/keda/v2/version.Version={version}"),
    version_args=(),
    assets=(("config/crd/bases", "crds"),),  # ScaledObject, ScaledJob, TriggerAuthentication, ...
)
CLUSTER_TOOLS = (*CONTROL_PLANE, KEDA)


def _tail(text: str) -> str:
    return "\n".join(text.splitlines()[-TAIL_LINES:])


def _go_env(tool: GoTool) -> dict[str, str]:
    """The build environment: the user's caches and proxy, everything that changes the result pinned.

    GOFLAGS is set, not appended to: `-mod=mod` lets `go build` complete the wrapper's go.mod and go.sum
    (a user's `-mod=vendor` would break it), and `-buildvcs=false` because the wrapper lives inside this
    git checkout, whose revision would otherwise be stamped into the binaries (or fail without git).
    GOWORK=off so that a go.work above the checkout is not picked up.
    """
    env = dict(os.environ)
    env.update(
        GOFLAGS="-mod=mod -buildvcs=false",
        GOTOOLCHAIN=tool.toolchain,
        GOWORK="off",
        CGO_ENABLED="1" if tool.cgo else "0",
    )
    env.update(dict(tool.extra_env))
    return env


def _go(args: list[str], tool: GoTool, cwd: Path) -> str:
    command = ["go", *args]
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=_go_env(tool), cwd=cwd)
    except FileNotFoundError as error:
        raise GoBuildError(f"`go` not found ({error}); Go 1.26 is needed to build {tool.name}") from error
    if result.returncode != 0:
        raise GoBuildError(
            f"`{' '.join(command)}` (in {cwd}) failed ({result.returncode}):\n{_tail(result.stdout + result.stderr)}"
        )
    return result.stdout


def _wrapper_go_mod(tool: GoTool, upstream: dict) -> str:
    """The wrapper's go.mod, from the tool's own go.mod as `go mod edit -json` parses it."""
    required_at_zero = {req["Path"] for req in upstream.get("Require") or [] if req["Version"] == "v0.0.0"}
    replaces: list[str] = []
    for replace in upstream.get("Replace") or []:
        old, new = replace["Old"], replace["New"]
        old_spec = old["Path"] + (f" {old['Version']}" if old.get("Version") else "")
        if new.get("Version"):
            replaces.append(f"{old_spec} => {new['Path']} {new['Version']}")
        elif tool.staging_version and old["Path"] in required_at_zero:
            replaces.append(f"{old['Path']} => {old['Path']} {tool.staging_version}")
    lines = [f"// Generated by vllm_stack_dev.gotools to build {tool.module}@{tool.version}; not edited.",
             "module vllmstack.local/gotools/" + tool.name, ""]  # fmt: skip
    if upstream.get("Go"):
        lines += [f"go {upstream['Go']}", ""]
    godebugs = [f"godebug {entry['Key']}={entry['Value']}" for entry in upstream.get("GoDebug") or []]
    if godebugs:
        lines += [*godebugs, ""]
    lines += [f"require {tool.module} {tool.version}", ""]
    if replaces:
        lines += ["replace (", *[f"\t{line}" for line in replaces], ")", ""]
    return "\n".join(lines)


def _default_binary_name(package: str) -> str:
    """The name `go build -o DIR/` gives a main package: its last element, major-version suffix skipped."""
    parts = package.split("/")
    last = parts[-1]
    if len(parts) > 1 and last.startswith("v") and last[1:].isdigit():
        last = parts[-2]
    return last


def _fill(template: str, tool: GoTool, published: str) -> str:
    major, _, rest = tool.version.lstrip("v").partition(".")
    minor = rest.partition(".")[0]
    return template.format(version=tool.version, major=major, minor=minor, time=published)


def _copy_assets(tool: GoTool, module_dir: Path) -> None:
    for source, target in tool.assets:
        source_dir = module_dir / source
        files = [f for f in sorted(source_dir.glob(tool.asset_glob)) if f.name != "kustomization.yaml"]
        if not files:
            raise GoBuildError(f"{tool.module}@{tool.version} has no {tool.asset_glob} in {source}")
        target_dir = tool.folder / target
        target_dir.mkdir(parents=True, exist_ok=True)
        for file in files:
            # Module cache files are read-only; the copies need not be.
            (target_dir / file.name).write_bytes(file.read_bytes())


def _check_version(tool: GoTool, name: str) -> None:
    args = dict(tool.version_args_of).get(name, tool.version_args)
    if not args:
        return
    command = [str(tool.binary(name)), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    if result.returncode != 0 or tool.version.lstrip("v") not in output:
        raise GoBuildError(
            f"`{' '.join(command)}` does not report {tool.version} ({result.returncode}):\n{_tail(output)}"
        )


def build_tool(tool: GoTool) -> None:
    """Build `tool` into its folder and write its stamp last (removed first, so a crash leaves none)."""
    stamp = tool.folder / STAMP_NAME
    stamp.unlink(missing_ok=True)
    tool.wrapper_dir.mkdir(parents=True, exist_ok=True)
    download = json.loads(
        _go(["mod", "download", "-json", f"{tool.module}@{tool.version}"], tool, tool.wrapper_dir)
    )
    upstream = json.loads(_go(["mod", "edit", "-json", download["GoMod"]], tool, tool.wrapper_dir))
    published = json.loads(Path(download["Info"]).read_text()).get("Time", "")
    go_mod = tool.wrapper_dir / "go.mod"
    content = _wrapper_go_mod(tool, upstream)
    if not go_mod.exists() or go_mod.read_text() != content:
        go_mod.write_text(content)
    ldflags = " ".join(_fill(flag, tool, published) for flag in tool.ldflags)
    if tool.bin_dir.exists():
        shutil.rmtree(tool.bin_dir)
    tool.bin_dir.mkdir(parents=True)
    packages = [package for _, package in tool.binaries]
    _go(
        ["build", "-trimpath", "-ldflags", ldflags, "-o", str(tool.bin_dir) + "/", *packages],
        tool,
        tool.wrapper_dir,
    )
    for name, package in tool.binaries:
        built = tool.bin_dir / _default_binary_name(package)
        if built.name != name:
            built.rename(tool.binary(name))
    _copy_assets(tool, Path(download["Dir"]))
    for name, _ in tool.binaries:
        _check_version(tool, name)
    stamp.write_text(tool.recipe())


def is_installed(tool: GoTool) -> bool:
    """True when the stamp records this exact recipe and every binary is there (no `go` run)."""
    stamp = tool.folder / STAMP_NAME
    try:
        if stamp.read_text() != tool.recipe():
            return False
    except OSError:
        return False
    return all(tool.binary(name).is_file() for name, _ in tool.binaries)


def install_tools(tools: Iterable[GoTool]) -> str:
    """Build every tool that is not installed, one after another (each `go build` uses every core).

    When something must be built, a lock file serialises concurrent installs (`make install` and a test
    session at once would otherwise build into the same folders); the stamps are checked again under it.
    A tool that fails to build does not stop the others: each is tried, then GoBuildError names every
    failure with its output, so the tools that did build are there for the tests that need only them.
    """
    missing = [tool for tool in tools if not is_installed(tool)]
    if not missing:
        return "up to date"
    built: list[str] = []
    failed: list[str] = []
    lock_path = tools_dir() / "go" / ".build-lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for tool in missing:
            if is_installed(tool):
                continue
            start = time.monotonic()
            try:
                build_tool(tool)
            except GoBuildError as error:
                failed.append(f"{tool.name} {tool.version}: {error}")
                continue
            built.append(f"{tool.name} {tool.version} ({time.monotonic() - start:.0f} s)")
    if failed:
        done = f" (built: {', '.join(built)})" if built else ""
        raise GoBuildError(f"{len(failed)} tool(s) failed to build{done}:\n" + "\n".join(failed))
    return "built " + ", ".join(built) if built else "up to date"


def install_control_plane() -> str:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok; "up to date" or "built ..."."""
    return install_tools(CONTROL_PLANE)


def install_cluster_tools() -> str:
    """The control plane and KEDA: everything the `cluster` tests run (`make install` builds these)."""
    return install_tools(CLUSTER_TOOLS)


def control_plane_binaries() -> dict[str, Path]:
    """Paths of the control-plane binaries by name (they exist once install_control_plane() returned)."""
    return {name: tool.binary(name) for tool in CONTROL_PLANE for name, _ in tool.binaries}


def kwok_stages_dir() -> Path:
    """Folder of kwok's stage files, one subfolder per stage set (`node-fast`, `pod-fast`, ...).

    kwok takes each file with `--config`; `node-fast/node-initialize.yaml` makes Nodes Ready,
    `pod-fast/*.yaml` takes Pods to Running (and Job pods to Succeeded) and finishes deletions.
    """
    return KWOK.folder / "stages"


def main(argv: list[str] | None = None) -> int:
    """`python -m vllm_stack_dev.gotools`: install the cluster tools, print the outcome."""
    try:
        print(install_cluster_tools())
    except GoBuildError as error:
        print(error, file=sys.stderr)
        return 1
    for name, path in control_plane_binaries().items():
        print(f"{name}: {path}")
    print(f"kwok stages: {kwok_stages_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
