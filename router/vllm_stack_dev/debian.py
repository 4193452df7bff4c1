"""Debian packages the test tools need (prometheus, podman and its kin, containerd), installed with apt-get
one run at a time.

Why a module of its own: ``make install``'s set-up steps run concurrently (devsetup's thread pool), and two
apt-get runs at once fail on apt's lock ("Could not get lock /var/lib/apt/lists/lock"): a fresh machine's
``make install`` failed so, its images and node steps refused. A lock object kept in devsetup did not keep
them apart: ``python -m vllm_stack_dev.devsetup`` runs that module as ``__main__``, and the images step
imported a second copy of it with a lock of its own, while the node step took none. Here the lock is a
file lock (``flock`` on an open of its own per caller), which holds across threads and processes; apt's
own lock, held by an apt-get of the machine's (a fresh VM's daily update), is waited for
(``DPkg::Lock::Timeout``).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Sequence

from vllm_stack_dev.paths import cache_dir

#: Seconds apt-get waits for apt's own lock held by another program before it fails.
APT_LOCK_TIMEOUT_S = 600


def install_packages(packages: Sequence[str], error: type[Exception]) -> None:
    """``apt-get update`` then ``apt-get install`` of ``packages`` (root only), one caller at a time;
    ``error`` (the caller's exception type) raised with the failing command's output tail."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    wait = ["-o", f"DPkg::Lock::Timeout={APT_LOCK_TIMEOUT_S}"]
    lock = cache_dir() / "apt.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released as the file closes
        for command in (
            ["apt-get", *wait, "update", "-qq"],
            ["apt-get", *wait, "install", "-y", "-qq", "--no-install-recommends", *packages],
        ):
            result = subprocess.run(command, capture_output=True, text=True, env=env)
            if result.returncode != 0:
                tail = "\n".join((result.stdout + result.stderr).splitlines()[-25:])
                raise error(f"`{' '.join(command)}` failed ({result.returncode}):\n{tail}")
