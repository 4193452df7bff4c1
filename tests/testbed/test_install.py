"""`make install` is idempotent and cached: run again, it takes seconds and changes nothing."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from vllm_stack_dev.paths import engine_python, helm_binary, repo_root


def _snapshot(paths: list[Path]) -> dict[str, int]:
    return {str(path): path.stat().st_mtime_ns for path in paths if path.exists()}


def test_second_install_is_fast_and_changes_nothing() -> None:
    root = repo_root()
    watched = [
        root / ".venv" / ".vllm-stack-stamp",
        root / ".venv-engine" / ".vllm-stack-stamp",
        engine_python().resolve(),
        helm_binary(3),
        helm_binary(4),
        root / ".tools" / "node" / ".vllm-stack-stamp",
        root / ".tools" / "checkov-venv" / ".vllm-stack-stamp",
        root / ".cache" / "wheels" / ".vllm-stack-stamp",
    ]
    subprocess.run(
        ["make", "-s", "install"], cwd=root, check=True, capture_output=True
    )  # whatever was missing
    before = _snapshot(watched)
    started = time.monotonic()
    result = subprocess.run(["make", "-s", "install"], cwd=root, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert elapsed < 10, f"second make install took {elapsed:.1f} s"
    assert _snapshot(watched) == before
    assert len(before) == len(watched), "make install must create every stamp and tool it checks"
    assert result.stderr.count("up to date") == 6, result.stderr
