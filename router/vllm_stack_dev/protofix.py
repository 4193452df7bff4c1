"""Undo xds-protos' overwrite of OpenTelemetry's and Google's generated protobuf modules.

`xds-protos` (the gRPC team's build of Envoy's API, which the endpoint picker's ext_proc server and the
router's gateway mode use) ships its own copies of `opentelemetry/proto/**` (opentelemetry-proto v0.9,
from before `InstrumentationLibrary` became `InstrumentationScope`) and of `google/api`, `google/rpc`, ...
in the same import paths as `opentelemetry-proto` and `googleapis-common-protos`. Whichever package the
installer writes last wins; when xds-protos wins, the OTLP exporter fails to import
(`cannot import name 'InstrumentationScope'`), so tracing breaks. Known upstream: grpc/grpc#42428 and
#42429 (the fix drops those copies from xds-protos); 1.85.0, the newest served here, still has them.

Envoy's ext_proc messages import none of the overwritten modules, so reinstalling the two owners at their
installed versions, without dependencies, restores both sides. `make install` and the router image run
this after installing the project; it does nothing when the modules are already the owners'.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

#: distribution -> (module, name the owner's version defines and xds-protos' copy lacks)
OWNERS = {
    "opentelemetry-proto": ("opentelemetry.proto.common.v1.common_pb2", "InstrumentationScope"),
    "googleapis-common-protos": ("google.rpc.status_pb2", "Status"),
}


def _broken(module: str, name: str) -> bool:
    try:
        return not hasattr(importlib.import_module(module), name)
    except ImportError:
        return True


def _reinstall(pins: list[str]) -> None:
    uv = shutil.which("uv", path=str(Path(sys.executable).parent))
    if uv:
        command = [uv, "pip", "install", "--quiet", "--python", sys.executable, "--reinstall", "--no-deps"]
    else:
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps"]
    subprocess.run([*command, *pins], check=True)


def repair() -> list[str]:
    """Reinstall each owner whose module is not its own any more; the pins reinstalled (none: all fine)."""
    pins: list[str] = []
    for distribution, (module, name) in OWNERS.items():
        try:
            installed = version(distribution)
        except PackageNotFoundError:
            continue
        if _broken(module, name):
            pins.append(f"{distribution}=={installed}")
    if pins:
        _reinstall(pins)
        # Checked in a fresh interpreter: this one has the overwritten descriptors registered already.
        for distribution in pins:
            module, name = OWNERS[distribution.split("==")[0]]
            check = f"import {module} as m; assert hasattr(m, {name!r})"
            if subprocess.run([sys.executable, "-c", check], capture_output=True).returncode != 0:
                raise SystemExit(f"{distribution}: {module}.{name} still missing after reinstalling")
    return pins


def main() -> int:
    pins = repair()
    if pins:
        print(f"restored {', '.join(pins)} (overwritten by xds-protos)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
