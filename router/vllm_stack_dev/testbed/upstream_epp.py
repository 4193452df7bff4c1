"""The Gateway API Inference Extension's own endpoint picker (EPP v1.5.0) as a process, for interop tests.

This is the real upstream component, not a stand-in: the ``epp`` binary built from the published Go
module ``sigs.k8s.io/gateway-api-inference-extension`` (``vllm_stack_dev.gotools.EPP``, built by
``make install``), run with its default scheduling configuration against a test cluster's API server
(``vllm_stack_dev.cluster.control_plane``). What it needs there, and why each flag is set (see the
project's research notes for the source lines):

- an InferencePool (``inference.networking.k8s.io/v1``) named ``pool`` in ``namespace``, whose Pods
  are Ready with an IP; it scrapes ``podIP:targetPort/metrics`` (vLLM's own metric names) and names
  ``podIP:targetPort`` as the endpoint. InferenceObjectives (``v1alpha2``) are watched when their CRD is
  there;
- credentials in ``KUBECONFIG`` (the binary has no ``--kubeconfig`` flag), e.g. a ServiceAccount token
  whose Role allows get/list/watch on pods, inferencepools, inferenceobjectives and
  inferencemodelrewrites in the namespace;
- ``--secure-serving=false`` (plaintext gRPC; TLS with a self-signed certificate otherwise),
  ``--metrics-endpoint-auth=false`` (no TokenReview rights needed), ``--tracing=false`` (no OTLP export
  to localhost:4317), ``--enable-pprof=false``.

It binds its three ports (ext_proc gRPC, gRPC health, Prometheus metrics) on all interfaces, and no flag
changes that: the ports are taken free on loopback here, and the tests send to 127.0.0.1 only.
Readiness is waited for by condition: the gRPC health service answers SERVING for the ext_proc service
(the pool has synced), and, when asked, the pool counts a number of ready endpoints with fresh metrics
(``inference_pool_ready_pods``). The process runs in its own process group, stopped by its PID.

:class:`LightweightEpp` runs the 1.6 line's lightweight reference picker (``lwepp`` v1.6.2,
``vllm_stack_dev.gotools.LWEPP``) the same way. It is a much smaller program: round-robin over the pool's
Ready Pods (endpoints = Pod x targetPort, as the EPP's), no metrics scraping, no body parsing, no
InferenceObjectives. What differs in running it (see the project's research notes):

- it reads only Pods and the InferencePool (``inference.networking.k8s.io/v1``) of ``--pool-namespace``
  (left empty, it would watch Pods in every namespace); the same namespaced Role suffices;
- its flags are few: ``--pool-name``, ``--pool-namespace``, ``--pool-group``, ``--grpc-port``,
  ``--grpc-health-port``, ``--metrics-port`` (controller-runtime's own metrics, no pool gauges, no
  auth), ``--secure-serving`` (true: TLS with a self-signed certificate), ``--health-checking`` (a health
  service on the ext_proc port too), controller-runtime's ``--kubeconfig`` and zap's ``--zap-*`` (no
  ``--v``, no tracing, no pprof); ``KUBECONFIG`` is set all the same;
- its health port answers for the service ``inference-extension`` (NOT_SERVING until the pool is in its
  datastore, then SERVING); the Pods are listed in the same step, a moment later;
- readiness with endpoints is asked of the picker itself: header-only probe requests, each answered with
  a pick at once; its round-robin names each of its endpoints within ``ROUND_ROBIN_PROBES`` consecutive
  picks (for up to that many endpoints);
- it logs no request id, so :meth:`UpstreamEpp.handled` finds nothing in its log.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from vllm_stack_dev.gotools import EPP, LWEPP, GoTool, epp_binary, lwepp_binary
from vllm_stack_dev.testbed.engines import log_tail, port_for_later, spawn_logged, stop_group

from vllm_stack.extproc import wire

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
#: How often the pool's Prometheus gauges are refreshed (its default, 5 s, would make readiness slow).
PROMETHEUS_REFRESH = "500ms"


class UpstreamEpp:
    """The upstream EPP serving InferencePool ``namespace/pool``; :meth:`start` (or ``with``) runs it,
    :meth:`stop` ends it. ``extra_args`` are more of its flags (e.g. ``--config-text``)."""

    #: What is run: the tool (its version), the log's name, and the service its health port answers for
    #: once the pool has synced.
    tool: GoTool = EPP
    log_name = "upstream-epp.log"
    health_service = EXT_PROC_SERVICE

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        pool: str,
        workdir: Path,
        *,
        extra_args: Sequence[str] = (),
        binary: Path | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.pool = pool
        self.workdir = workdir
        self.binary = binary or self.default_binary()
        self.extra_args = list(extra_args)
        self.grpc_port = port_for_later()
        self.health_port = port_for_later()
        self.metrics_port = port_for_later()
        self.log_path = workdir / self.log_name
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def target(self) -> str:
        """``host:port`` of its ext_proc service, on loopback."""
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def version(self) -> str:
        return self.tool.version

    @property
    def label(self) -> str:
        """How errors name it: ``the upstream epp v1.5.0``."""
        return f"the upstream {self.tool.name} {self.tool.version}"

    @staticmethod
    def default_binary() -> Path:
        return epp_binary()

    def command(self) -> list[str]:
        return [
            str(self.binary),
            f"--pool-name={self.pool}",
            f"--pool-namespace={self.namespace}",
            "--secure-serving=false",
            "--tracing=false",
            "--metrics-endpoint-auth=false",
            "--enable-pprof=false",
            f"--grpc-port={self.grpc_port}",
            f"--grpc-health-port={self.health_port}",
            f"--metrics-port={self.metrics_port}",
            f"--refresh-prometheus-metrics-interval={PROMETHEUS_REFRESH}",
            "--v=3",  # "Request handled" with each request's endpoint (see handled())
            "--zap-encoder=json",
            *self.extra_args,
        ]

    def start(self, timeout: float = 60.0, ready_endpoints: int | None = None) -> UpstreamEpp:
        """Start it and wait until it serves (see :meth:`wait_ready`); on failure it is stopped and the
        error carries its log's tail."""
        if not self.binary.is_file():
            raise RuntimeError(f"{self.label}'s binary {self.binary} is missing: run `make install`")
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(self.workdir),  # nothing of the user's ~/.kube is read
            "KUBECONFIG": str(self.kubeconfig),
            "GOMAXPROCS": os.environ.get("GOMAXPROCS", "2"),
        }
        self.process = spawn_logged(self.command(), self.log_path, env)
        try:
            self.wait_ready(timeout, ready_endpoints)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float = 60.0, ready_endpoints: int | None = None) -> None:
        """Until its health service says SERVING (the pool synced) and, with ``ready_endpoints``, it
        counts that many endpoints (see :meth:`ready_endpoints`)."""
        deadline = time.monotonic() + timeout

        def ready() -> bool:
            if self.health(self.health_service) != "SERVING":
                return False
            return ready_endpoints is None or self.ready_endpoints() == ready_endpoints

        while not ready():
            process = self.process
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                raise RuntimeError(f"{self.label} exited ({code}); its log:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{self.label} not ready within {timeout:.0f} s (health "
                    f"{self.health(self.health_service)}, ready endpoints {self.ready_endpoints()}); "
                    f"its log:\n{self.log_tail()}"
                )
            time.sleep(0.2)

    def health(self, service: str = "") -> str:
        """grpc.health.v1 Check for ``service``: SERVING, NOT_SERVING, SERVICE_UNKNOWN, or UNAVAILABLE
        when it does not answer."""
        try:
            with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as channel:
                answer = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=2
                )
                return health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        except grpc.RpcError:
            return "UNAVAILABLE"

    def metrics(self) -> str:
        """Its Prometheus exposition text."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=5) as response:
            return response.read().decode()

    def ready_endpoints(self) -> float | None:
        """How many endpoints it would pick from: ``inference_pool_ready_pods`` of its pool (endpoints
        with fresh metrics), or None."""
        try:
            text = self.metrics()
        except OSError:
            return None
        prefix = f'inference_pool_ready_pods{{name="{self.pool}"}} '
        for line in text.splitlines():
            if line.startswith(prefix):
                return float(line[len(prefix) :])
        return None

    def records(self) -> list[dict[str, Any]]:
        """Its JSON log records so far (the command line and any non-JSON line skipped)."""
        found = []
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        for line in text.splitlines():
            if line.startswith("{"):
                try:
                    found.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line still being written
        return found

    def handled(self) -> dict[str, str]:
        """x-request-id -> the endpoint it named, for each request it scheduled ("Request handled")."""
        return {
            str(r["x-request-id"]): str(r["endpoint"])
            for r in self.records()
            if r.get("msg") == "Request handled" and "x-request-id" in r
        }

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def stop(self) -> None:
        """SIGTERM its process group (by its PID), SIGKILL after 15 s."""
        if self.process is not None:
            stop_group(self.process)

    def __enter__(self) -> UpstreamEpp:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: Header-only requests per readiness probe of the lightweight picker: its round-robin names each of up
#: to this many endpoints once in as many consecutive picks.
ROUND_ROBIN_PROBES = 8


class LightweightEpp(UpstreamEpp):
    """The 1.6 line's lightweight reference picker (``lwepp``) serving InferencePool ``namespace/pool``
    (see the module docstring for how it differs in running)."""

    tool = LWEPP
    log_name = "lwepp.log"
    health_service = "inference-extension"

    @staticmethod
    def default_binary() -> Path:
        return lwepp_binary()

    def command(self) -> list[str]:
        return [
            str(self.binary),
            f"--pool-name={self.pool}",
            f"--pool-namespace={self.namespace}",
            "--secure-serving=false",
            f"--grpc-port={self.grpc_port}",
            f"--grpc-health-port={self.health_port}",
            f"--metrics-port={self.metrics_port}",
            f"--kubeconfig={self.kubeconfig}",
            "--zap-encoder=json",
            "--zap-log-level=4",  # "Selected endpoint" for each pick
            *self.extra_args,
        ]

    def pick(self, timeout: float = 2.0) -> str | None:
        """The endpoint it names for a header-only request (a GET, answered at once), or None when it
        does not answer with one."""
        headers = [(":method", "GET"), (":path", "/v1/models"), (":authority", "readiness-probe")]
        request = wire.ProcessingRequest(
            request_headers=wire.pb.HttpHeaders(headers=wire.header_map(headers), end_of_stream=True)
        )
        try:
            with grpc.insecure_channel(self.target) as channel:
                answers: Iterator[wire.ProcessingResponse] = pb_grpc.ExternalProcessorStub(channel).Process(
                    iter([request]), timeout=timeout
                )
                answer = next(answers, None)
        except grpc.RpcError:
            return None
        if answer is None or answer.WhichOneof("response") != "request_headers":
            return None
        return wire.destination_of(answer)[0] or None

    def ready_endpoints(self) -> float | None:
        """How many distinct endpoints it names in ROUND_ROBIN_PROBES consecutive picks (None when it
        names none): every endpoint it picks from, as long as it has no more than that many."""
        named = {self.pick() for _ in range(ROUND_ROBIN_PROBES)} - {None}
        return float(len(named)) if named else None


#: Where the llm-d router's ``epp`` binary is, when one was built (``benchmarks/routing/llmd.md`` says
#: how): its Go module is not served by the module proxy, so ``make install`` cannot build it, and the
#: tests and benchmarks that use it skip with that reason when the variable is unset.
LLMD_EPP_ENV = "VLLM_STACK_LLMD_EPP"
#: The commit of ``llm-d/llm-d-router`` the results in ``benchmarks/results/`` were measured with.
LLMD_ROUTER_COMMIT = "ebab687927f5331c1b39defcb579a07951bce56c"

#: llm-d's default scheduling profile, as its docs configure it for vLLM without disaggregation: the
#: decode filter, the approximate prefix-cache scorer (weight 2: it hashes the request's text), the
#: queue and KV-cache-utilisation scorers from the engines' metrics, and the max-score picker. Written
#: here from the plugin names its docs list (``deploy/config/*.yaml`` at the commit above).
LLMD_DEFAULT_PROFILE = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: decode-filter
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
- type: single-profile-handler
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: prefix-cache-scorer
    weight: 2
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: kv-cache-utilization-scorer
    weight: 1
  - pluginRef: max-score-picker
"""


