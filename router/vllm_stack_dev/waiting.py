"""Waiting for a started process to serve: an HTTP endpoint answering 200, or a TCP port accepting."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable


def tcp_open(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a TCP connect to ``host:port`` succeeds (what the kubelet's tcpSocket probe does)."""
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def wait_until(
    ready: Callable[[], bool], timeout: float, process: subprocess.Popen[bytes], what: str
) -> None:
    """Until ``ready()``; RuntimeError naming ``what`` when ``process`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not ready():
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:.0f} s")
        time.sleep(0.3)


def wait_http_ok(url: str, timeout: float, process: subprocess.Popen[bytes]) -> None:
    """Until ``url`` answers 200; RuntimeError when ``process`` exits first or ``timeout`` passes."""

    def answers() -> bool:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        return False

    name = process.args[0] if isinstance(process.args, list) else "process"
    wait_until(answers, timeout, process, f"{name} at {url}")
