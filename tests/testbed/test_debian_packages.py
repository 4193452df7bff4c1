"""``make install``'s Debian packages: the set-up steps that install them run concurrently, and apt-get
fails when another apt-get holds its lock, so they must run one at a time. A stand-in ``apt-get`` on PATH
(the real one would change the machine) records when each run starts and ends; the steps' calls from
several threads must not overlap. Before the shared lock, a fresh machine's ``make install`` failed with
"Could not get lock /var/lib/apt/lists/lock": the images step held a second copy of devsetup's lock and the
node step none."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from vllm_stack_dev import debian

FAKE_APT = """#!/bin/sh
echo "start $$ $*" >> "{log}"
sleep 0.2
echo "end $$" >> "{log}"
"""


def test_apt_get_runs_one_at_a_time_across_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "apt.log"
    fake = tmp_path / "bin" / "apt-get"
    fake.parent.mkdir()
    fake.write_text(FAKE_APT.format(log=log))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    monkeypatch.setattr(debian, "cache_dir", lambda: tmp_path / "cache")
    threads = [
        threading.Thread(target=debian.install_packages, args=([package], RuntimeError))
        for package in ("prometheus", "containerd", "podman")
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    lines = log.read_text().splitlines()
    assert len(lines) == 12, lines  # update and install for each: a start and an end each
    for start, end in zip(lines[::2], lines[1::2], strict=True):  # every run ends before the next starts
        assert start.startswith("start ") and end == f"end {start.split()[1]}", lines
    installs = [line for line in lines if " install " in line]
    assert all("DPkg::Lock::Timeout=600" in line for line in lines if line.startswith("start")), lines
    assert sorted(line.split()[-1] for line in installs) == ["containerd", "podman", "prometheus"]


def test_a_failing_apt_get_raises_the_callers_error_with_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin" / "apt-get"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'E: Unable to locate package nosuch' >&2\nexit 100\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    monkeypatch.setattr(debian, "cache_dir", lambda: tmp_path / "cache")

    class StepFailed(Exception):
        pass

    with pytest.raises(StepFailed, match="Unable to locate package nosuch"):
        debian.install_packages(["nosuch"], StepFailed)