#: The fairness policy llm-d's flow control takes turns by: its default, ``global-strict``, serves the
#: oldest request of any flow, which is not fair between tenants.
LLMD_FAIRNESS_POLICY = "round-robin-fairness-policy"


def llmd_flow_control_profile(
    queue_depth: int = 5, ttl_seconds: float = 60.0, max_concurrency: int | None = None
) -> str:
    """llm-d's default profile (:data:`LLMD_DEFAULT_PROFILE`) with its flow control on
    (``featureGates: [flowControl]``), as its ``EndpointPickerConfig`` declares it at the commit above.

    Requests wait in the picker, per priority band and per flow (the fairness id: header
    ``x-llm-d-inference-fairness-id``, or its alias ``x-gateway-inference-fairness-id``; no header: one
    ``default-flow``), while its saturation detector says the pool is full; a band's flows take turns
    (:data:`LLMD_FAIRNESS_POLICY`); a request that waited ``ttl_seconds`` is refused 429 with
    ``x-llm-d-request-dropped-reason: rejected-ttl-expired`` (503 with no endpoint). The detector is its
    ``utilization-detector`` (its default), which calls the pool saturated when the mean over engines of
    max(waiting / ``queue_depth``, KV usage / 0.8) from their scraped metrics reaches 1 (its default depth
    is 5); or, with ``max_concurrency``, its ``concurrency-detector``, which counts the requests it sent
    and has not seen answered against that many per engine (its docs: it "reacts instantaneously to new
    requests, preventing sudden bursts from overwhelming an endpoint before telemetry updates")."""
    if max_concurrency is None:
        detector = {"type": "utilization-detector", "parameters": {"queueDepthThreshold": queue_depth}}
    else:
        detector = {
            "type": "concurrency-detector",
            "parameters": {"concurrencyMode": "requests", "maxConcurrency": max_concurrency},
        }
    profile = yaml.safe_load(LLMD_DEFAULT_PROFILE)
    profile["featureGates"] = ["flowControl"]
    profile["plugins"] += [{"type": LLMD_FAIRNESS_POLICY}, detector]
    profile["flowControl"] = {
        "defaultRequestTTL": f"{ttl_seconds:g}s",
        "saturationDetector": {"pluginRef": detector["type"]},
        "defaultPriorityBand": {"priority": 0, "fairnessPolicyRef": LLMD_FAIRNESS_POLICY},
    }
    return yaml.safe_dump(profile, sort_keys=False)


