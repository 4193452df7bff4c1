"""``vllm-stack check -f values.yaml``: what the chart would do differently from what the values ask.

The chart computes its deviations once (``vllm-stack.deviations`` in helm/templates/_compat.tpl): NOTES.txt
lists them, and ``strict: true`` turns them into a failed render. This command renders the release as
``helm install --dry-run=client`` does (no cluster needed) and prints that list, so that whoever renders
with ``helm template`` (Argo CD, Flux) sees what only NOTES would have said; ``--strict`` renders with
``strict=true``, so the verdict is the chart's own.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from vllm_stack_dev.up.render import NAMESPACE, RELEASE, RenderError, render_release


def check(
    values: Sequence[Path],
    sets: Sequence[str] = (),
    *,
    strict: bool = False,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    out: TextIO = sys.stdout,
) -> int:
    """Print the deviations; 0 when the values render (under ``strict``: without any), else 1."""
    try:
        rendered = render_release(
            values, [*sets, *(["strict=true"] if strict else [])], release=release, namespace=namespace
        )
    except RenderError as error:
        print(f"error: {error}", file=out)
        return 1
    if not rendered.deviations:
        print("No deviations: the chart renders what the values ask.", file=out)
        return 0
    print(f"{len(rendered.deviations)} deviation(s) (what NOTES lists; strict: true refuses each):", file=out)
    for line in rendered.deviations:
        print(f"  {line}", file=out)
    return 0
