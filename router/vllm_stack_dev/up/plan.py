"""From the chart's rendered objects to local command lines, with every change said.

The plan is pure: objects in, processes and substitutions out (the ports, cores and folders it uses are
passed in), so every values file can be planned in a unit test without starting anything. What it runs
is what the chart deploys: each engine Deployment's replicas, the router, the LMCache cache server and
controller, each with its rendered arguments and environment. What it changes is only what cannot
exist on this machine, and each change is a ``Substitution`` that ``vllm-stack up`` prints:

- the images: the engine runs from the local engine environment (the vLLM CPU build), the router and
  LMCache's servers from this checkout;
- GPUs, tensor/pipeline parallelism and resource requests: one CPU core per process (CPU pinning);
- model weights (nothing can be downloaded here): the tiny Llama the model builder makes, dummy
  weights, served under the rendered name; ``--max-model-len`` is capped at its 2048 positions;
- LMCache's vLLM connector (its CUDA extension does not load without a GPU): dropped, with the
  ``LMCACHE_*`` variables that configure it; the cache server and controller still run. On engines
  with a prefill or decode role it becomes vLLM's NixlConnector with a host buffer over loopback TCP
  (what runs on a CPU), and the router's LMCache PD protocol vLLM's ``kv_transfer_params``, so the
  two legs and the KV hand-over still happen;
- LoRA adapters (their weights fit only the real model): tiny random LoRAs for the tiny Llama, for
  the engines' ``--lora-modules`` and the router's adapter registry alike;
- cluster DNS (``svc[.ns[.svc[.cluster.local]]]:port``) and container ports: loopback and free ports;
- Kubernetes discovery: the router's static discovery of the engines it would have found;
- volumes: local folders (ConfigMaps and rendered Secrets written into them; the router's batch claim
  a folder its ``--batch-dir`` names), Secrets the chart does not render (created by the user in the
  cluster): env vars left unset (the batch database's: the router's SQLite then), mounted keys generated.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_stack_dev.testbed.engines import default_kv_cache_mib, kv_events_bind_host, nixl_loopback_env

COMPONENT = "app.kubernetes.io/component"
MODEL_LABEL = "vllm-stack.io/model"
ROLE_LABEL = "vllm-stack.io/role"
LOOPBACK = "127.0.0.1"
TINY_MAX_MODEL_LEN = 2048  # max_position_embeddings of the model builder's Llama
# What moves a prefill engine's KV to a decode engine on a CPU (vLLM 0.32, NIXL over UCX's TCP).
CPU_PD_CONNECTOR = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
LMCACHE_PD_ROUTER_FLAGS = (
    "--disagg-receiver-init-port",
    "--disagg-receiver-alloc-port",
    "--disagg-notify-port",
)
# Ran only where a cluster exists; what they would do locally, said once each.
CLUSTER_ONLY = {
    "HorizontalPodAutoscaler": "no autoscaler here: replicas as rendered",
    "ScaledObject": "no KEDA here (its trigger query runs on `vllm-stack up --prometheus`)",
    "PodDisruptionBudget": "no evictions here",
    "NetworkPolicy": "every process listens on loopback only",
    "ServiceMonitor": "`--prometheus` scrapes every process instead",
    "PrometheusRule": "`--prometheus` loads these rules",
    "Ingress": "the router listens on loopback",
    "HTTPRoute": "the router listens on loopback",
    "InferencePool": "the router listens on loopback",
    "InferenceObjective": "the router listens on loopback",
    "Pod": "helm test pod: `vllm-stack up` itself checks every model answers",
}
SILENT_KINDS = {  # wiring that the substitutions above already cover
    "Service", "ConfigMap", "Secret", "ServiceAccount", "Role", "RoleBinding", "ClusterRole",
    "ClusterRoleBinding", "PersistentVolumeClaim", "Deployment", "StatefulSet",
}  # fmt: skip
# The chart's component label (production-stack's values: an engine is a `serving-engine`) -> the part `up` runs.
RUNNABLE = {
    "serving-engine": "engine",
    "cache-server": "cache-server",
    "lmcache-controller": "lmcache-controller",
    "router": "router",
}
DROPPED_ENGINE_FLAGS = {  # flag -> why it cannot apply to one CPU engine
    "--tensor-parallel-size": "one CPU process per replica",
    "--pipeline-parallel-size": "one CPU process per replica",
    "--data-parallel-size": "one CPU process per replica",
    "--quantization": "the dummy weights are not quantized",
    "--download-dir": "nothing is downloaded",
    "--revision": "nothing is downloaded",
    "--tokenizer": "the tiny Llama's own tokenizer",
}
K8S_DISCOVERY_FLAGS = ("--k8s-namespace", "--k8s-label-selector", "--k8s-port")
# The router's Batch API database (routerSpec.batch.database): a Secret the user creates in the cluster.
BATCH_DATABASE_ENV = "VLLM_STACK_BATCH_DATABASE_URL"
UNSET_WHY = {  # env vars from a Secret the chart does not render: why leaving them unset still works here
    BATCH_DATABASE_ENV: "no PostgreSQL here: the one local router keeps its batches in SQLite in its --batch-dir",
}


class PlanError(ValueError):
    """The rendering cannot run here (said why, with what to change)."""


@dataclass(frozen=True)
class Substitution:
    """One thing the cluster would have that this machine runs differently."""

    subject: str
    rendered: str
    local: str
    why: str

    def line(self) -> str:
        return f"{self.subject}: {self.rendered} -> {self.local} ({self.why})"


@dataclass
class Process:
    """One local process standing for one pod's main container."""

    name: str  # the pod's name in the cluster: <deployment>-<replica>
    component: str  # engine | router | cache-server | lmcache-controller
    argv: list[str]  # engines: the api_server arguments (the launcher adds host, port, dtype)
    env: dict[str, str]
    port: int  # where it serves on loopback
    cpu: int | None = None
    model: str | None = None  # engines: the served model name
    role: str | None = None  # engines: prefill / decode, from the chart's role label
    files: dict[Path, str] = field(default_factory=dict)  # written before the start
    folders: list[Path] = field(default_factory=list)  # the pod's volumes, created before the start
    adapters: list[Path] = field(default_factory=list)  # LoRA folders to fill if empty (engines, router)

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


