"""A real Prometheus scraping a release's Pods on the test cluster, the Pods as the API server lists them.

In a cluster the Prometheus operator turns the chart's ServiceMonitors into scrape jobs over the Services'
endpoints. Here Services have no endpoints (Pod IPs are loopback addresses, which EndpointSlices refuse),
and Debian's Prometheus is built without Kubernetes service discovery (its config refuses
`kubernetes_sd_configs`), so the test bed writes the targets for Prometheus' file discovery from the Pods
it lists (vllm_stack_dev.cluster.pod_processes, on every reconcile): each Running engine and router Pod at
its IP and `http` container port, with the labels the ServiceMonitors give (`namespace`, `pod`), so the
chart's KEDA queries and recording rules read the same series as in a cluster. Prometheus re-reads the
file when it changes, as Pods come and go with scaling.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterable
from pathlib import Path

from vllm_stack_dev.up.prometheus import ENGINE_JOB, ROUTER_JOB, launch_prometheus

#: The chart's component label value -> the scrape job (vllm_stack_dev.up.prometheus names them alike).
JOBS = {"serving-engine": ENGINE_JOB, "router": ROUTER_JOB}
COMPONENT = "app.kubernetes.io/component"


def pod_targets(pods: Iterable[dict]) -> dict[str, list[dict]]:
    """File-discovery entries per job for the Running engine and router Pods among ``pods``."""
    found: dict[str, list[dict]] = {job: [] for job in JOBS.values()}
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        job = JOBS.get((meta.get("labels") or {}).get(COMPONENT, ""))
        if job is None or status.get("phase") != "Running" or not status.get("podIP"):
            continue
        ports = [p for c in pod["spec"]["containers"] for p in c.get("ports", []) if p.get("name") == "http"]
        if ports:
            found[job].append({"targets": [f"{status['podIP']}:{ports[0]['containerPort']}"],
                               "labels": {"namespace": meta["namespace"], "pod": meta["name"]}})  # fmt: skip
    return found


class PodTargets:
    """The file-discovery files of one Prometheus, rewritten (atomically) from each list of Pods."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._written: dict[str, list[dict]] | None = None
        self.update([])

    def file(self, job: str) -> Path:
        return self.folder / f"{job}.json"

    def update(self, pods: Iterable[dict]) -> None:
        targets = pod_targets(pods)
        if targets == self._written:
            return
        for job, entries in targets.items():
            partial = self.file(job).with_suffix(".tmp")
            partial.write_text(json.dumps(entries))
            os.replace(partial, self.file(job))  # Prometheus never reads half a file
        self._written = targets


def start_cluster_prometheus(targets: PodTargets, folder: Path, port: int) -> subprocess.Popen[bytes]:
    """Prometheus on loopback ``port`` scraping what ``targets`` lists every 2 s; returns once ready.

    2 s, not less: an engine's /metrics can take over a second on two busy cores, and a timed-out scrape
    drops the target's series (the queue KEDA scales on) until the next one."""
    jobs = [{"job_name": job, "file_sd_configs": [{"files": [str(targets.file(job))], "refresh_interval": "1s"}]}
            for job in JOBS.values()]  # fmt: skip
    configuration = {
        "global": {"scrape_interval": "2s", "scrape_timeout": "2s", "evaluation_interval": "1s"},
        "scrape_configs": jobs,
    }
    return launch_prometheus(configuration, folder, port)
