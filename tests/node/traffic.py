"""Steady traffic through the router Service while a test changes the release, and its count by step.

:class:`Traffic` starts tests/node/traffic_client.py inside the node's network namespace (with this
interpreter: the repository's .venv, whose httpx the client uses), where a Service's ClusterIP is reached
through kube-proxy's rules as on a real node (given a route first: :func:`route_services`). With
``resolv_conf`` the client runs in a mount namespace of its own whose ``/etc/resolv.conf`` is a Pod's
(CoreDNS at 10.96.0.10, the namespace's search domains), so that the Service's *name* is resolved by
CoreDNS at each new connection, as in a Pod.

A test marks its steps (:meth:`Traffic.step`: "steady", "upgrade", "after", ...); each request counts in
the step during which it started. A failed request is anything but a complete 200 answer (the client's
docstring says what complete means). The client's records are one JSON line each, kept in the test's
folder (``traffic.jsonl``) with its log, for a failure's post-mortem.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_stack_dev.cluster.control_plane import SERVICE_CIDR
from vllm_stack_dev.cluster.node import CLUSTER_DNS_IP, CLUSTER_DOMAIN, RealNode
from vllm_stack_dev.testbed.engines import spawn_logged, stop_group

CLIENT = Path(__file__).with_name("traffic_client.py")


def route_services(node: RealNode) -> None:
    """A route for the Services' range in the node's network namespace, on the interface holding the node's
    address: a real node's default route covers ClusterIPs, so that its own processes (and hostNetwork Pods)
    reach them through kube-proxy's OUTPUT rules; the test bed's node has no default route (nothing may
    leave it), and without this a process there gets "Network is unreachable" before kube-proxy's rules
    are consulted. Idempotent; the route goes with the namespace."""
    for line in node.run_in_node(["ip", "-o", "-4", "addr", "show"], timeout=30).splitlines():
        fields = line.split()
        if f"{node.ip}/" in line:
            node.run_in_node(["ip", "route", "replace", SERVICE_CIDR, "dev", fields[1]], timeout=30)
            return
    raise AssertionError(f"no interface holds the node's address {node.ip} in {node.name}'s namespace")


def pod_resolv_conf(namespace: str) -> str:
    """What the kubelet writes into a Pod of ``namespace`` (dnsPolicy ClusterFirst)."""
    search = f"{namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"
    return f"search {search}\nnameserver {CLUSTER_DNS_IP}\noptions ndots:5\n"


@dataclass(frozen=True)
class Request:
    """One request as the client saw it (times from ``time.time()``)."""

    n: int
    worker: int
    kind: str  # "plain" or "stream"
    connection: str  # "pooled" (a keep-alive pool's) or "fresh" (a new connection for this request)
    start: float
    first_byte: float | None
    end: float
    status: int | None
    ok: bool
    chunks: int
    done: bool
    error: str | None
    engine: str | None

    def describe(self) -> str:
        first = f"{self.first_byte - self.start:.2f}" if self.first_byte else "-"
        return (f"#{self.n} {self.kind} ({self.connection} connection) at {self.start:.2f} for {self.end - self.start:.2f}s (first byte {first}s), "
                f"status {self.status}, {self.chunks} chunks, engine {self.engine}: {self.error}")  # fmt: skip


@dataclass
class StepCount:
    name: str
    start: float
    end: float
    requests: list[Request] = field(default_factory=list)

    @property
    def failures(self) -> list[Request]:
        return [r for r in self.requests if not r.ok]

    @property
    def streamed(self) -> int:
        return sum(1 for r in self.requests if r.kind == "stream")

    def row(self) -> str:
        """A Markdown table row: step, requests (streamed), failures, seconds."""
        return (f"| {self.name} | {len(self.requests)} ({self.streamed} streamed) | {len(self.failures)} | "
                f"{self.end - self.start:.1f} |")  # fmt: skip


@dataclass
class TrafficReport:
    steps: list[StepCount]
    requests: list[Request]
    summary: dict[str, Any]

    @property
    def failures(self) -> list[Request]:
        return [r for r in self.requests if not r.ok]

    def step(self, name: str) -> StepCount:
        return next(s for s in self.steps if s.name == name)

    def table(self) -> str:
        head = "| step | requests | failures | seconds |\n|---|---|---|---|\n"
        return head + "\n".join(s.row() for s in self.steps)

    def explain(self, limit: int = 20) -> str:
        """The table and the failed requests (the first ``limit``), for an assertion's message."""
        failed = self.failures
        lines = [self.table(), f"{len(failed)} failed of {len(self.requests)}:"]
        lines += [r.describe() for r in failed[:limit]]
        return "\n".join(lines)


