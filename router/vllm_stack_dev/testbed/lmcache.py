"""LMCache 0.5.6's own servers (``lmcache_server``, ``lmcache_controller``) as local processes.

LMCache cannot be pip-installed here (its CUDA extension does not build without a GPU), but its cache
server and controller are pure Python: their wheel and sortedcontainers (the one pure-Python import the
engine environment lacks) are unpacked from ``.cache/wheels/`` (``make install`` fills it) and run with
the engine environment's Python, which has torch, vLLM and pyzmq.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from vllm_stack_dev.paths import cache_dir, engine_python

HASH_SEED = "0"  # PYTHONHASHSEED of the controller and its workers: LMCache's chunk hashes use hash()
# Console scripts of the wheel -> the module whose main() they run.
ENTRY_POINTS = {
    "lmcache_server": "lmcache.v1.server.__main__",
    "lmcache_controller": "lmcache.v1.api_server.__main__",
}


def wheels_dir() -> Path:
    return cache_dir() / "wheels"


def unpack_lmcache(dest: Path) -> Path:
    """The LMCache 0.5.6 and sortedcontainers wheels unpacked under ``dest`` (a PYTHONPATH entry)."""
    wheels = sorted(wheels_dir().glob("lmcache-0.5.6-*.whl")) + sorted(
        wheels_dir().glob("sortedcontainers-*.whl")
    )
    if len(wheels) < 2 or not engine_python().exists():
        raise RuntimeError(
            "LMCache / sortedcontainers wheels (.cache/wheels) or the engine environment (.venv-engine)"
            " missing: run `make install`"
        )
    site = dest / "site"
    for wheel in wheels:
        zipfile.ZipFile(wheel).extractall(site)
    return site


def lmcache_env(site: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with the unpacked LMCache first on PYTHONPATH (no caller virtualenv leaking in)."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env |= {"PYTHONPATH": str(site), "PYTHONHASHSEED": HASH_SEED, "LMCACHE_TRACK_USAGE": "false"}
    return env | (extra or {})


def lmcache_command(program: str, args: list[str]) -> list[str]:
    """The command line that runs LMCache's console script ``program`` with ``args`` (``sys.argv[1:]``)."""
    module = ENTRY_POINTS[program]
    argv = [program, *args]
    script = f"import sys; sys.argv = {argv!r}; from {module} import main; main()"
    return [str(engine_python()), "-c", script]