@dataclass
class StackPlan:
    processes: list[Process]
    substitutions: list[Substitution]
    not_run: list[str]  # "Kind/name: why", Kubernetes-only objects
    rules: str | None  # the rendered PrometheusRule's rule file, if the values turn it on
    generated_secrets: dict[str, dict[str, str]] = field(default_factory=dict)  # Secret -> key -> value
    deviations: list[str] = field(default_factory=list)  # the chart's own (NOTES), set by whoever rendered

    def of(self, component: str) -> list[Process]:
        return [p for p in self.processes if p.component == component]

    @property
    def engines(self) -> list[Process]:
        return self.of("engine")

    @property
    def router(self) -> Process | None:
        found = self.of("router")
        return found[0] if found else None

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(p.model for p in self.engines if p.model))


@dataclass
class _Pod:
    """A workload's pod template, expanded to one replica."""

    name: str
    component: str
    labels: dict[str, str]
    container: dict
    volumes: dict[str, dict]
    ports: dict[int, int]  # containerPort -> local port
    port_names: dict[str, int]  # port name -> containerPort
    model_label: str | None


def _flag(args: Sequence[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args and args.index(name) + 1 < len(args) else None


def _drop(args: list[str], name: str, with_value: bool = True) -> list[str]:
    while name in args:
        i = args.index(name)
        del args[i : i + 1 + int(with_value)]
    return args


def _set(args: list[str], name: str, value: str) -> list[str]:
    if name in args:
        args[args.index(name) + 1] = value
    else:
        args += [name, value]
    return args


def _decoded_secrets(objects: Sequence[dict]) -> dict[str, dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    for obj in objects:
        if obj.get("kind") != "Secret":
            continue
        data = {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()}
        data |= obj.get("stringData") or {}
        found[obj["metadata"]["name"]] = data
    return found


def _config_maps(objects: Sequence[dict]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: dict(o.get("data") or {}) for o in objects if o.get("kind") == "ConfigMap"}


def memory_fit(mem_available_gib: float, per_engine_gib: float = 3.0) -> int:
    """How many tiny CPU engines fit: each holds about 2 GiB of process and 1 GiB of KV cache."""
    return max(1, int(mem_available_gib // per_engine_gib))


class Planner:
    """Plans one rendering; ``free_port`` and ``cores`` are injected so that a plan is reproducible."""

    def __init__(
        self,
        objects: Sequence[dict],
        *,
        workdir: Path,
        model_dir: Path,
        router_port: int,
        free_port: Callable[[], int],
        cores: Sequence[int],
        max_engines: int,
        namespace: str = "default",
        dtype_override: Sequence[str] = (),
        key_factory: Callable[[], str] = lambda: "sk-local-" + secrets.token_hex(12),
        claims_dir: Path | None = None,
    ) -> None:
        self.objects = list(objects)
        self.workdir = workdir
        # Given (the cluster's Pods, vllm_stack_dev.cluster.pod_processes): each PersistentVolumeClaim is one
        # folder here, whichever Pod mounts it (router replicas on a ReadWriteMany claim share its files).
        # None (`vllm-stack up`): every mount, a claim's too, is a folder of its own pod's.
        self.claims_dir = claims_dir
        self.model_dir = model_dir
        self.router_port = router_port
        self._pick_port = free_port
        self._ports_given = {router_port}
        self.cores = list(cores) or [0]
        self.max_engines = max_engines
        self.namespace = namespace
        self.dtype_override = list(dtype_override)
        self.key_factory = key_factory
        self.secrets = _decoded_secrets(self.objects)
        self.config_maps = _config_maps(self.objects)
        self.generated_secrets: dict[str, dict[str, str]] = {}  # Secrets the user creates in the cluster
        self.substitutions: list[Substitution] = []
        self._said: set[tuple[str, str, str]] = set()
        self._next_core = 0
        self._folders: dict[str, list[Path]] = {}
        self._cpu_pd = False  # a PD engine's connector became NixlConnector: the router follows

    def learn(self, objects: Sequence[dict]) -> None:
        """ConfigMaps and Secrets known after the rendering (the cluster's, read from the API server for a
        Pod about to start, as its kubelet would: a Secret the user created); they replace those of the
        same name."""
        self.secrets |= _decoded_secrets(objects)
        self.config_maps |= _config_maps(objects)

    # ------------------------------------------------------------------------------------------ driver
    def plan(self) -> StackPlan:
        workloads = [o for o in self.objects if o.get("kind") in ("Deployment", "StatefulSet")]
        replicas = self._replicas(workloads)
        pods: list[_Pod] = []
        not_run: list[str] = []
        for workload in workloads:
            labels = workload["spec"]["template"]["metadata"].get("labels", {})
            component = RUNNABLE.get(labels.get(COMPONENT, ""))
            if component is None:
                not_run.append(f"{workload['kind']}/{workload['metadata']['name']}: not a part `up` runs")
                continue
            for index in range(replicas[workload["metadata"]["name"]]):
                pods.append(self._pod(workload, index, component))
        dns = self._dns(pods)
        processes = [self._process(pod, dns, pods) for pod in pods if pod.component != "router"]
        engines = [p for p in processes if p.component == "engine"]
        processes += [self._router(pod, dns, engines) for pod in pods if pod.component == "router"]
        for obj in self.objects:
            kind = obj.get("kind", "")
            if kind in CLUSTER_ONLY:
                not_run.append(f"{kind}/{obj['metadata']['name']}: {CLUSTER_ONLY[kind]}")
            elif kind not in SILENT_KINDS:
                not_run.append(f"{kind}/{obj['metadata']['name']}: Kubernetes only")
        external_only = any(
            p.component == "router" and _flag(p.argv, "--service-discovery") == "external-only"
            for p in processes
        )  # the router serves only external providers (docs/external-providers.md): no engine is right
        if not engines and not external_only:
            raise PlanError(
                "the values deploy no engine (servingEngineSpec.modelSpec is empty, all disabled or all at "
                "replicaCount 0)"
            )
        return StackPlan(processes, self.substitutions, not_run, self._rules(), self.generated_secrets)

    def plan_pod_engine(self, pod: dict, host: str) -> Process:
        """The engine process for one engine Pod of a cluster (the test bed's stand-in for its container,
        vllm_stack_dev.cluster.pod_processes), from the Pod object as the API server holds it.

        Unlike :meth:`plan`, the process listens at the Pod's own IP (a loopback address kwok gave it) on
        the container's own ports, as the container would: discovery finds it there, named ports and
        all. ConfigMaps and Secrets come from the objects the planner was given (the release's
        rendering); Service names in the arguments are not rewritten (an engine names none unless it
        talks to LMCache's servers, which the cluster tests do not run).
        """
        planned, command, env, files = self._pod_container(pod, "engine", host)
        return self._engine(planned, command, env, files, pod_host=host)

    def plan_pod_router(self, pod: dict, host: str) -> Process:
        """The router process for the router Pod of a cluster, exactly as rendered (Kubernetes discovery
        included: it asks the cluster's API server) but listening at the Pod's IP; its mounted
        ConfigMaps and Secrets written to local folders, a claim's folder shared with every Pod mounting
        the claim when the planner has a ``claims_dir``."""
        planned, command, env, files = self._pod_container(pod, "router", host)
        port = planned.port_names.get("http") or next(iter(planned.ports))
        argv = _set(list(command), "--host", host)
        return Process(planned.name, "router", argv, env, port, files=files,
                       folders=self._folders.get(planned.name, []))  # fmt: skip

    def _pod_container(
        self, pod: dict, component: str, host: str
    ) -> tuple[_Pod, list[str], dict[str, str], dict[Path, str]]:
        """A Pod's main container with its ports kept, its mounts, environment and command made local."""
        labels = dict((pod.get("metadata") or {}).get("labels") or {})
        spec = pod["spec"]
        main = spec["containers"][0]
        ports = {int(p["containerPort"]): int(p["containerPort"]) for p in main.get("ports", [])}
        names = {p["name"]: int(p["containerPort"]) for p in main.get("ports", []) if p.get("name")}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        planned = _Pod(pod["metadata"]["name"], component, labels, main, volumes, ports, names,
                       labels.get(MODEL_LABEL))  # fmt: skip
        mounts, files = self._mounts(planned)
        env = self._env(planned, [], mounts, pod_host=host)
        command = [*main.get("command", []), *main.get("args", [])]
        return planned, [self._local(arg, [], mounts) for arg in command], env, files

    def free_port(self) -> int:
        """A port no other part of this plan has: the source may give one twice (it only checks that the
        port is free now, and nothing binds the plan's ports until the stack starts)."""
        while (port := self._pick_port()) in self._ports_given:
            pass
        self._ports_given.add(port)
        return port

    def _say(self, subject: str, rendered: str, local: str, why: str) -> None:
        key = (subject, rendered, local)
        if key not in self._said:
            self._said.add(key)
            self.substitutions.append(Substitution(subject, rendered, local, why))

    def _core(self) -> int:
        core = self.cores[self._next_core % len(self.cores)]
        self._next_core += 1
        return core

    # ---------------------------------------------------------------------------------------- replicas
    def _replicas(self, workloads: list[dict]) -> dict[str, int]:
        counts: dict[str, int] = {}
        engines: list[str] = []
        for workload in workloads:
            name = workload["metadata"]["name"]
            component = RUNNABLE.get(
                workload["spec"]["template"]["metadata"].get("labels", {}).get(COMPONENT, "")
            )
            rendered = workload["spec"].get("replicas")
            count = 1 if rendered is None else int(rendered)
            if component == "engine":
                engines.append(name)
                if count == 0:
                    self._say(
                        name, "replicas 0", "no engine",
                        "as in the cluster: the router knows the model from its configuration and queues its "
                        "requests until an engine is ready or the queue timeout ends them",
                    )  # fmt: skip
            elif component == "router" and count != 1:
                self._say(name, f"replicas {count}", "1", "one router on one local port")
                count = 1
            counts[name] = count
        if len(engines) > self.max_engines:
            raise PlanError(
                f"the values deploy {len(engines)} engine Deployments; this machine fits {self.max_engines} "
                "tiny CPU engines (`--max-engines`, about 3 GiB of memory each)"
            )
        while sum(counts[n] for n in engines) > self.max_engines:
            largest = max(engines, key=lambda n: counts[n])
            counts[largest] -= 1
        for workload in workloads:
            name = workload["metadata"]["name"]
            rendered = workload["spec"].get("replicas")
            if name in engines and rendered and counts[name] < int(rendered):
                self._say(
                    name, f"replicas {rendered}", str(counts[name]),
                    f"this machine's memory fits {self.max_engines} tiny CPU engines (`--max-engines`)",
                )  # fmt: skip
        return counts

    # -------------------------------------------------------------------------------------------- pods
    def _pod(self, workload: dict, index: int, component: str) -> _Pod:
        template = workload["spec"]["template"]
        spec = template["spec"]
        containers = spec["containers"]
        main = containers[0]
        for other in containers[1:]:
            self._say(
                workload["metadata"]["name"],
                f"sidecar {other['name']}",
                "not run",
                "only the main container runs",
            )
        name = f"{workload['metadata']['name']}-{index}"
        ports: dict[int, int] = {}
        names: dict[str, int] = {}
        for entry in main.get("ports", []):
            ports[int(entry["containerPort"])] = self.free_port()
            if entry.get("name"):
                names[entry["name"]] = int(entry["containerPort"])
        labels = dict(template["metadata"].get("labels", {}))
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        return _Pod(name, component, labels, main, volumes, ports, names, labels.get(MODEL_LABEL))

    def _dns(self, pods: list[_Pod]) -> list[tuple[re.Pattern[str], str]]:
        """Each Service name (every DNS spelling) and port -> the loopback port of the pod it selects."""
        rewrites: list[tuple[re.Pattern[str], str]] = []
        for svc in (o for o in self.objects if o.get("kind") == "Service"):
            selector = svc["spec"].get("selector") or {}
            chosen = [p for p in pods if selector and selector.items() <= p.labels.items()]
            if not chosen:
                continue
            pod = chosen[0]
            name = svc["metadata"]["name"]
            ns = svc["metadata"].get("namespace", self.namespace)
            host = rf"{re.escape(name)}(?:\.{re.escape(ns)}(?:\.svc(?:\.cluster\.local)?)?)?"
            for entry in svc["spec"].get("ports", []):
                target = entry.get("targetPort", entry["port"])
                container_port = pod.port_names.get(target) if isinstance(target, str) else int(target)
                if pod.component == "router" and container_port == pod.port_names.get("http", container_port):
                    local = self.router_port
                elif container_port in pod.ports:
                    local = pod.ports[container_port]
                else:
                    continue
                pattern = re.compile(rf"(?<![\w.-]){host}:{entry['port']}(?!\d)")
                rewrites.append((pattern, f"{LOOPBACK}:{local}"))
                self._say(
                    "cluster DNS",
                    f"{name}:{entry['port']}",
                    f"{LOOPBACK}:{local}",
                    f"Service {name} -> {pod.name}",
                )
        return rewrites

    # ------------------------------------------------------------------------------------ local values
    def _local(self, text: str, dns: list[tuple[re.Pattern[str], str]], mounts: dict[str, Path]) -> str:
        for pattern, replacement in dns:
            text = pattern.sub(replacement, text)
        for mount_path in sorted(mounts, key=len, reverse=True):
            local = str(mounts[mount_path])
            if text == mount_path or text.startswith(mount_path.rstrip("/") + "/"):
                return local + text[len(mount_path.rstrip("/")) :]
            text = re.sub(rf"(?<=[=:,\s]){re.escape(mount_path.rstrip('/'))}(?=/|$|[,\s])", local, text)
        return text

    def _mounts(self, pod: _Pod) -> tuple[dict[str, Path], dict[Path, str]]:
        """Each volume mount -> a local folder (or file, with subPath), and the files to write there."""
        mounts: dict[str, Path] = {}
        files: dict[Path, str] = {}
        root = self.workdir / pod.name
        for mount in pod.container.get("volumeMounts", []):
            path = mount["mountPath"]
            if path == "/dev/shm":
                continue  # this machine's own shared memory
            volume = pod.volumes.get(mount["name"], {})
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if self.claims_dir is not None and claim:
                local = self.claims_dir / claim
            else:
                local = root / mount["name"]
            content = self._volume_files(pod, volume)
            self._folders.setdefault(pod.name, []).append(local)
            if mount.get("subPath"):
                sub = mount["subPath"]
                mounts[path] = local / sub
                if sub in content:
                    files[local / sub] = content[sub]
            else:
                mounts[path] = local
                files |= {local / rel: text for rel, text in content.items()}
        return mounts, files

    def _volume_files(self, pod: _Pod, volume: dict) -> dict[str, str]:
        if "configMap" in volume:
            source, data = volume["configMap"], self.config_maps.get(volume["configMap"]["name"], {})
        elif "secret" in volume:
            source = volume["secret"]
            name = source["secretName"]
            data = self.secrets.get(name)
            if data is None or name in self.generated_secrets:  # one value per key for every pod
                generated = self.generated_secrets.setdefault(name, {})
                for key in (item["key"] for item in source.get("items", [])):
                    if key not in generated:
                        generated[key] = self.key_factory()
                        self._say(
                            pod.name, f"Secret {name} key {key}", f"generated {generated[key]}",
                            "the chart does not render this Secret (you create it in the cluster)",
                        )  # fmt: skip
                data = generated
        else:
            return {}
        items = source.get("items")
        if not items:
            return dict(data)
        return {item["path"]: data[item["key"]] for item in items if item["key"] in data}

    def _env(self, pod: _Pod, dns, mounts: dict[str, Path], pod_host: str = LOOPBACK) -> dict[str, str]:
        """The container's environment made local; ``status.*`` fields (the Pod's IP) are ``pod_host``."""
        env: dict[str, str] = {}
        for entry in pod.container.get("env", []):
            name = entry["name"]
            if "value" in entry:
                env[name] = self._local(str(entry["value"]), dns, mounts)
                continue
            source = entry.get("valueFrom", {})
            if "secretKeyRef" in source or "configMapKeyRef" in source:
                kind, ref = (
                    ("Secret", source["secretKeyRef"])
                    if "secretKeyRef" in source
                    else ("ConfigMap", source["configMapKeyRef"])
                )
                store = self.secrets if kind == "Secret" else self.config_maps
                value = store.get(ref["name"], {}).get(ref["key"])
                if value is None:
                    why = f"the chart does not render this {kind} (you create it in the cluster)"
                    self._say(
                        pod.name,
                        f"{name} from {kind} {ref['name']}",
                        "unset",
                        f"{why}; {UNSET_WHY[name]}" if name in UNSET_WHY else why,
                    )
                else:
                    env[name] = value
            elif "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                value = {"metadata.name": pod.name, "metadata.namespace": self.namespace}.get(
                    path, pod_host if path.startswith("status.") else None
                )
                if value is not None:
                    env[name] = value
        return env

    # ----------------------------------------------------------------------------------------- engines
    def _process(self, pod: _Pod, dns, pods: list[_Pod]) -> Process:
        mounts, files = self._mounts(pod)
        env = self._env(pod, dns, mounts)
        command = [*pod.container.get("command", []), *pod.container.get("args", [])]
        command = [self._local(arg, dns, mounts) for arg in command]
        if pod.component == "engine":
            return self._engine(pod, command, env, files)
        main_port = next(iter(pod.ports.values()), None) or self.free_port()
        if pod.component == "cache-server":
            return self._cache_server(pod, command, env, files)
        return self._controller(pod, command, env, files, main_port)

    def _engine(
        self,
        pod: _Pod,
        command: list[str],
        env: dict[str, str],
        files: dict[Path, str],
        pod_host: str | None = None,
    ) -> Process:
        """The engine process of ``pod``; with ``pod_host`` (plan_pod_engine) it keeps its own ports there."""
        if command[:3] == ["python3", "-m", "sglang.launch_server"]:
            raise PlanError(
                f"{pod.name}: an SGLang engine (engineKind: sglang) does not run under `vllm-stack up`: its "
                "PyPI package has no CPU kernels (docs/engine-kinds-research.md); deploy it with the chart"
            )
        if command[:2] != ["vllm", "serve"] or len(command) < 3:
            raise PlanError(f"{pod.name}: the engine command is not `vllm serve MODEL ...`: {command[:3]}")
        model, args = command[2], command[3:]
        served = _flag(args, "--served-model-name") or model
        if Path(model).is_dir() and (Path(model) / "config.json").exists():
            args = ["--model", model, *args]
        else:
            args = [
                "--model",
                str(self.model_dir),
                *_set(args, "--served-model-name", served),
                "--load-format",
                "dummy",
            ]
            self._say(
                pod.name,
                f"weights {model}",
                f"tiny Llama, dummy weights, served as {served}",
                "no weights can be fetched here",
            )
        args = _drop(_drop(args, "--host"), "--port")
        port = pod.ports.get(8000) or next(iter(pod.ports.values()), None) or self.free_port()
        for flag, why in DROPPED_ENGINE_FLAGS.items():
            if flag in args:
                self._say(pod.name, f"{flag} {_flag(args, flag)}", "dropped", why)
                _drop(args, flag)
        if "--enable-sleep-mode" in args:
            self._say(
                pod.name,
                "--enable-sleep-mode",
                "dropped",
                "vLLM's CPU build refuses it at start (sleep mode is CUDA, ROCm and XPU only); with "
                "VLLM_SERVER_DEV_MODE=1 its /sleep still pauses the engine, freeing nothing",
            )
            args = _drop(args, "--enable-sleep-mode", with_value=False)
        rendered_len = _flag(args, "--max-model-len")
        if rendered_len is not None and int(rendered_len) > TINY_MAX_MODEL_LEN:
            self._say(
                pod.name,
                f"--max-model-len {rendered_len}",
                str(TINY_MAX_MODEL_LEN),
                "the tiny Llama's positions",
            )
            _set(args, "--max-model-len", str(TINY_MAX_MODEL_LEN))
        template = _flag(args, "--chat-template")
        if (
            template
            and ("/" in template or template.endswith(".jinja"))
            and not (
                Path(template).exists()
                or Path(template) in files  # a mounted ConfigMap's file is written at start
            )
        ):
            self._say(
                pod.name,
                f"--chat-template {_flag(pod.container.get('args', []), '--chat-template') or template}",
                "the tiny Llama's own chat template",
                "the file is in the cluster's image or volume, not here",
            )
            _drop(args, "--chat-template")
        args = self._kv_events(pod, args, pod_host)
        args = self._kv_transfer(pod, args, env)
        if "--enforce-eager" not in args:
            args.append("--enforce-eager")
            self._say(
                pod.name,
                "torch.compile",
                "--enforce-eager",
                "compiling gains the tiny model nothing on CPU and costs a minute per start",
            )
        if self.dtype_override and _flag(args, "--dtype") != self.dtype_override[1]:
            self._say(
                pod.name,
                f"--dtype {_flag(args, '--dtype') or 'auto'}",
                " ".join(self.dtype_override),
                "vLLM 0.32's CPU AMX kernels fault on this CPU",
            )
        adapters = self._adapters(pod, args)
        cpu = self._core()
        self._say(
            pod.name,
            "image " + pod.container.get("image", "?"),
            "the local engine environment (.venv-engine, vLLM CPU build)",
            "no container runtime here",
        )
        self._say(
            pod.name,
            f"resources {_resources(pod.container)}",
            f"core {cpu}, KV cache {default_kv_cache_mib()} MiB (--kv-cache-memory-bytes)",
            "no GPU here",
        )
        role = pod.labels.get(ROLE_LABEL)
        return Process(
            pod.name,
            "engine",
            args,
            env,
            port,
            cpu=cpu,
            model=served,
            role=role,
            files=files,
            folders=self._folders.get(pod.name, []),
            adapters=adapters,
        )

    def _adapters(self, pod: _Pod, args: list[str]) -> list[Path]:
        """The folders of ``--lora-modules`` (``name=path`` or vLLM's JSON form): an adapter that is not
        there (the cluster's volume holds it) becomes a tiny random LoRA for the tiny model."""
        folders = []
        for index, arg in enumerate(args[:-1]):
            if arg != "--lora-modules":
                continue
            value = args[index + 1]
            if value.startswith("{"):
                module = json.loads(value)
                name, path = module.get("name", "?"), module.get("path", "")
            else:
                name, _, path = value.partition("=")
            folder = Path(path)
            if not (folder / "adapter_config.json").exists():
                folders.append(folder)
                self._say(
                    pod.name,
                    f"LoRA adapter {name} ({path})",
                    "a tiny random LoRA for the tiny Llama, written there",
                    "the adapter's weights are in the cluster's volume and fit only the real model",
                )
        return folders

    def _kv_events(self, pod: _Pod, args: list[str], pod_host: str | None = None) -> list[str]:
        config = _flag(args, "--kv-events-config")
        if config is None:
            return args
        events = json.loads(config)
        for key in ("endpoint", "replay_endpoint"):
            if key in events and pod_host is not None:  # the Pod's own address, the port kept
                events[key] = re.sub(
                    r"//(\*|0\.0\.0\.0)(?=:)", f"//{kv_events_bind_host(pod_host)}", events[key]
                )
            elif key in events and re.search(r":\d+$", events[key]):
                local = re.sub(r":\d+$", f":{self.free_port()}", events[key])
                self._say(pod.name, f"KV events {key} {events[key]}", local, "a free port per engine")
                events[key] = local
        return _set(args, "--kv-events-config", json.dumps(events))

    def _kv_transfer(self, pod: _Pod, args: list[str], env: dict[str, str]) -> list[str]:
        config = _flag(args, "--kv-transfer-config")
        if config is None:
            return args
        connector = json.loads(config).get("kv_connector", "")
        _drop(args, "--kv-transfer-config")
        dropped = sorted(k for k in env if k.startswith("LMCACHE_"))
        for key in dropped:
            del env[key]
        if pod.labels.get(ROLE_LABEL) in ("prefill", "decode"):
            self._cpu_pd = True
            args += ["--kv-transfer-config", json.dumps(CPU_PD_CONNECTOR, separators=(",", ":"))]
            nixl = nixl_loopback_env(side_channel_port=self.free_port())
            env |= nixl
            self._say(
                pod.name, f"--kv-transfer-config {connector}",
                "NixlConnector (kv_both), KV in a host buffer, UCX over loopback TCP "
                f"(side channel 127.0.0.1:{nixl['VLLM_NIXL_SIDE_CHANNEL_PORT']})",
                "LMCache's vLLM connector needs its CUDA extension; vLLM's NIXL connector moves the "
                "prefill engine's KV to the decode engine on a CPU",
            )  # fmt: skip
            if dropped:
                self._say(
                    pod.name, f"env {', '.join(dropped)}", "unset", "they configure LMCache's connector"
                )
            return args
        self._say(
            pod.name, f"--kv-transfer-config {connector}", "none (the engine keeps its own prefix cache only)",
            "LMCache's vLLM connector needs its CUDA extension, which does not load without a GPU; "
            "KV offload and the cache server's use happen only on GPUs",
        )  # fmt: skip
        if dropped:
            self._say(pod.name, f"env {', '.join(dropped)}", "unset", "they configure the dropped connector")
        return args

    # ------------------------------------------------------------------------------- LMCache's servers
    def _cache_server(
        self, pod: _Pod, command: list[str], env: dict[str, str], files: dict[Path, str]
    ) -> Process:
        program, _host, port = command[:3]
        local = pod.ports.get(int(port)) or self.free_port()
        self._say(
            pod.name, f"{program} 0.0.0.0 {port}", f"{program} {LOOPBACK} {local}", "loopback, a free port"
        )
        return self._lmcache(
            pod, "cache-server", [program, LOOPBACK, str(local), *command[3:]], env, local, files
        )

    def _controller(
        self, pod: _Pod, command: list[str], env: dict[str, str], files: dict[Path, str], main_port: int
    ) -> Process:
        program, args = command[0], command[1:]
        _set(args, "--host", LOOPBACK)
        api = int(_flag(args, "--port") or 9000)
        port = pod.ports.get(api, main_port)
        _set(args, "--port", str(port))
        monitor = _flag(args, "--monitor-ports")
        if monitor:
            ports = {k: pod.ports.get(int(v), v) for k, v in json.loads(monitor).items()}
            _set(args, "--monitor-ports", json.dumps(ports))
        self._say(
            pod.name,
            "container ports " + ",".join(map(str, pod.ports)),
            ",".join(map(str, pod.ports.values())),
            "free loopback ports",
        )
        return self._lmcache(pod, "lmcache-controller", [program, *args], env, port, files)

    def _lmcache(
        self,
        pod: _Pod,
        component: str,
        argv: list[str],
        env: dict[str, str],
        port: int,
        files: dict[Path, str],
    ) -> Process:
        """One of LMCache's own servers: its program from LMCache's wheel, not the pod's image."""
        self._say(
            pod.name,
            "image " + pod.container.get("image", "?"),
            "LMCache 0.5.6's wheel run by the engine environment",
            "no container runtime here",
        )
        return Process(
            pod.name,
            component,
            argv,
            env,
            port,
            cpu=self._core(),
            files=files,
            folders=self._folders.get(pod.name, []),
        )

    # ------------------------------------------------------------------------------------------ router
    def _router(self, pod: _Pod, dns, engines: list[Process]) -> Process:
        mounts, files = self._mounts(pod)
        env = self._env(pod, dns, mounts)
        args = [self._local(arg, dns, mounts) for arg in pod.container.get("args", [])]
        if _flag(args, "--service-discovery") == "k8s":
            for name in K8S_DISCOVERY_FLAGS:
                _drop(args, name)
            _set(args, "--service-discovery", "static")
            self._say(
                pod.name,
                "--service-discovery k8s",
                f"static, the {len(engines)} local engines",
                "no Kubernetes API here",
            )
        if _flag(args, "--service-discovery") != "external-only":
            _set(args, "--static-backends", ",".join(e.url for e in engines))
        notify = _flag(args, "--disagg-notify-port")
        if self._cpu_pd and _flag(args, "--disagg-protocol") == "lmcache":
            for name in LMCACHE_PD_ROUTER_FLAGS:
                _drop(args, name)
            _set(args, "--disagg-protocol", "vllm")
            self._say(
                pod.name, "--disagg-protocol lmcache", "vllm (the prefill answer's kv_transfer_params)",
                "the engines' connector is NixlConnector here (LMCache's PD needs a GPU)",
            )  # fmt: skip
        elif notify is not None and int(notify) in pod.ports:  # the router's own notify port, local
            _set(args, "--disagg-notify-port", str(pod.ports[int(notify)]))
        files, adapters = self._registry_adapters(pod, files)
        self._batch(pod, args)
        if any(e.role for e in engines):
            _set(args, "--static-roles", ",".join(e.role or "both" for e in engines))
        _set(args, "--host", LOOPBACK)
        _set(args, "--port", str(self.router_port))
        tokenizers = _flag(args, "--tokenizers")
        if tokenizers:
            entries = []
            for entry in tokenizers.split(","):
                model, _, source = entry.partition("=")
                if source.startswith("hf:") or not Path(source).is_dir():
                    self._say(
                        pod.name,
                        f"tokenizer {source}",
                        str(self.model_dir),
                        "the engines serve the tiny Llama; nothing is fetched here",
                    )
                    source = str(self.model_dir)
                entries.append(f"{model}={source}")
            _set(args, "--tokenizers", ",".join(entries))
        self._say(
            pod.name,
            "image " + pod.container.get("image", "?"),
            f"this checkout's router ({Path(sys.executable).parent})",
            "no container runtime here",
        )
        return Process(
            pod.name,
            "router",
            args,
            env,
            self.router_port,
            files=files,
            folders=self._folders.get(pod.name, []),
            adapters=adapters,
        )

    def _batch(self, pod: _Pod, args: list[str]) -> None:
        """The Batch API's volume (routerSpec.batch): like every mount, a folder of the stack's work
        directory, which ``--batch-dir`` names once made local; said, with the claim it stands for."""
        local = _flag(args, "--batch-dir")
        rendered = _flag(pod.container.get("args", []), "--batch-dir")
        if local is None or rendered is None:
            return
        claim = next(
            (
                pod.volumes.get(m["name"], {}).get("persistentVolumeClaim", {}).get("claimName")
                for m in pod.container.get("volumeMounts", [])
                if m["mountPath"].rstrip("/") == rendered.rstrip("/")
            ),
            None,
        )
        self._say(
            pod.name,
            f"--batch-dir {rendered}" + (f" (PersistentVolumeClaim {claim})" if claim else ""),
            local,
            "no cluster storage here: a folder of the stack's log directory, kept with --log-dir",
        )

    def _registry_adapters(self, pod: _Pod, files: dict[Path, str]) -> tuple[dict[Path, str], list[Path]]:
        """The router's adapter registry (``lora_adapters`` in its configuration file): a source that is a
        Hub repository or a path not on this machine becomes a tiny random LoRA in the stack's folder,
        which the router then loads onto the engines as it would the real one."""
        import yaml

        changed = dict(files)
        adapters: list[Path] = []
        for path, text in files.items():
            if path.suffix not in (".yaml", ".yml"):
                continue
            config = yaml.safe_load(text)
            if not isinstance(config, dict) or not isinstance(config.get("lora_adapters"), list):
                continue
            for adapter in config["lora_adapters"]:
                source = str(adapter.get("source", ""))
                if not source.startswith("hf:") and (Path(source) / "adapter_config.json").exists():
                    continue
                folder = (
                    self.workdir / "adapters" / re.sub(r"[^\w.-]", "_", str(adapter.get("name", "adapter")))
                )
                adapter["source"] = str(folder)
                adapters.append(folder)
                self._say(
                    pod.name,
                    f"LoRA adapter {adapter.get('name')} ({source})",
                    f"a tiny random LoRA for the tiny Llama, {folder}",
                    "the adapter's weights are in the Hub or the cluster's volume and fit only the real model",
                )
            changed[path] = yaml.safe_dump(config, sort_keys=False)
        return changed, adapters

    def _rules(self) -> str | None:
        import yaml

        for obj in self.objects:
            if obj.get("kind") == "PrometheusRule":
                return yaml.safe_dump(obj["spec"], sort_keys=False)
        return None


def _resources(container: dict) -> str:
    requests = (
        (container.get("resources") or {}).get("limits")
        or (container.get("resources") or {}).get("requests")
        or {}
    )
    return ", ".join(f"{k}={v}" for k, v in requests.items()) or "none"