def llmd_epp_binary() -> Path | None:
    """The llm-d router's ``epp`` named by :data:`LLMD_EPP_ENV`, or None when it is unset or missing."""
    named = os.environ.get(LLMD_EPP_ENV, "")
    return Path(named) if named and Path(named).is_file() else None


class LlmdRouterEpp(UpstreamEpp):
    """llm-d's router (``llm-d/llm-d-router``, ``cmd/epp``, the Inference Extension's picker since August
    2026) serving InferencePool ``namespace/pool``: the same flags as the EPP v1.5.0 it grew from (its
    ``pkg/epp/server/options.go``), with a scheduling profile given as ``--config-text``
    (:data:`LLMD_DEFAULT_PROFILE` unless ``config`` names another). It is not built by ``make install``
    (see :data:`LLMD_EPP_ENV`)."""

    log_name = "llmd-router.log"

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        pool: str,
        workdir: Path,
        *,
        config: str = LLMD_DEFAULT_PROFILE,
        extra_args: Sequence[str] = (),
        binary: Path | None = None,
    ) -> None:
        super().__init__(
            kubeconfig,
            namespace,
            pool,
            workdir,
            extra_args=[f"--config-text={config}", *extra_args],
            binary=binary,
        )

    @property
    def version(self) -> str:
        return LLMD_ROUTER_COMMIT[:12]

    @property
    def label(self) -> str:
        return f"llm-d's router ({LLMD_ROUTER_COMMIT[:12]})"

    @staticmethod
    def default_binary() -> Path:
        found = llmd_epp_binary()
        if found is None:
            raise RuntimeError(f"llm-d's router is not built: set {LLMD_EPP_ENV} to its epp binary")
        return found


