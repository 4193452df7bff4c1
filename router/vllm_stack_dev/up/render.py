"""The chart's rendering of values files, by the real ``helm template`` (the chart's schema and checks)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import yaml

from vllm_stack_dev.paths import helm_binary, repo_root

RELEASE = "vllm-stack"
NAMESPACE = "default"


class RenderError(RuntimeError):
    """Helm refused the values; the message is Helm's own (the chart's schema and ``fail`` messages)."""


def chart_dir() -> Path:
    return repo_root() / "helm"


def render(
    values: Sequence[Path],
    sets: Sequence[str] = (),
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    helm: Path | None = None,
) -> list[dict]:
    """Every object ``helm template`` renders for ``values`` (in order), or RenderError with Helm's words."""
    binary = helm or helm_binary(4)
    if not binary.exists():
        raise RenderError(f"{binary} missing: run `make install`")
    command = [str(binary), "template", release, str(chart_dir()), "--namespace", namespace]
    for path in values:
        command += ["-f", str(path)]
    for item in sets:
        command += ["--set", item]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RenderError(result.stderr.strip() or f"helm template exited with {result.returncode}")
    return [obj for obj in yaml.safe_load_all(result.stdout) if obj]
