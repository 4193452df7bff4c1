"""Real processes standing in for the containers of a release's Pods on the test cluster.

kwok reports Pods Running and Ready and gives each a loopback IP, but runs nothing (no kubelet or container
runtime can run here). For the tests that need a Pod to answer (the router discovering engines through the
API server, KEDA scaling a Deployment and the router serving from the new Pod), this module starts what the
Pod's main container would run, at the Pod's IP and the container's own ports, from the Pod object the API
server holds (vllm_stack_dev.up.plan says what changes, as for `vllm-stack up`):
- an engine Pod: a real vLLM engine (the CPU build, the tiny model in place of the weights);
- the router Pod: this project's router with its rendered arguments, Kubernetes discovery included, and the
  credentials the caller gives it (a kubeconfig with the ServiceAccount's token: the Pod's own identity);
  an endpoint picker Pod (the chart's ``inferenceExtension.epp``) the same way: the router's image and
  entry point, its own arguments (``--ext-proc-port``, ``--inference-pool``).

What a Pod's container reads is taken as its kubelet would: the Secrets and ConfigMaps its environment
names (``secretKeyRef``, ``configMapKeyRef``) are read from the API server when the process starts (a Secret
the user created there, such as the router's batch database URL), else taken from the release's rendering;
a variable whose Secret neither holds stays unset, as with ``vllm-stack up``. A PersistentVolumeClaim is one
local folder per claim (``<workdir>/claims/<claim>``), whichever Pod mounts it: the router replicas on the
chart's ReadWriteMany batch claim share their ``--batch-dir``, as they share the volume in a cluster.

A Pod's process starts once the Pod is Running with an IP, and stops when the Pod is gone, unless the
caller keeps it (a terminating container serves on through its grace period; a test can then check that
nothing reaches it). No Service is involved: a test that addresses one maps it to Pod IPs itself
(vllm_stack_dev.cluster.services).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_stack_dev.cluster.control_plane import Cluster, ClusterError, tool_env
from vllm_stack_dev.paths import repo_root
from vllm_stack_dev.testbed.engines import (
    Engine,
    EngineSpec,
    dtype_override,
    launch,
    log_tail,
    port_for_later,
    spawn_logged,
    stop_group,
)
from vllm_stack_dev.up.plan import Planner, Process

COMPONENT = "app.kubernetes.io/component"
ENGINE_COMPONENT = "serving-engine"
ROUTER_COMPONENT = "router"
EPP_COMPONENT = "endpoint-picker"  # the chart's endpoint picker: the router's image and entry point


@dataclass
class RouterProcess:
    """A router standing in for a router Pod's container."""

    pod: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def _running_ip(pod: dict) -> str | None:
    """The Pod's IP when it is Running and not being deleted, else None."""
    status = pod.get("status") or {}
    if pod["metadata"].get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    return status.get("podIP") or None


