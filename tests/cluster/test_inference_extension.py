"""The Gateway API Inference Extension, against its own upstream endpoint picker and real engines.

One InferencePool on the test cluster's real API server: two engine Pods (kwok reports them Ready at
loopback IPs; the test bed starts a real vLLM engine at each Pod's IP, vllm_stack_dev.cluster.
pod_processes), the pool selecting them on port 8000, and a ServiceAccount whose Role allows what an
endpoint picker reads (pods, inferencepools, inferenceobjectives). The pickers read the pool from the
API server with that account's token:
- the upstream EPP v1.5.0 (vllm_stack_dev.testbed.upstream_epp: the real binary, default configuration);
- the 1.6 line's lightweight reference picker, lwepp v1.6.2 (the same module's ``cmd/lwepp``, the real
  binary: round-robin over the pool's Ready Pods, nothing else), a second upstream peer in 1. only;
- ours, ``vllm-stack router --ext-proc-port P --service-discovery k8s --inference-pool NAME``;
- llm-d's router (``llm-d/llm-d-router`` ``cmd/epp``, where the Inference Extension's picker lives since
  August 2026), an optional peer: its binary is named by ``VLLM_STACK_LLMD_EPP`` (benchmarks/routing/
  llmd.md); without it its tests skip. Our gateway mode serves on the engines it names, and its answers
  are compared with the EPP v1.5.0's and ours (docs/inference-extension.md lists the differences).

What is shown:
1. conformance: one Envoy-like driver (vllm_stack_dev.testbed.extproc_driver) sends every picker the same
   messages (request headers, the body in chunks, then the engine's real answer's headers and body in
   chunks) and the answers are compared: message kinds and order, header keys, metadata keys, the body
   sent back, and errors (ImmediateResponse statuses); where they differ, the test says how, so a
   change on any side shows. Endpoints are not compared, only that each is one of the pool's;
2. our gateway mode drives the upstream EPP: a router with ``--endpoint-picker`` serves completions on
   the engines the upstream EPP names (its log's "Request handled" record per x-request-id), counted
   under ``outcome="picked"``;
3. an InferenceObjective read by our picker through its watch: priority -1 (sheddable) reaches the
   request (the body's vLLM ``priority`` for a model whose engines schedule by it), changes with the
   object and goes with it; the upstream EPP reads the same object (its log, and its admission answer).

The differences found between the two pickers, each asserted below (v1.5.0 against this router):
- an answer that is not streamed: the upstream EPP holds its chunks and sends one response_body at the
  end; ours passes each chunk back as it comes (a streamed answer: each chunk back from both);
- the request headers' answer echoes the client's ``authorization`` from the upstream EPP, not from ours;
- the ``envoy.lb`` metadata lists the pick alone (upstream) or the pick then a fallback (ours);
- the body sent back: re-serialised by the upstream EPP (keys sorted, compact), the client's bytes from
  ours; both JSON-equal to what was sent, each with its own Content-Length;
- refusals: the same statuses (503 no candidate, 400 not JSON), but the upstream EPP's ImmediateResponse
  has no headers and a text body ("inference error: ..."), ours an OpenAI-style JSON error with
  content-type, x-vllm-stack-error (and retry-after on a 503); a model no engine serves: picked by the
  upstream EPP (it does not know the pool's models), 404 from ours; a sheddable request with no
  candidate: 429 upstream (its admission runs first), 503 from ours;
- a subset hint is matched on the IP alone by the upstream EPP (an endpoint's IP with another port still
  selects it), on ``ip:port`` by ours (a bare IP, not tested here, allows every port).

lwepp v1.6.2 against both (it agrees with all: the kinds on the request path, request_headers then one
request_body with eos; ``clear_route_cache``; the ``envoy.lb`` metadata namespace and key, on the first
answer only; the response headers echoed with ``x-went-into-resp-headers``; a GET answered at once; a
subset of one endpoint honoured):
- every response_body chunk back as it comes, streamed answer or not (as ours; the upstream EPP holds an
  answer that is not streamed);
- the request headers' answer sets the destination and ``X-Echo-Set-Header``
  (``x-conformance-test-served-endpoint:<endpoint>``, for the conformance suite's echo backend), nothing
  else: no Content-Length, no request header echoed;
- the ``envoy.lb`` metadata lists the pick alone (as the upstream EPP);
- the body sent back is the client's bytes (as ours): it parses nothing, so a body that is not JSON and a
  model no engine serves are both picked for (the upstream EPP picks the latter too);
- the response headers' answer adds ``x-conformance-test-served-endpoint``: the served endpoint from the
  gateway's response metadata, which this driver does not send ("fail: missing envoy lb metadata");
- no candidate (an empty subset, a subset outside the pool) is not an ImmediateResponse: the stream ends
  with gRPC status INTERNAL ("no endpoints available"), which a gateway turns into its own error;
- a subset hint is matched on ``ip:port`` (a bare IP, by its source, allows every port), as by ours.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import pytest
from vllm_stack_dev.cluster.control_plane import Cluster, tool_env
from vllm_stack_dev.cluster.pod_processes import COMPONENT, ENGINE_COMPONENT, PodProcesses
from vllm_stack_dev.paths import repo_root
from vllm_stack_dev.testbed.engines import Engine, port_for_later, spawn_logged, stop_group
from vllm_stack_dev.testbed.extproc_driver import Exchange, exchange
from vllm_stack_dev.testbed.upstream_epp import (
    LLMD_EPP_ENV,
    LightweightEpp,
    LlmdPreciseEpp,
    LlmdRouterEpp,
    UpstreamEpp,
    llmd_epp_binary,
    llmd_flow_control_profile,
)
from vllm_stack_dev.waiting import wait_http_ok

from tests.cluster.serving import wait_for
from tests.conftest import CHAT_MODEL, READY_TIMEOUT

pytestmark = pytest.mark.cluster

NAMESPACE = "inference-extension"
POOL = "tiny-pool"
SELECTOR = {"app": "tiny-pool"}
ENGINE_PORT = 8000
KV_EVENTS_PORT = 5557  # llm-d's default socketPort: it dials tcp://<PodIP>:5557 for each Pod
BLOCK_SIZE = 128  # vLLM's CPU KV block size (FACTS.md); llm-d's precise producer keys blocks of as many
ACCOUNT = "picker"
READ = ["get", "list", "watch"]
PICKER_RULES = [
    {"apiGroups": [""], "resources": ["pods"], "verbs": READ},
    {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": READ},
    {
        "apiGroups": ["inference.networking.x-k8s.io"],
        "resources": ["inferenceobjectives", "inferencemodelrewrites"],
        "verbs": READ,
    },
]
OBJECTIVE_HEADER = "x-gateway-inference-objective"
DESTINATION = "x-gateway-destination-endpoint"
PROMPT = "The quick brown fox jumps over the lazy dog, then sleeps in the warm afternoon sun."


# ---- the pool -----------------------------------------------------------------------------------------
def _kv_events_config(pod: str) -> dict[str, Any]:
    """The engine's KV events as llm-d's guides deploy vLLM for its precise profile: a ZMQ publisher on
    every interface at one port (the test bed binds it at the Pod's own IP), topic ``kv@<pod>@<model>``."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{KV_EVENTS_PORT}",
        "topic": f"kv@{pod}@{CHAT_MODEL}",
    }