#: llm-d's precise prefix-cache profile as its docs configure it for vLLM
#: (``deploy/config/epp-precise-prefix-cache-config.yaml`` at the commit above): the token producer's
#: ``vllm`` backend tokenizes through a ``vllm launch render`` sidecar (``{render_url}``, serving
#: ``{model}``); the precise producer subscribes to each Pod's KV events at ``tcp://<PodIP>:{kv_port}``
#: (the endpoint-notification source tells it the Pods) and keys blocks of ``{block_size}`` tokens (the
#: engines' block size: 128 for vLLM's CPU build) seeded with ``{hash_seed}`` (the engines'
#: ``PYTHONHASHSEED``); the prefix-cache scorer reads its matches. Fill it with
#: :func:`llmd_precise_profile`.
LLMD_PRECISE_PROFILE = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-producer
  parameters:
    modelName: {model}
    vllm:
      url: {render_url}
- type: endpoint-notification-source
- type: metrics-data-source
- type: core-metrics-extractor
- type: single-profile-handler
- type: decode-filter
- type: precise-prefix-cache-producer
  parameters:
    tokenProcessorConfig:
      blockSizeTokens: {block_size}
      hashSeed: "{hash_seed}"
    indexerConfig:
      kvBlockIndexConfig:
        enableMetrics: true
    kvEventsConfig:
      topicFilter: "kv@"
      discoverPods: true
      podDiscoveryConfig:
        socketPort: {kv_port}
