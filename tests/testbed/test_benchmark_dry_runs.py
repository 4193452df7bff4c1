"""The benchmarks that cannot run their real variant here (GPU engines, LMCache's CUDA path) still run
their dry run in CI: the workload is built and every command line printed, so the script that a GPU
machine would run is at least known to start and to ask for what it should."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.tutorials.runner import ROOT

PD = ROOT / "benchmarks" / "disagg" / "pd.py"


def dry_run(*args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(PD), "--dry-run", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_the_cpu_dry_run_prints_every_contender() -> None:
    out = dry_run()
    for name in ("ours-whole:", "ours-pd:", "rust-pd:", "rust-whole:"):
        assert name in out
    assert "--static-roles prefill,decode" in out and "--vllm-pd-disaggregation" in out
    assert "ExampleConnector" in out


@pytest.mark.parametrize(
    ("connector", "expected"),
    [("lmcache", "LMCacheConnectorV1"), ("nixl", "NixlConnector")],
)
def test_the_gpu_variant_dry_run_asks_for_its_connector(connector: str, expected: str) -> None:
    out = dry_run("--connector", connector, "--model", "meta-llama/Llama-3.1-8B-Instruct")
    assert expected in out and "meta-llama/Llama-3.1-8B-Instruct" in out
    if connector == "lmcache":
        assert "--disagg-protocol lmcache" in out
