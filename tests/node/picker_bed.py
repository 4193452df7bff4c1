"""What tests/node/test_picker_upgrade.py installs and reads: the release (the chart's router as a gateway in
front of the chart's endpoint picker), the Pods' metrics and logs, reached from the node's network
namespace (Pod IPs exist only there), and one long stream sent through the gateway at a moment the test
chooses (:class:`LongStream`). The steady traffic and the stub engines are the node tier's own
(tests/node/traffic.py, tests/node/stub_engine.py).
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.node import RealNode
from vllm_stack_dev.cluster.releases import Helm, pod_ready
from vllm_stack_dev.paths import repo_root
from vllm_stack_dev.testbed.engines import spawn_logged, stop_group

from tests.cluster.serving import wait_for
from tests.node.stub_engine import MODEL

RELEASE = "gw"
NAMESPACE = "node-epp"
CHART = repo_root() / "helm"
PICKER = f"{RELEASE}-stub-epp"  # the model `stub`'s picker: Deployment and Service
PICKER_LABELS = "app.kubernetes.io/component=endpoint-picker,vllm-stack.io/model=stub"
GATEWAY_LABELS = "app.kubernetes.io/component=router"
CRDS = (
    "inference.networking.k8s.io_inferencepools.yaml",
    "inference.networking.x-k8s.io_inferenceobjectives.yaml",
)
# The node's CPU is the machine's (2 cores): at the chart's requests (500m a router or picker Pod) a roll's
# surge Pod would not be scheduled beside other tests' Pods.
SMALL = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "512Mi"}}
ROLLOUT_TIMEOUT = 180.0

# One streamed chat completion through the gateway, judged as the steady traffic's are (traffic_client's
# Worker); "sending" once it is about to go, its record as the last line.
_ONE_STREAM = """
import asyncio, json, sys
import httpx
sys.path.insert(0, sys.argv[1])
from tests.node.traffic_client import Worker, parse
args = parse(["--url", sys.argv[2], "--model", sys.argv[3], "--out", "-", "--stop-file", "-",
              "--stream-tokens", sys.argv[4], "--request-timeout", "120"])
async def main():
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as client:
        print("sending", flush=True)
        print(json.dumps(await Worker(args, client, 0, sys.stdout, "fresh").one(True)), flush=True)
asyncio.run(main())
"""


def values(replicas: int, roll: int) -> dict[str, Any]:
    """The release: ``roll`` is a picker pod annotation, changed to roll the picker's Deployment alone."""
    return {
        "servingEngineSpec": {"modelSpec": [{"name": "stub", "modelURL": MODEL, "replicaCount": 0}]},
        "routerSpec": {
            "routingLogic": "prefixaware",
            "extraArgs": ["--endpoint-picker", f"grpc://{PICKER}:9002"],  # the Service's short name
            "resources": SMALL,
        },
        "inferenceExtension": {
            "enabled": True,
            "epp": {
                "enabled": True,
                "replicaCount": replicas,
                "resources": SMALL,
                "podAnnotations": {"vllm-stack.dev/roll": str(roll)},
            },
        },
    }