- type: prefix-cache-scorer
  parameters:
    prefixMatchInfoProducerName: precise-prefix-cache-producer
- type: kv-cache-utilization-scorer
- type: queue-scorer
- type: max-score-picker
dataLayer:
  sources:
  - pluginRef: metrics-data-source
    extractors:
    - pluginRef: core-metrics-extractor
  - pluginRef: endpoint-notification-source
    extractors:
    - pluginRef: precise-prefix-cache-producer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: decode-filter
  - pluginRef: prefix-cache-scorer
    weight: 2.0
  - pluginRef: kv-cache-utilization-scorer
    weight: 1.0
  - pluginRef: queue-scorer
    weight: 1.0
  - pluginRef: max-score-picker
"""
#: Its Prometheus counters that show the precise scorer works from the engines' events, not a fallback.
LLMD_EVENTS_RECEIVED = "llm_d_epp_kv_cache_events_messages_received_total"
LLMD_INDEX_ADMISSIONS = "llm_d_epp_kv_cache_index_admissions_total"
LLMD_LOOKUP_HITS = "llm_d_epp_kv_cache_index_lookup_hits_total"


def llmd_precise_profile(
    model: str, render_url: str, kv_port: int, block_size: int = 128, hash_seed: str = "0"
) -> str:
    """:data:`LLMD_PRECISE_PROFILE` for engines serving ``model`` that publish KV events on ``kv_port``."""
    return LLMD_PRECISE_PROFILE.format(
        model=model, render_url=render_url, kv_port=kv_port, block_size=block_size, hash_seed=hash_seed
    )


class LlmdPreciseEpp(LlmdRouterEpp):
    """llm-d's router with its precise prefix-cache profile and its render sidecar: :meth:`start` starts
    ``vllm launch render`` (:class:`~vllm_stack_dev.testbed.render.RenderServer`, the model's local
    directory) and then the picker; :meth:`stop` stops both, each by its PID. The engines must publish
    their KV events on ``kv_port`` of their own Pod IP (``engines.launch(kv_events_port=...)``)."""

    log_name = "llmd-router-precise.log"

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        pool: str,
        workdir: Path,
        *,
        model: str,
        model_dir: Path,
        kv_port: int,
        block_size: int = 128,
        max_model_len: int = 4096,
        binary: Path | None = None,
    ) -> None:
        from vllm_stack_dev.testbed.render import RenderServer

        self.render = RenderServer(model_dir, model, workdir, max_model_len=max_model_len)
        profile = llmd_precise_profile(model, self.render.url, kv_port, block_size)
        super().__init__(kubeconfig, namespace, pool, workdir, config=profile, binary=binary)

    @property
    def label(self) -> str:
        return f"llm-d's router, precise profile ({LLMD_ROUTER_COMMIT[:12]})"

    def start(self, timeout: float = 60.0, ready_endpoints: int | None = None) -> LlmdPreciseEpp:
        self.render.start()
        try:
            super().start(timeout, ready_endpoints)
        except BaseException:
            self.render.stop()
            raise
        return self

    def counter(self, name: str) -> float:
        """The sum of counter ``name`` over its labels in its /metrics (0 when absent)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def event_counts(self) -> dict[str, float]:
        """KV-event messages received, blocks admitted to its index and prefix blocks matched on lookups
        so far (all 0, or None when it does not answer: then it scored without the engines' events)."""
        names = {
            "events": LLMD_EVENTS_RECEIVED,
            "admissions": LLMD_INDEX_ADMISSIONS,
            "hits": LLMD_LOOKUP_HITS,
        }
        try:
            return {key: self.counter(name) for key, name in names.items()}
        except OSError:
            return {}

    def stop(self) -> None:
        super().stop()
        self.render.stop()
