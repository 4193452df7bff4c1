"""Helm and kubectl started from the cluster tier's worker threads exec with an environment of their own.

The cluster tier runs its cases on a thread pool while pytest's main thread sets and removes
PYTEST_CURRENT_TEST for every test. A child started without ``env`` execs with the C library's
``environ``, which that ``setenv`` may be moving: the exec fails with EFAULT (CI: `OSError: [Errno 14]
Bad address` for Helm). This test makes the same race on purpose, for a bounded time, with the test
bed's Helm runner.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm_stack_dev.cluster.releases import Helm
from vllm_stack_dev.paths import helm_binary

#: Long enough for thousands of environment changes around each of ~100 execs (4 threads).
RACE_SECONDS = 4.0


def test_helm_from_threads_survives_environment_changes_in_the_main_thread(tmp_path: Path) -> None:
    if not helm_binary(4).is_file():
        pytest.fail("helm 4 missing: run `make install`", pytrace=False)
    helm = Helm(SimpleNamespace(kubeconfig=tmp_path / "kubeconfig"), 4)  # type: ignore[arg-type]
    deadline = time.monotonic() + RACE_SECONDS
    errors: list[BaseException] = []
    runs = [0]

    def exec_helm() -> None:
        while time.monotonic() < deadline:
            try:
                helm.run("version", "--short")
                runs[0] += 1
            except BaseException as error:  # noqa: BLE001 - every failure is the finding
                errors.append(error)

    threads = [threading.Thread(target=exec_helm) for _ in range(4)]
    for thread in threads:
        thread.start()
    changes = 0
    while time.monotonic() < deadline:  # what pytest does for every test, and more often
        os.environ["VLLM_STACK_TEST_RACE"] = "x" * (changes % 200)
        os.environ.pop("VLLM_STACK_TEST_RACE")
        changes += 1
    for thread in threads:
        thread.join()
    assert runs[0] > 0
    assert not errors, f"{len(errors)} of {len(errors) + runs[0]} Helm runs failed: {errors[:3]}"
