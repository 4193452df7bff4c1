"""docs/architecture.md's table of layers is the import rule tests/router/test_import_direction.py checks:
the same parts on the same layers, no part missing and none extra, so the page cannot drift from the test."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layers_of_the_test() -> dict[str, float]:
    spec = importlib.util.spec_from_file_location(
        "import_direction", ROOT / "tests" / "router" / "test_import_direction.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.LAYERS)


def _layers_of_the_page() -> dict[str, float]:
    """Rows ``| layer | `part`, `part` | ...`` of the page's layer table."""
    found: dict[str, float] = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        match = re.match(r"^\|\s*(\d+(?:\.\d+)?)\s*\|([^|]*)\|", line)
        if match:
            for part in re.findall(r"`([a-z_]+)`", match.group(2)):
                found[part] = float(match.group(1))
    return found


def test_the_page_lists_the_layers_the_import_test_checks() -> None:
    assert _layers_of_the_page() == {part: float(layer) for part, layer in _layers_of_the_test().items()}