class Traffic:
    """The client process in the node (a context manager: it is stopped, by PID if need be, on exit)."""

    def __init__(
        self,
        node: RealNode,
        workdir: Path,
        url: str,
        model: str,
        *,
        concurrency: int = 4,
        fresh: int = 0,
        stream_tokens: int = 20,
        plain_tokens: int = 5,
        resolv_conf: str | None = None,
        request_timeout: float = 60.0,
    ) -> None:
        self.node = node
        self.workdir = workdir
        self.out = workdir / "traffic.jsonl"
        self.stop_file = workdir / "traffic.stop"
        self.log = workdir / "traffic.log"
        self.url = url
        self.args = ["--url", url, "--model", model, "--out", str(self.out), "--stop-file", str(self.stop_file),
                     "--concurrency", str(concurrency), "--fresh", str(fresh),
                     "--stream-tokens", str(stream_tokens), "--plain-tokens", str(plain_tokens),
                     "--request-timeout", str(request_timeout)]  # fmt: skip
        self.resolv_conf = resolv_conf
        self.request_timeout = request_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self.marks: list[tuple[str, float]] = []

    def __enter__(self) -> Traffic:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        if kind is not None:  # the test failed: what is in flight no longer matters
            stop_group(self.process, timeout=5)
        else:
            self.stop_file.touch()
            try:
                self.process.wait(timeout=self.request_timeout + 10)
            except subprocess.TimeoutExpired:
                stop_group(self.process, timeout=5)

    def _command(self) -> list[str]:
        client = [sys.executable, str(CLIENT), *self.args]
        if self.resolv_conf is None:
            return self.node.in_node(client)
        resolv = self.workdir / "resolv.conf"
        resolv.write_text(self.resolv_conf)
        # A mount namespace of the client's own (a child of the node's, private): only it sees the Pod's file.
        script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
        return self.node.in_node(["unshare", "--mount", "--propagation", "private", "--",
                                  "sh", "-c", script, str(resolv), *client])  # fmt: skip

    def start(self, step: str = "steady", first: int = 6, timeout: float = 90.0) -> None:
        """Start the client and wait for its first ``first`` complete answers (the route works end to end);
        the requests from now on count in ``step``."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.out.unlink(missing_ok=True)
        self.stop_file.unlink(missing_ok=True)
        route_services(self.node)
        self.marks = [(step, time.time())]
        self.process = spawn_logged(self._command(), self.log, env=None, cwd=self.workdir)
        self.wait_for(first, timeout, f"the traffic client's first {first} complete answers from {self.url}")

    def step(self, name: str) -> None:
        """Requests that start from now on count in step ``name``."""
        self.marks.append((name, time.time()))

    def records(self) -> list[Request]:
        if not self.out.exists():
            return []
        found = []
        for line in self.out.read_text().splitlines():
            if not line.endswith("}"):
                continue  # a line being written
            doc = json.loads(line)
            if "summary" not in doc:
                found.append(Request(**doc))
        return found

    def wait_for(self, complete: int, timeout: float, what: str, since: float | None = None) -> None:
        """Until ``complete`` requests started after ``since`` (default: the current step's start) have
        ended complete; fails naming ``what`` when the client exits or time runs out."""
        since = self.marks[-1][1] if since is None else since
        deadline = time.monotonic() + timeout
        while True:
            records = [r for r in self.records() if r.start >= since]
            if sum(1 for r in records if r.ok) >= complete:
                return
            assert self.process is not None
            if self.process.poll() is not None or time.monotonic() > deadline:
                failed = [r.describe() for r in records if not r.ok][:10]
                state = "exited" if self.process.poll() is not None else f"not within {timeout:.0f}s"
                raise AssertionError(f"{what}: {state}; {len(records)} ended, failed: {failed}; log "
                                     f"{self.log}:\n{self.log.read_text()[-2000:]}")  # fmt: skip
            time.sleep(0.2)

    def stop(self, timeout: float | None = None) -> TrafficReport:
        """No new request; the ones under way finish; then every request counted by step."""
        assert self.process is not None, "start() first"
        stopped = time.time()
        self.stop_file.touch()
        wait = self.request_timeout + 30 if timeout is None else timeout
        try:
            self.process.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            stop_group(self.process, timeout=5)
            raise AssertionError(f"the traffic client did not finish its requests within {wait:.0f}s "
                                 f"of the stop (log {self.log})") from None  # fmt: skip
        if self.process.returncode != 0:
            raise AssertionError(f"the traffic client exited {self.process.returncode}: "
                                 f"{self.log.read_text()[-2000:]}")  # fmt: skip
        lines = [json.loads(line) for line in self.out.read_text().splitlines() if line.strip()]
        summary = next((doc["summary"] for doc in lines if "summary" in doc), {})
        requests = sorted((Request(**doc) for doc in lines if "summary" not in doc), key=lambda r: r.start)
        bounds = [*self.marks, ("", stopped)]
        steps = [
            StepCount(name, start, end) for (name, start), (_, end) in zip(bounds, bounds[1:], strict=False)
        ]
        for request in requests:
            owner = next((s for s in reversed(steps) if request.start >= s.start), steps[0])
            owner.requests.append(request)
        return TrafficReport(steps, requests, summary)