class Release:
    """The release on the node and what the test reads of it: Pods, the gateway's and pickers' metrics."""

    def __init__(self, cluster: Cluster, node: RealNode, work: Path, replicas: int) -> None:
        self.cluster = cluster
        self.node = node
        self.work = work
        self.replicas = replicas  # of the picker
        self.helm = Helm(cluster, 4)

    def apply_values(self, roll: int, *, install: bool = False) -> None:
        path = self.work / f"values-{roll}.yaml"
        path.write_text(json.dumps(values(self.replicas, roll)))
        (self.helm.install if install else self.helm.upgrade)(RELEASE, CHART, NAMESPACE, path)

    def pods(self, labels: str = "") -> list[dict[str, Any]]:
        selector = ("-l", labels) if labels else ()
        return self.cluster.get("pods", "-n", NAMESPACE, *selector)["items"]  # type: ignore[return-value]

    def ready_pods(self, labels: str) -> dict[str, str]:
        """Name -> IP of the Pods that are Ready and not terminating."""
        return {
            p["metadata"]["name"]: p["status"]["podIP"]
            for p in self.pods(labels)
            if pod_ready(p) and p["metadata"].get("deletionTimestamp") is None
        }

    def get(self, ip: str, path: str) -> str:
        """GET ``http://ip:8000{path}`` from the node's network namespace ("" when it does not answer)."""
        code = (
            "import sys, urllib.request\n"
            "try:\n"
            f"    sys.stdout.write(urllib.request.urlopen('http://{ip}:8000{path}', timeout=5).read().decode())\n"
            "except OSError:\n"
            "    pass\n"
        )
        return self.node.run_in_node([sys.executable, "-c", code], timeout=30)

    def counters(self, ip: str, family: str) -> dict[str, float]:
        """``vllm_stack_router_<family>``'s samples by outcome, from the router or picker at ``ip``."""
        text = self.get(ip, "/metrics")
        found = re.findall(rf'^vllm_stack_router_{family}\{{outcome="(\w+)"\}} ([0-9.e+]+)$', text, re.M)
        return {outcome: float(value) for outcome, value in found}

    def knows_engines(self, ip: str, engines: int) -> bool:
        """The router or picker at ``ip`` has ``engines`` healthy engines (its /ready)."""
        text = self.get(ip, "/ready")
        return bool(text) and json.loads(text).get("healthy_engines") == engines

    def logs(self, labels: str = "", lines: int = 40) -> str:
        """The last lines of each Pod's container logs, read from the kubelet's pod log folder (the API
        server cannot reach the kubelet's own API here): what a failed wait shows."""
        out = []
        for pod in self.pods(labels):
            name = pod["metadata"]["name"]
            folder = self.node.workdir / "pod-logs" / f"{NAMESPACE}_{name}_{pod['metadata']['uid']}"
            for log in sorted(folder.glob("*/*.log")):
                out.append(f"--- {name} {log.parent.name}/{log.name}")
                out.extend(log.read_text(errors="replace").splitlines()[-lines:])
        return "\n".join(out)

    def wait_rolled(self, old: set[str]) -> tuple[set[str], float]:
        """Until the picker Deployment has rolled: all its replicas Ready, none of ``old``, and no Pod of
        ``old`` left at all (terminating ones included). Returns the new Pods' names and when the first old
        Pod was seen terminating (``time.time()``)."""
        terminating: list[float] = []

        def rolled() -> set[str] | None:
            pods = self.pods(PICKER_LABELS)
            if not terminating and any(p["metadata"].get("deletionTimestamp") for p in pods):
                terminating.append(time.time())
            names = {p["metadata"]["name"] for p in pods}
            ready = set(self.ready_pods(PICKER_LABELS))
            return ready if len(ready) == self.replicas and names == ready and not names & old else None

        what = f"the picker rolled to {self.replicas} new Pods (old: {sorted(old)})"
        new = wait_for(rolled, ROLLOUT_TIMEOUT, what, interval=0.5)
        return new, terminating[0] if terminating else time.time()


class LongStream:
    """One streamed request of ``tokens`` chunks through the gateway at ``url``, from the node's network
    namespace, started by :meth:`send` (which returns as it goes out) and judged by traffic_client's rules."""

    def __init__(self, node: RealNode, url: str, tokens: int, log: Path) -> None:
        tests_parent = Path(__file__).resolve().parents[2]  # where `tests.node.traffic_client` imports from
        self.command = node.in_node(
            [sys.executable, "-c", _ONE_STREAM, str(tests_parent), url, MODEL, str(tokens)]
        )
        self.log = log
        self.process: Any = None

    def send(self) -> None:
        self.process = spawn_logged(self.command, self.log, env=None)
        wait_for(lambda: "sending" in self.log.read_text() or self.process.poll() is not None, 30,
                 "the long stream's client to start", interval=0.1)  # fmt: skip

    def result(self, timeout: float = 150.0) -> dict[str, Any]:
        """Its record (traffic_client's fields: ok, start, end, chunks, error, ...)."""
        try:
            self.process.wait(timeout=timeout)
        finally:
            stop_group(self.process, timeout=5)
        return json.loads(self.log.read_text().splitlines()[-1])