def _objects() -> list[dict[str, Any]]:
    meta = {"namespace": NAMESPACE}
    pods = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {**meta, "name": f"tiny-{i}", "labels": {**SELECTOR, COMPONENT: ENGINE_COMPONENT}},
            "spec": {
                "containers": [
                    {
                        "name": "vllm",
                        "image": "vllm/vllm-openai:v0.11.0",
                        "command": ["vllm", "serve", CHAT_MODEL],
                        "args": ["--kv-events-config", json.dumps(_kv_events_config(f"tiny-{i}"))],
                        "ports": [{"name": "http", "containerPort": ENGINE_PORT}],
                    }
                ]
            },
        }
        for i in range(2)
    ]
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {**meta, "name": ACCOUNT}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {**meta, "name": ACCOUNT},
         "rules": PICKER_RULES},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {**meta, "name": ACCOUNT},
         "subjects": [{"kind": "ServiceAccount", "name": ACCOUNT, "namespace": NAMESPACE}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ACCOUNT}},
        {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {**meta, "name": POOL},
         "spec": {"selector": {"matchLabels": SELECTOR}, "targetPorts": [{"number": ENGINE_PORT}],
                  "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}},
        *pods,
    ]  # fmt: skip


def _alive(engine: Engine) -> bool:
    if not engine.is_running():
        raise AssertionError(f"engine {engine.name} exited: {engine.log_tail()}")
    return True


@dataclass
class Pool:
    cluster: Cluster
    pods: PodProcesses
    kubeconfig: Path
    work: Path
    endpoints: dict[str, str]  # Pod name -> podIP:port, what a picker names

    def successes(self) -> dict[str, float]:
        """Requests each engine finished (by endpoint), from its own /metrics."""
        return {
            self.endpoints[name]: engine.metric_value("vllm:request_success_total")
            for name, engine in self.pods.live_engines().items()
        }


@pytest.fixture(scope="module")
def pool(
    cluster: Cluster, tiny_model_dir: Path, engine_logs_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pool]:
    work = tmp_path_factory.mktemp("inference-extension")
    cluster.apply(_objects())
    kubeconfig = cluster.service_account_kubeconfig(NAMESPACE, ACCOUNT, work / "picker.kubeconfig")
    pods = PodProcesses(cluster, NAMESPACE, [], model_dir=tiny_model_dir, workdir=work / "pods",
                        log_dir=engine_logs_dir)  # fmt: skip
    try:
        with pods, pods.follow():
            wait_for(lambda: pods.check() or len(pods.engines) == 2, 60, "both engine Pods' engines started")
            for name, engine in pods.live_engines().items():
                wait_for(lambda e=engine: _alive(e) and e.is_ready(), READY_TIMEOUT, f"{name}'s engine ready")
            endpoints = {p["metadata"]["name"]: f"{p['status']['podIP']}:{ENGINE_PORT}" for p in pods.pods()}
            assert all(e.startswith("127.") for e in endpoints.values())  # loopback only
            yield Pool(cluster, pods, kubeconfig, work, endpoints)
    finally:
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


# ---- the two pickers and a gateway ------------------------------------------------------------------
class OurRouter:
    """``vllm-stack router`` as a process with the pool's ServiceAccount (its picker or its gateway)."""

    def __init__(self, pool: Pool, name: str, *args: str) -> None:
        self.port = port_for_later()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = pool.work / f"{name}.log"
        command = [
            sys.executable, "-m", "vllm_stack.cli", "router", "--host", "127.0.0.1", "--port", str(self.port),
            "--service-discovery", "k8s", "--k8s-namespace", NAMESPACE, "--inference-pool", POOL,
            "--health-check-interval", "1", *args,
        ]  # fmt: skip
        env = {**tool_env(), "KUBECONFIG": str(pool.kubeconfig)}
        self.process = spawn_logged(command, self.log, env, cwd=repo_root())
        self.client = httpx.Client(base_url=self.url, timeout=60)
        try:
            wait_http_ok(f"{self.url}/health", 60, self.process)
            wanted = set(pool.endpoints)
            wait_for(lambda: self.routable() == wanted, 60, f"{name} routes to both of the pool's engines")
        except BaseException:
            self.stop()
            raise

    def routable(self) -> set[str]:
        if self.process.poll() is not None:
            raise AssertionError(f"the router exited ({self.process.returncode}): {self.log_tail()}")
        engines = self.client.get("/engines", timeout=5).json()["engines"]
        return {e["name"] for e in engines if e["healthy"] and CHAT_MODEL in e["models"]}

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
        total = 0.0
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        for line in self.client.get("/metrics", timeout=5).text.splitlines():
            if line.startswith((name + "{", name + " ")) and all(w in line for w in wanted):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def stop(self) -> None:
        self.client.close()
        stop_group(self.process)


class OurEpp(OurRouter):
    def __init__(self, pool: Pool, name: str, *args: str) -> None:
        self.ext_proc_port = port_for_later()
        super().__init__(pool, name, "--ext-proc-port", str(self.ext_proc_port), *args)
        self.target = f"127.0.0.1:{self.ext_proc_port}"


Picker = TypeVar("Picker", bound=UpstreamEpp)


def _serving(epp: Picker) -> Iterator[Picker]:
    """An upstream picker started and ready with both of the pool's endpoints; stopped after the module."""
    epp.start(timeout=60, ready_endpoints=2)
    try:
        yield epp
    finally:
        epp.stop()


@pytest.fixture(scope="module")
def upstream(pool: Pool) -> Iterator[UpstreamEpp]:
    yield from _serving(UpstreamEpp(pool.kubeconfig, NAMESPACE, POOL, pool.work / "upstream-epp"))


@pytest.fixture(scope="module")
def lightweight(pool: Pool) -> Iterator[LightweightEpp]:
    yield from _serving(LightweightEpp(pool.kubeconfig, NAMESPACE, POOL, pool.work / "lwepp"))


#: llm-d's router is an optional peer: its binary is there only where one was built (CI has none).
needs_llmd = pytest.mark.skipif(
    llmd_epp_binary() is None,
    reason=f"llm-d's router is not built here ({LLMD_EPP_ENV} unset; see benchmarks/routing/llmd.md)",
)


@pytest.fixture(scope="module")
def llmd(pool: Pool) -> Iterator[LlmdRouterEpp]:
    """llm-d's router with its default profile (the tests that use it are marked :data:`needs_llmd`)."""
    yield from _serving(LlmdRouterEpp(pool.kubeconfig, NAMESPACE, POOL, pool.work / "llmd-router"))


@pytest.fixture(scope="module")
def llmd_precise(pool: Pool, tiny_model_dir: Path) -> Iterator[LlmdPreciseEpp]:
    """llm-d's router with its precise prefix-cache profile: its ``vllm launch render`` sidecar over the
    tiny model, subscribed to each Pod's KV events at ``tcp://<PodIP>:5557``."""
    epp = LlmdPreciseEpp(
        pool.kubeconfig, NAMESPACE, POOL, pool.work / "llmd-precise", model=CHAT_MODEL,
        model_dir=tiny_model_dir, kv_port=KV_EVENTS_PORT, block_size=BLOCK_SIZE, max_model_len=2048,
    )  # fmt: skip
    yield from _serving(epp)


@pytest.fixture(scope="module")
def ours(pool: Pool) -> Iterator[OurEpp]:
    epp = OurEpp(pool, "our-epp")
    try:
        yield epp
    finally:
        epp.stop()


# ---- driving ----------------------------------------------------------------------------------------
def drive(target: str, headers: list[tuple[str, str]], body: bytes, **options: Any) -> Exchange:
    return asyncio.run(exchange(target, headers, body, **options))


def stream_error(target: str, headers: list[tuple[str, str]], body: bytes, **options: Any) -> grpc.StatusCode:
    """The gRPC status a picker ends the stream with instead of answering (lwepp with no candidate)."""
    with pytest.raises(grpc.aio.AioRpcError) as failed:
        drive(target, headers, body, **options)
    return failed.value.code()


def raw_keys(ex: Exchange, kind: str) -> list[str]:
    """The set_headers keys of the ``kind`` answer as written (case kept), sorted."""
    common = getattr(ex.first(kind), kind).response
    return sorted(o.header.key for o in common.header_mutation.set_headers)


def lb_endpoints(ex: Exchange) -> list[str]:
    answer = ex.first("request_headers")
    listed = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value
    return listed.split(",")


def immediate(ex: Exchange) -> tuple[int, bytes, list[str]]:
    """(status, body, header keys) of the one ImmediateResponse ``ex`` got."""
    assert ex.kinds == ["immediate_response"], ex.kinds
    answer = ex.answers[0].immediate_response
    return answer.status.code, answer.body, sorted(o.header.key for o in answer.headers.set_headers)


def request_headers(body: bytes, request_id: str, *extra: tuple[str, str]) -> list[tuple[str, str]]:
    """What Envoy sends for a POST to /v1/completions (plus a header of the client's own, and its key)."""
    return [
        (":method", "POST"), (":path", "/v1/completions"), (":authority", "gateway.example"),
        (":scheme", "http"), ("content-type", "application/json"), ("content-length", str(len(body))),
        ("x-request-id", request_id), ("hi", "mom"), ("authorization", "Bearer client-key"), *extra,
    ]  # fmt: skip


def engine_answer(pool: Pool, request: dict[str, Any]) -> tuple[list[tuple[str, str]], list[bytes]]:
    """A real engine's answer to ``request`` (its status, content type and body in three chunks): what a
    gateway relays through the picker after the pick."""
    (engine, *_) = pool.pods.live_engines().values()
    answer = httpx.post(f"{engine.url}/v1/completions", json=request, timeout=60)
    assert answer.status_code == 200, answer.text
    data = answer.content
    third = len(data) // 3
    headers = [(":status", "200"), ("content-type", answer.headers["content-type"]), ("x-served-by", "vllm")]
    return headers, [data[:third], data[third : 2 * third], data[2 * third :]]


REQUEST_KINDS = ["request_headers", "request_body"]
#: lwepp's mark on the request headers' answer: a header its conformance backend echoes, naming the pick.
ECHO_SET_HEADER = "X-Echo-Set-Header"
SERVED_HEADER = "x-conformance-test-served-endpoint"


@pytest.mark.parametrize("stream", [False, True], ids=["buffered-answer", "streamed-answer"])
def test_the_pickers_answer_the_same_messages_with_the_same_keys(
    pool: Pool, upstream: UpstreamEpp, lightweight: LightweightEpp, ours: OurEpp, stream: bool
) -> None:
    """The same messages to each, a real engine's answer relayed after the pick (streamed or not)."""
    request = {"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": stream}
    body = json.dumps(request).encode()  # with spaces, as a client may send it
    response = engine_answer(pool, request)
    sent_answer = b"".join(response[1])
    answers = {}
    pickers = (("upstream", upstream.target), ("lwepp", lightweight.target), ("ours", ours.target))
    for name, target in pickers:
        rid = f"conformance-{name}-{uuid.uuid4()}"
        answers[name] = ex = drive(target, request_headers(body, rid), body, chunk=16, response=response)
        assert ex.kinds[:2] == REQUEST_KINDS, (name, ex.kinds)
        assert ex.endpoint in pool.endpoints.values(), (name, ex.endpoint)
        assert ex.header("request_headers", DESTINATION) == ex.endpoint
        assert ex.first("request_headers").request_headers.response.clear_route_cache
        # each that changes the body says the length of the body it sends back (lwepp sends the
        # client's bytes and leaves the client's Content-Length as it was)
        length = ex.header("request_headers", "content-length")
        assert length == (None if name == "lwepp" else str(len(ex.body("request_body")))), name
        assert json.loads(ex.body("request_body")) == request, name
        assert ex.header("response_headers", "x-went-into-resp-headers") == "true", name
        assert ex.body("response_body") == sent_answer, name
        assert all(e in pool.endpoints.values() for e in lb_endpoints(ex)), name
        assert lb_endpoints(ex)[0] == ex.endpoint
    up, lw, our = answers["upstream"], answers["lwepp"], answers["ours"]

    # Message kinds. A streamed answer: each chunk back as it comes, from all. An answer that is not
    # streamed: the upstream EPP holds the chunks and sends the whole body once at its end; lwepp and
    # ours pass each chunk back as it comes (same bytes joined).
    chunk_by_chunk = [*REQUEST_KINDS, "response_headers", *["response_body"] * 3]
    if stream:
        assert up.kinds == lw.kinds == our.kinds == chunk_by_chunk
    else:
        assert up.kinds == [*REQUEST_KINDS, "response_headers", "response_body"]
        assert lw.kinds == our.kinds == chunk_by_chunk

    # Header keys. The request headers' answer: the destination and Content-Length (that very spelling,
    # from both), then every request header echoed back but the system-owned ones (content-length
    # included). One difference: the client's `authorization` is echoed by the upstream EPP and not by
    # ours (the engine gets the router's own engine key, if one is set, never the client's).
    echoed = {":method", ":path", ":authority", ":scheme", "content-type", "x-request-id", "hi"}
    assert set(our.set_header_keys("request_headers")) == {DESTINATION, "content-length", *echoed}
    assert set(up.set_header_keys("request_headers")) == {
        DESTINATION,
        "content-length",
        *echoed,
        "authorization",
    }
    assert "Content-Length" in raw_keys(up, "request_headers") and "Content-Length" in raw_keys(
        our, "request_headers"
    )
    # lwepp: the destination and its echo mark (that spelling), nothing echoed, no Content-Length
    assert raw_keys(lw, "request_headers") == [ECHO_SET_HEADER, DESTINATION]
    assert lw.header("request_headers", ECHO_SET_HEADER.lower()) == f"{SERVED_HEADER}:{lw.endpoint}"
    # the response headers' answer: the mark, and the response headers echoed (":status" included);
    # lwepp adds the served endpoint it reads from the gateway's response metadata (none sent here)
    echoed_response = ["x-went-into-resp-headers", ":status", "content-type", "x-served-by"]
    assert up.set_header_keys("response_headers") == our.set_header_keys("response_headers") == sorted(
        echoed_response
    )  # fmt: skip
    assert lw.set_header_keys("response_headers") == sorted([*echoed_response, SERVED_HEADER])
    assert lw.header("response_headers", SERVED_HEADER) == "fail: missing envoy lb metadata"

    # Dynamic metadata: the same namespace and key; the upstream EPP and lwepp list the one pick, ours
    # the pick and the other engine as a fallback.
    assert up.metadata_keys() == lw.metadata_keys() == our.metadata_keys() == {"envoy.lb": [DESTINATION]}
    assert len(lb_endpoints(up)) == len(lb_endpoints(lw)) == 1
    assert len(lb_endpoints(our)) == 2 and set(lb_endpoints(our)) == set(pool.endpoints.values())
    assert not any(a.HasField("dynamic_metadata") for a in up.answers[1:] + lw.answers[1:] + our.answers[1:])

    # The body sent back: the same JSON. The upstream EPP re-serialises it (Go's encoding: keys sorted,
    # no spaces); lwepp and ours send the client's bytes unchanged.
    assert our.body("request_body") == lw.body("request_body") == body
    assert up.body("request_body") == json.dumps(request, sort_keys=True, separators=(",", ":")).encode()


def test_the_pickers_refuse_and_route_headers_only_requests_alike(
    pool: Pool, upstream: UpstreamEpp, lightweight: LightweightEpp, ours: OurEpp
) -> None:
    """The cases beside a plain pick, each from every picker: what is the same, and what differs."""
    request = {"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 4}
    body = json.dumps(request).encode()
    bad = b'{"model": "tiny'
    other = json.dumps({**request, "model": "no-such-model"}).encode()
    first = sorted(pool.endpoints.values())[0]
    other_port = first.rpartition(":")[0] + ":9999"
    refusals = {  # no candidate: an empty subset hint, one outside the pool; a body that is not JSON
        "empty subset": (body, {"subset": []}),
        "foreign subset": (body, {"subset": ["10.1.2.3:8000"]}),
        "bad json": (bad, {}),
    }
    results: dict[str, dict[str, Any]] = {"upstream": {}, "lwepp": {}, "ours": {}}
    for name, target in (("upstream", upstream.target), ("lwepp", lightweight.target), ("ours", ours.target)):
        got = results[name]
        for case, (sent, options) in refusals.items():
            headers = request_headers(sent, f"{case.replace(' ', '-')}-{name}")
            if name == "lwepp" and case != "bad json":
                got[case] = stream_error(target, headers, sent, **options)
            elif name == "lwepp":
                got[case] = drive(target, headers, sent, **options)
            else:
                got[case] = immediate(drive(target, headers, sent, **options))
        # a model no engine of the pool serves
        got["unknown model"] = drive(target, request_headers(other, f"unknown-{name}"), other)
        # a subset of one of the pool's endpoints; and that endpoint's IP with another port
        got["one endpoint"] = drive(target, request_headers(body, f"one-{name}"), body, subset=[first])
        headers = request_headers(body, f"port-{name}")
        if name == "lwepp":
            got["other port"] = stream_error(target, headers, body, subset=[other_port])
        else:
            got["other port"] = drive(target, headers, body, subset=[other_port])
        # a request without a body (a GET): an endpoint at once, from the request headers alone
        get = [
            (":method", "GET"),
            (":path", "/v1/models"),
            (":authority", "gw"),
            ("x-request-id", f"get-{name}"),
        ]
        got["get"] = drive(target, get, b"")
    up, lw, our = results["upstream"], results["lwepp"], results["ours"]

    # no candidate: 503 from the upstream EPP and ours; the upstream EPP's body is its "inference
    # error: ..." text, ours OpenAI JSON. lwepp sends no ImmediateResponse: the stream fails (INTERNAL).
    for case in ("empty subset", "foreign subset"):
        assert up[case][0] == our[case][0] == 503, case
        assert up[case][1].startswith(b"inference error: ServiceUnavailable"), up[case][1]
        assert json.loads(our[case][1])["error"]["code"], our[case][1]
        assert lw[case] == grpc.StatusCode.INTERNAL, case
    # the refusal's headers: none from the upstream EPP; ours says the body's type and marks the error
    # as the router's own (x-vllm-stack-error), as its own answers do, with retry-after on a 503
    for case in ("empty subset", "foreign subset", "bad json"):
        assert up[case][2] == [], case
        retry = ["retry-after"] if our[case][0] == 503 else []
        assert our[case][2] == sorted(["content-type", "x-vllm-stack-error", *retry]), case
    # not JSON: 400 from the upstream EPP and ours; lwepp does not read the body: it picks, and sends
    # the bytes back as they came
    assert up["bad json"][0] == our["bad json"][0] == 400
    assert up["bad json"][1].startswith(b"inference error: BadRequest")
    assert lw["bad json"].kinds == REQUEST_KINDS and lw["bad json"].endpoint in pool.endpoints.values()
    assert lw["bad json"].body("request_body") == bad
    # an unknown model: the upstream EPP and lwepp do not know the pool's models and pick an endpoint;
    # ours answers 404 model_not_found (the router knows what each engine serves)
    for name, ex in (("upstream", up["unknown model"]), ("lwepp", lw["unknown model"])):
        assert ex.kinds == REQUEST_KINDS, name
        assert ex.endpoint in pool.endpoints.values(), name
    status, refusal, _ = immediate(our["unknown model"])
    assert status == 404 and json.loads(refusal)["error"]["code"] == "model_not_found"
    # a subset of one endpoint: that endpoint, from all
    for name, got in results.items():
        assert got["one endpoint"].kinds == REQUEST_KINDS, name
        assert got["one endpoint"].endpoint == first, name
    # the endpoint's IP with another port: the upstream EPP matches the IP alone and picks the endpoint;
    # ours and lwepp match ip:port and have no candidate (503; lwepp's stream fails)
    assert up["other port"].kinds == REQUEST_KINDS and up["other port"].endpoint == first
    assert immediate(our["other port"])[0] == 503
    assert lw["other port"] == grpc.StatusCode.INTERNAL
    # a GET: the headers' answer only, at once, naming one of the pool's endpoints, with nothing echoed;
    # lwepp adds its echo mark
    for name, got in results.items():
        ex = got["get"]
        assert ex.kinds == ["request_headers"], name
        assert ex.endpoint in pool.endpoints.values(), name
        mark = [ECHO_SET_HEADER.lower()] if name == "lwepp" else []
        assert ex.set_header_keys("request_headers") == sorted([DESTINATION, *mark]), name
        assert ex.metadata_keys() == {"envoy.lb": [DESTINATION]}, name


def test_our_gateway_mode_serves_on_the_engines_the_upstream_epp_names(
    pool: Pool, upstream: UpstreamEpp
) -> None:
    """Completions and chat completions through a router in gateway mode over the pool's Pods, each one
    served by the engine the upstream EPP named for its x-request-id (fail-closed: no local fallback)."""
    _serves_where_named(pool, upstream)


@needs_llmd
def test_our_gateway_mode_serves_on_the_engines_llmd_router_names(pool: Pool, llmd: LlmdRouterEpp) -> None:
    """The same through llm-d's router (its default profile): real completions on the engines it names."""
    _serves_where_named(pool, llmd)


@needs_llmd
def test_llmd_precise_profile_serves_and_follows_the_engines_kv_events(
    pool: Pool, llmd_precise: LlmdPreciseEpp
) -> None:
    """llm-d's precise profile through our gateway mode: real completions on the engines it names, and its
    picks follow the engines' KV events. Three long prompts (several 128-token blocks), each sent once,
    then three times again: every repeat lands on the engine that served the first, which is 1 in 2**9
    by chance; and its own counters show it ingested the engines' events and matched blocks from them
    (a silent fallback to tokens it cannot match would leave them at 0)."""
    _serves_where_named(pool, llmd_precise)
    gateway = OurRouter(
        pool, "gateway-precise", "--endpoint-picker", f"grpc://{llmd_precise.target}",
        "--endpoint-picker-timeout", "10", "--no-endpoint-picker-fail-open", "--debug-headers",
    )  # fmt: skip

    def served_by(prompt: str) -> str:
        answer = gateway.client.post(
            "/v1/completions", json={"model": CHAT_MODEL, "prompt": prompt, "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens"] >= 3 * BLOCK_SIZE
        route = dict(part.split("=", 1) for part in answer.headers["x-vllm-stack-route"].split("; "))
        assert route["reason"] == "picked", route
        return route["engine"]

    try:
        for n in range(3):
            prompt = f"{uuid.uuid4()} " + " ".join([f"{PROMPT} Part {n}, line {j}." for j in range(20)])
            admitted = llmd_precise.event_counts()["admissions"]
            first = served_by(prompt)
            wait_for(
                lambda a=admitted: llmd_precise.event_counts()["admissions"] > a, 30,
                f"llm-d's index to admit the blocks of prompt {n} from {first}'s KV events",
            )  # fmt: skip
            assert [served_by(prompt) for _ in range(3)] == [first] * 3, f"prompt {n}: first on {first}"
        counts = llmd_precise.event_counts()
        assert counts["events"] > 0 and counts["hits"] >= 9 * 3, counts  # each repeat matched >= 3 blocks
    finally:
        gateway.stop()


@needs_llmd
def test_llmd_flow_control_holds_and_refuses_through_our_gateway(pool: Pool) -> None:
    """llm-d's router with its flow control on (``llmd_flow_control_profile``: its concurrency detector at
    one request in flight per engine, a request TTL of 2 s) behind our gateway: with both engines busy on a
    long stream each, a third request waits in its flow control and, past the TTL, the client gets its 429
    with ``x-llm-d-request-dropped-reason: rejected-ttl-expired`` (the gateway passes the refusal's
    headers on, as Envoy does); once the streams are done a request is served."""
    epp = LlmdRouterEpp(
        pool.kubeconfig, NAMESPACE, POOL, pool.work / "llmd-flow-control",
        config=llmd_flow_control_profile(ttl_seconds=2, max_concurrency=1),
    )  # fmt: skip
    epp.start(timeout=60, ready_endpoints=2)
    gateway = None
    try:
        gateway = OurRouter(
            pool, "gateway-flow-control", "--endpoint-picker", f"grpc://{epp.target}",
            "--endpoint-picker-timeout", "20", "--no-endpoint-picker-fail-open",
        )  # fmt: skip
        tenant = {LLMD_FAIRNESS_ID: "tenant-a"}
        long = {"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 1500, "min_tokens": 1500, "stream": True}
        started = [threading.Event(), threading.Event()]
        outcomes: list[int] = []

        def stream(n: int) -> None:
            with httpx.Client(base_url=gateway.url, timeout=120) as client:
                with client.stream("POST", "/v1/completions", json=long, headers=tenant) as answer:
                    for _ in answer.iter_lines():
                        started[n].set()
                    outcomes.append(answer.status_code)
            started[n].set()

        threads = [threading.Thread(target=stream, args=(n,), daemon=True) for n in range(2)]
        for n, thread in enumerate(threads):
            thread.start()
            assert started[n].wait(60), f"stream {n} never started"
        held = gateway.client.post(
            "/v1/completions", json={"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 4}, headers=tenant
        )
        assert held.status_code == 429, held.text
        assert held.headers[LLMD_DROPPED_REASON] == "rejected-ttl-expired"
        assert held.json()["error"]["code"] == "endpoint_picker_refused"
        assert threads[0].is_alive() or threads[1].is_alive(), (
            "the streams ended before the TTL: nothing was held"
        )
        for thread in threads:
            thread.join(120)
        assert outcomes == [200, 200]
        served = gateway.client.post(
            "/v1/completions", json={"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 4}, headers=tenant
        )
        assert served.status_code == 200, served.text
    finally:
        if gateway is not None:
            gateway.stop()
        epp.stop()


def _serves_where_named(pool: Pool, upstream: UpstreamEpp) -> None:
    """Six requests through a fail-closed gateway asking ``upstream``: each served by the engine that
    ``upstream``'s log names for its x-request-id, counted as picked, and counted by that engine."""
    gateway = OurRouter(
        pool, "gateway", "--endpoint-picker", f"grpc://{upstream.target}", "--endpoint-picker-timeout", "5",
        "--no-endpoint-picker-fail-open", "--debug-headers",
    )  # fmt: skip
    try:
        before = pool.successes()
        served: dict[str, str] = {}  # x-request-id -> the endpoint of the engine that answered
        requests = [("/v1/completions", {"prompt": f"{PROMPT} Number {i}."}) for i in range(4)] + [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Hello number {i}"}]})
            for i in range(2)
        ]
        for path, fields in requests:
            rid = f"gateway-{uuid.uuid4()}"
            answer = gateway.client.post(
                path, json={"model": CHAT_MODEL, "max_tokens": 3, **fields}, headers={"x-request-id": rid}
            )
            assert answer.status_code == 200, answer.text
            choice = answer.json()["choices"][0]
            text = choice["text"] if path == "/v1/completions" else choice["message"]["content"]
            assert isinstance(text, str) and answer.json()["usage"]["completion_tokens"] > 0
            route = dict(part.split("=", 1) for part in answer.headers["x-vllm-stack-route"].split("; "))
            assert route["profile"] == "endpoint-picker" and route["reason"] == "picked", route
            served[rid] = pool.endpoints[route["engine"]]
        named = wait_for(
            lambda: (h := upstream.handled()) and all(r in h for r in served) and h, 10,
            f"{upstream.label}'s record of every request",
        )  # fmt: skip
        assert {rid: named[rid] for rid in served} == served  # each went where the upstream EPP said
        assert gateway.metric("vllm_stack_router_endpoint_picker_requests_total", outcome="picked") == len(
            served
        )
        for outcome in ("immediate", "error", "timeout", "unknown_endpoint"):
            assert gateway.metric("vllm_stack_router_endpoint_picker_requests_total", outcome=outcome) == 0
        # ... and the engines themselves counted exactly those
        expected = Counter(served.values())
        wait_for(
            lambda: {e: n - before[e] for e, n in pool.successes().items() if n > before[e]} == expected, 30,
            f"the engines' own counts of the requests served ({dict(expected)})",
        )  # fmt: skip
    finally:
        gateway.stop()


def _objective(name: str, pool_name: str, priority: int) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"poolRef": {"name": pool_name}, "priority": priority},
    }


def test_an_inference_objective_reaches_our_picker_through_its_watch(
    pool: Pool, upstream: UpstreamEpp
) -> None:
    """Our picker, for a model whose engines schedule by priority (router setting ``models``), writes the
    request's priority into the body in vLLM's sense (negated): the body sent back shows the priority
    the request was given. The objective is created, changed and deleted while the picker runs."""
    config = pool.work / "priority-epp.yaml"
    config.write_text(json.dumps({"models": [{"name": CHAT_MODEL, "engine_priority": True}]}))
    picker = OurEpp(pool, "priority-epp", "--config", str(config))
    request = {"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 2}
    body = json.dumps(request).encode()

    def priority_sent(objective: str = "batch") -> object:
        """The body's ``priority`` our picker sends back for a request of ``objective`` ("none")."""
        headers = request_headers(body, f"objective-{uuid.uuid4()}", (OBJECTIVE_HEADER, objective))
        ex = drive(picker.target, headers, body)
        assert ex.kinds == REQUEST_KINDS, ex.kinds
        return json.loads(ex.body("request_body")).get("priority", "none")

    try:
        assert priority_sent() == "none"  # no such objective yet: the request's own priority, 0
        # created (with one for another pool, listed first: seen before it, and ignored)
        pool.cluster.apply([_objective("elsewhere", "another-pool", -5), _objective("batch", POOL, -1)])
        wait_for(
            lambda: priority_sent() == 1, 10, "priority -1 (sheddable) given to the objective's requests", 0.2
        )
        assert priority_sent("elsewhere") == "none"

        # the upstream EPP read it too: its log gives the request priority -1; and with no candidate,
        # its admission sheds a sheddable request (429) where a standard one gets 503
        def upstream_priority() -> object:
            rid = f"objective-upstream-{uuid.uuid4()}"
            drive(upstream.target, request_headers(body, rid, (OBJECTIVE_HEADER, "batch")), body)
            given = {
                r["priority"] for r in upstream.records() if r.get("x-request-id") == rid and "priority" in r
            }
            return given == {-1}

        wait_for(upstream_priority, 10, "the upstream EPP gives the objective's requests priority -1", 0.2)
        shed = drive(
            upstream.target,
            request_headers(body, f"shed-{uuid.uuid4()}", (OBJECTIVE_HEADER, "batch")),
            body,
            subset=[],
        )
        assert immediate(shed)[0] == 429
        # ours sheds a sheddable request when every engine is saturated or others of its priority wait;
        # none to choose from is 503 whatever the priority
        headers = request_headers(body, f"shed-{uuid.uuid4()}", (OBJECTIVE_HEADER, "batch"))
        ours_shed = drive(picker.target, headers, body, subset=[])
        assert immediate(ours_shed)[0] == 503
        # changed: critical now
        pool.cluster.apply([_objective("batch", POOL, 2)])
        wait_for(lambda: priority_sent() == -2, 10, "the objective's new priority followed", 0.2)
        # deleted: back to the request's own
        pool.cluster.kubectl("delete", "inferenceobjective", "batch", "elsewhere", "-n", NAMESPACE)
        wait_for(lambda: priority_sent() == "none", 10, "the deleted objective forgotten", 0.2)
    finally:
        picker.stop()
        pool.cluster.kubectl(
            "delete", "inferenceobjective", "--all", "-n", NAMESPACE, "--ignore-not-found", check=False
        )


#: What llm-d's router adds to a refusal for want of a candidate: why the request was dropped.
LLMD_DROPPED_REASON = "x-llm-d-request-dropped-reason"
LLMD_FAIRNESS_ID = "x-llm-d-inference-fairness-id"


@needs_llmd
@pytest.mark.parametrize("stream", [False, True], ids=["buffered-answer", "streamed-answer"])
def test_llmd_router_answers_as_the_epp_it_grew_from(
    pool: Pool, upstream: UpstreamEpp, llmd: LlmdRouterEpp, ours: OurEpp, stream: bool
) -> None:
    """llm-d's router against the EPP v1.5.0 and ours, the same messages to each (docs/inference-extension.md
    lists what differs). It answers as the EPP v1.5.0 does in message kinds (an answer that is not
    streamed held to its end), header keys (the client's ``authorization`` echoed), metadata (the pick
    alone); it differs in the body it sends back: the client's bytes, as ours, not re-serialised."""
    request = {"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": stream}
    body = json.dumps(request).encode()
    response = engine_answer(pool, request)
    answers = {}
    for name, target in (("upstream", upstream.target), ("llmd", llmd.target), ("ours", ours.target)):
        rid = f"llmd-conformance-{name}-{uuid.uuid4()}"
        answers[name] = ex = drive(target, request_headers(body, rid), body, chunk=16, response=response)
        assert ex.endpoint in pool.endpoints.values(), (name, ex.endpoint)
        assert ex.body("response_body") == b"".join(response[1]), name
    up, llmd_answer, our = answers["upstream"], answers["llmd"], answers["ours"]
    assert llmd_answer.kinds == up.kinds
    assert llmd_answer.header("request_headers", DESTINATION) == llmd_answer.endpoint
    for kind in ("request_headers", "response_headers"):
        assert raw_keys(llmd_answer, kind) == raw_keys(up, kind), kind
    assert "authorization" in llmd_answer.set_header_keys("request_headers")
    assert llmd_answer.metadata_keys() == up.metadata_keys() == {"envoy.lb": [DESTINATION]}
    assert lb_endpoints(llmd_answer) == [llmd_answer.endpoint]
    assert llmd_answer.body("request_body") == our.body("request_body") == body
    assert llmd_answer.header("request_headers", "content-length") == str(len(body))


@needs_llmd
def test_llmd_router_refuses_and_routes_headers_only_requests(
    pool: Pool, upstream: UpstreamEpp, llmd: LlmdRouterEpp
) -> None:
    """The cases beside a plain pick: as the EPP v1.5.0 (400 for a body that is not JSON, 503 with no
    candidate, each a text body; an unknown model picked for; a GET answered from its headers), plus one
    header on a refusal for want of a candidate: x-llm-d-request-dropped-reason."""
    request = {"model": CHAT_MODEL, "prompt": PROMPT, "max_tokens": 4}
    body = json.dumps(request).encode()
    other = json.dumps({**request, "model": "no-such-model"}).encode()
    bad = b'{"model": "tiny'
    got: dict[str, dict[str, Any]] = {}
    for name, target in (("upstream", upstream.target), ("llmd", llmd.target)):
        got[name] = {
            "bad json": immediate(drive(target, request_headers(bad, f"bad-{name}"), bad)),
            "empty subset": drive(target, request_headers(body, f"empty-{name}"), body, subset=[]),
            "unknown model": drive(target, request_headers(other, f"unknown-{name}"), other),
            "get": drive(target, [(":method", "GET"), (":path", "/v1/models"), (":authority", "gw")], b""),
        }
    up, ld = got["upstream"], got["llmd"]
    assert ld["bad json"] == up["bad json"]  # 400, the same text, no header
    assert ld["bad json"][0] == 400 and ld["bad json"][1].startswith(b"inference error: BadRequest")
    status, text, keys = immediate(ld["empty subset"])
    assert (status, text, keys) == (*immediate(up["empty subset"])[:2], [LLMD_DROPPED_REASON])
    assert status == 503
    reasons = ld["empty subset"].answers[0].immediate_response.headers.set_headers
    assert [o.header.raw_value for o in reasons] == [b"rejected-no-endpoints"]
    assert (
        ld["unknown model"].kinds == REQUEST_KINDS and ld["unknown model"].endpoint in pool.endpoints.values()
    )
    assert ld["get"].kinds == ["request_headers"] and ld["get"].endpoint in pool.endpoints.values()
    assert ld["get"].set_header_keys("request_headers") == up["get"].set_header_keys("request_headers")
