"""The chart's rendering of values files, by the real Helm (the chart's schema and checks).

``render`` is ``helm template`` (the objects); ``render_release`` is ``helm install --dry-run=client``,
which also renders NOTES.txt, where the chart lists its deviations (``vllm-stack.deviations``: every key it
honours differently, substitutes or ignores). Both need no cluster.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from vllm_stack_dev.paths import helm_binary, repo_root

RELEASE = "vllm-stack"
NAMESPACE = "default"
#: NOTES.txt's heading above the deviation lines (helm/templates/NOTES.txt)
DEVIATIONS_HEADER = (
    "Deviations: what this chart did differently from what the values ask (strict: true refuses each):"
)


class RenderError(RuntimeError):
    """Helm refused the values; the message is Helm's own (the chart's schema and ``fail`` messages)."""


@dataclass(frozen=True)
class Release:
    """What ``helm install`` would create: the objects (hooks included), NOTES, and the deviations in it."""

    objects: list[dict]
    notes: str
    deviations: list[str]


def chart_dir() -> Path:
    return repo_root() / "helm"


def _helm(args: list[str], values: Sequence[Path], sets: Sequence[str], helm: Path | None) -> str:
    binary = helm or helm_binary(4)
    if not binary.exists():
        raise RenderError(f"{binary} missing: run `make install`")
    command = [str(binary), *args]
    for path in values:
        command += ["-f", str(path)]
    for item in sets:
        command += ["--set", item]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RenderError(result.stderr.strip() or f"helm {args[0]} exited with {result.returncode}")
    return result.stdout


def render(
    values: Sequence[Path],
    sets: Sequence[str] = (),
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    helm: Path | None = None,
) -> list[dict]:
    """Every object ``helm template`` renders for ``values`` (in order), or RenderError with Helm's words."""
    text = _helm(["template", release, str(chart_dir()), "--namespace", namespace], values, sets, helm)
    return [obj for obj in yaml.safe_load_all(text) if obj]


def deviations_in(notes: str) -> list[str]:
    """The deviation lines of a rendered NOTES.txt (indented below its heading), without the indent."""
    lines = notes.splitlines()
    if DEVIATIONS_HEADER not in lines:
        return []
    out = []
    for line in lines[lines.index(DEVIATIONS_HEADER) + 1 :]:
        if not line.startswith("  "):
            break
        out.append(line.strip())
    return out


def render_release(
    values: Sequence[Path],
    sets: Sequence[str] = (),
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    helm: Path | None = None,
) -> Release:
    """``helm install --dry-run=client``: the objects, NOTES.txt and its deviations, or RenderError."""
    text = _helm(
        ["install", release, str(chart_dir()), "--dry-run=client", "--namespace", namespace],
        values,
        sets,
        helm,
    )
    manifest, _, notes = text.partition("\nNOTES:\n")
    manifest = manifest.split("\nMANIFEST:\n", 1)[-1].replace("\nHOOKS:\n", "\n---\n")
    hooks = text.split("\nHOOKS:\n", 1)[1].split("\nMANIFEST:\n", 1)[0] if "\nHOOKS:\n" in text else ""
    objects = [obj for obj in yaml.safe_load_all(manifest) if isinstance(obj, dict)]
    objects += [obj for obj in yaml.safe_load_all(hooks) if isinstance(obj, dict)]
    return Release(objects, notes, deviations_in(notes))