class PodProcesses:
    """Engines (and a router) for the Pods of one namespace; :meth:`sync` reconciles once, :meth:`follow`
    keeps reconciling in a thread. Stop everything with :meth:`stop` (or use it as a context manager)."""

    def __init__(
        self,
        cluster: Cluster,
        namespace: str,
        objects: Sequence[dict],
        *,
        model_dir: Path,
        workdir: Path,
        log_dir: Path,
        cores: Sequence[int] = (),
        router_env: dict[str, str] | None = None,
        keep_deleted: bool = False,
        on_pods: Callable[[list[dict]], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.log_dir = log_dir
        self.router_env = dict(router_env or {})
        self.keep_deleted = keep_deleted
        self.on_pods = on_pods  # told every list of the namespace's Pods (e.g. Prometheus' targets)
        self._planner = Planner(
            [o for o in objects if o.get("kind") in ("ConfigMap", "Secret")],
            workdir=workdir, model_dir=model_dir, router_port=port_for_later(), free_port=port_for_later,
            cores=list(cores) or sorted(os.sched_getaffinity(0)), max_engines=64, namespace=namespace,
            dtype_override=dtype_override(), claims_dir=workdir / "claims",
        )  # fmt: skip
        self._model_dir = model_dir
        self.engines: dict[str, Engine] = {}  # by Pod name
        self.routers: dict[str, RouterProcess] = {}
        self.gone: dict[str, float] = {}  # Pod name -> when this test bed saw it gone (kept processes)
        self.failed: dict[str, str] = {}  # Pod name -> why its process could not be started
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._errors: list[str] = []

    def __enter__(self) -> PodProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- reconcile -------------------------------------------------------------------------------------
    def pods(self) -> list[dict]:
        return self.cluster.get("pods", "-n", self.namespace)["items"]  # type: ignore[return-value]

    def sync(self) -> None:
        """Start a process for each Running Pod that has none; stop (or keep) those whose Pod is gone.
        ClusterError when the Pods cannot be listed (nothing changed then). A Pod whose process fails to
        start is recorded (:meth:`check` raises it) and not tried again; the other Pods go on."""
        pods = self.pods()
        if self.on_pods is not None:
            self.on_pods(pods)
        present = set()
        with self._lock:
            if self._stop.is_set():
                return  # stop() has run or is running: start nothing it would not stop
            for pod in pods:
                name, ip = pod["metadata"]["name"], _running_ip(pod)
                component = (pod["metadata"].get("labels") or {}).get(COMPONENT)
                if ip is None:
                    continue
                present.add(name)
                if name in self.engines or name in self.routers or name in self.failed:
                    continue
                try:
                    if component == ENGINE_COMPONENT:
                        self.engines[name] = self._start_engine(pod, ip)
                    elif component in (ROUTER_COMPONENT, EPP_COMPONENT):
                        self.routers[name] = self._start_router(pod, ip)
                except Exception as error:  # noqa: BLE001 - recorded; the test fails on it via check()
                    self.failed[name] = f"{type(error).__name__}: {error}"
            for name in [
                n for n in (*self.engines, *self.routers) if n not in present and n not in self.gone
            ]:
                if self.keep_deleted:
                    self.gone[name] = time.time()
                    continue
                if name in self.engines:
                    self.engines.pop(name).stop()
                else:
                    stop_group(self.routers.pop(name).process)

    def _learn_references(self, pod: dict) -> None:
        """The Secrets and ConfigMaps the Pod's main container's environment names, as the API server holds
        them now, told to the planner (those it lacks are left to the rendering's, or unset)."""
        wanted: set[tuple[str, str]] = set()
        for entry in pod["spec"]["containers"][0].get("env") or ():
            source = entry.get("valueFrom") or {}
            for key, kind in (("secretKeyRef", "secret"), ("configMapKeyRef", "configmap")):
                if key in source:
                    wanted.add((kind, source[key]["name"]))
        found = []
        for kind, name in sorted(wanted):
            out = self.cluster.kubectl(
                "get", kind, name, "-n", self.namespace, "--ignore-not-found", "-o", "json"
            ).stdout
            if out.strip():
                found.append(json.loads(out))
        self._planner.learn(found)

    def _start_engine(self, pod: dict, ip: str) -> Engine:
        self._learn_references(pod)
        planned: Process = self._planner.plan_pod_engine(pod, ip)
        _write_files(planned)
        spec = EngineSpec(model_dir=self._model_dir, served_model_name=planned.model or "", args=planned.argv,
                          env=planned.env)  # fmt: skip
        return launch(
            spec, name=planned.name, cpu=planned.cpu, log_dir=self.log_dir, port=planned.port, host=ip
        )

    def _start_router(self, pod: dict, ip: str) -> RouterProcess:
        self._learn_references(pod)
        planned = self._planner.plan_pod_router(pod, ip)
        _write_files(planned)
        log = self.log_dir / f"{planned.name}.log"
        command = [sys.executable, "-m", "vllm_stack.cli", "router", *planned.argv]
        env = {**tool_env(), **planned.env, **self.router_env}
        process = spawn_logged(command, log, env, cwd=repo_root())
        return RouterProcess(planned.name, f"http://{ip}:{planned.port}", process, log)

    @contextlib.contextmanager
    def follow(self, interval: float = 0.5) -> Iterator[PodProcesses]:
        """Reconcile every ``interval`` seconds in a thread for the ``with`` block (a failure to start a
        process is raised at the block's end, and :meth:`check` raises it earlier)."""
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.sync()
                except ClusterError:
                    continue  # the API server is away (a test restarts it): the next round lists again
                except Exception as error:  # noqa: BLE001 - reported by check() in the test's thread
                    if len(self._errors) < 10:  # the same failure, round after round, is said once enough
                        self._errors.append(f"{type(error).__name__}: {error}")

        self.sync()
        thread = threading.Thread(target=loop, name="pod-processes", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(timeout=30)
        self.check()

    def check(self) -> None:
        """Raise what went wrong: a process that could not be started, an error of the follower thread, or
        a process that exited while its Pod still exists (a container that died; a test waiting on what that
        process would serve would otherwise wait for its whole timeout and say nothing of why)."""
        with self._lock:
            problems = [f"{pod}: {why}" for pod, why in self.failed.items()] + self._errors[:3]
            processes = [
                (pod, e.process, e.log_path) for pod, e in self.engines.items() if pod not in self.gone
            ]
            processes += [(pod, r.process, r.log) for pod, r in self.routers.items() if pod not in self.gone]
        for pod, process, log in processes:
            if process.poll() is not None:
                problems.append(
                    f"{pod}: its process exited with code {process.returncode}; log {log}:\n{log_tail(log, 30)}"
                )
        if problems:
            raise RuntimeError("pod processes: " + "; ".join(problems))

    # ---- state ---------------------------------------------------------------------------------------
    def engine_of(self, pod: str) -> Engine:
        with self._lock:
            return self.engines[pod]

    def live_engines(self) -> dict[str, Engine]:
        """The engines whose Pods still exist."""
        with self._lock:
            return {name: e for name, e in self.engines.items() if name not in self.gone}

    def gone_pods(self) -> dict[str, float]:
        """The Pods seen gone whose processes are kept, with when they were seen gone."""
        with self._lock:
            return dict(self.gone)

    def stop_gone(self) -> None:
        """Stop the processes kept for Pods that are gone."""
        with self._lock:
            for name in list(self.gone):
                if name in self.engines:
                    self.engines.pop(name).stop()
                elif name in self.routers:
                    stop_group(self.routers.pop(name).process)
                del self.gone[name]

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            for router in self.routers.values():
                stop_group(router.process)
            for engine in self.engines.values():
                engine.stop()
            self.routers.clear()
            self.engines.clear()
            self.gone.clear()
            self.failed.clear()


def _write_files(process: Process) -> None:
    for folder in process.folders:
        folder.mkdir(parents=True, exist_ok=True)
    for path, text in process.files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
