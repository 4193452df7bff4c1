"""A real Prometheus (Debian package) scraping the local stack with the chart's rules.

Targets get the labels the chart's ServiceMonitors give them in a cluster (``namespace``, ``pod``,
``job``), so that the dashboards, the rules and the KEDA trigger query run unchanged. An engine's
``pod`` is its ``host:port``: that is what the router's ``engine`` label holds under static discovery,
as the pod name is under Kubernetes discovery.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from vllm_stack_dev.testbed.engines import spawn_logged

ENGINE_JOB = "vllm-stack-engine"
ROUTER_JOB = "vllm-stack-router"


@dataclass(frozen=True)
class Target:
    job: str
    address: str  # host:port
    labels: dict[str, str]


def prometheus_binary() -> str:
    found = shutil.which("prometheus") or "/usr/bin/prometheus"
    if not Path(found).exists():
        raise RuntimeError("prometheus missing: run `make install` (apt-get install -y prometheus)")
    return found


def prometheus_config(targets: list[Target], rule_files: list[Path], interval: str = "2s") -> dict:
    """Scrape every ``interval`` with a timeout of ``interval`` (an engine's /metrics can take over a
    second on two busy cores, and a failed scrape marks all of a target's series stale at once)."""
    jobs: dict[str, list[dict]] = {}
    for target in targets:
        jobs.setdefault(target.job, []).append({"targets": [target.address], "labels": target.labels})
    return {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{"job_name": job, "static_configs": configs} for job, configs in jobs.items()],
    }


def start_prometheus(
    targets: list[Target], rule_files: list[Path], folder: Path, port: int, timeout: float = 60.0
) -> subprocess.Popen[bytes]:
    """Start Prometheus on loopback ``port`` with its data in ``folder``; returns once it is ready."""
    return launch_prometheus(prometheus_config(targets, rule_files), folder, port, timeout)


def launch_prometheus(
    configuration: dict, folder: Path, port: int, timeout: float = 60.0
) -> subprocess.Popen[bytes]:
    """Start Prometheus with ``configuration`` on loopback ``port``, data in ``folder``; once ready."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump(configuration))
    process = spawn_logged(
        [
            prometheus_binary(),
            f"--config.file={config}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
        ],
        folder / "prometheus.log",
        env=None,
    )
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"prometheus did not start; log {folder / 'prometheus.log'}")
        time.sleep(0.2)
