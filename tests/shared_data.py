"""Test data kept outside the repository, in ``../shared``: production-stack's chart and values files
(read in place, never copied in) and the upstream CRD schemas.

A test that needs it fails when it is missing, with the path and the reason; it never skips, so a
checkout without ``../shared`` cannot lose that coverage without a word. :func:`require` is the one
check; the folders are named here once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
PS_VALUES = SHARED / "production-stack-values"  # production-stack's values files, one folder
PS_CHART = SHARED / "production-stack-chart" / "helm"  # production-stack's own chart, same commit
CRDS = SHARED / "crds"  # upstream CustomResourceDefinitions the chart's objects are checked against


def require(path: Path) -> Path:
    """``path`` (a file or folder under ``../shared``), or the test fails: that data is part of the
    suite, kept beside the repository; without it the tests that read it cannot say anything."""
    if not path.exists():
        pytest.fail(
            f"{path} missing: test data kept outside the repository in {SHARED} "
            "(production-stack's chart and values files, the upstream CRDs); check it out there",
            pytrace=False,
        )
    return path
