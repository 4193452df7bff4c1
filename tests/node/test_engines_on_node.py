"""The chart with its CPU engines on a real node: `helm/examples/real-node/cpu-node.yaml` (two vLLM CPU engines of the tiny
model, prefix-aware routing with the engines' KV events) installed with Helm 4, every container started by
containerd and runc from the images the local registry serves as `ghcr.io/vllm-stack`.

What is checked here, each by what the kubelet and the runtime did (not by what the chart renders):
- every Pod Running and Ready by the kubelet's own probes; the containers non-root, on read-only root file
  systems, with no capabilities (their OCI specs);
- the router finds both engines with in-cluster configuration (the ServiceAccount token the kubelet
  projects) and subscribes to their KV events across Pods: a long prompt's blocks reach its index;
- a client Pod gets plain and streamed chat completions through the router Service by its DNS name (CoreDNS)
  and its ClusterIP (kube-proxy);
- the model-cache claim (a `local` PersistentVolume holding the model) mounted and written by the engine's
  non-root user through `fsGroup`; the HF token Secret's key in the engine's environment;
- `helm test` passes.

The engine image (~7 GB) comes from `make install` (its engine-image step; built and pushed here when missing).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from vllm_stack_dev.cluster.control_plane import Cluster
from vllm_stack_dev.cluster.node import RealNode
from vllm_stack_dev.cluster.releases import Helm, pod_ready, wait_workloads_ready
from vllm_stack_dev.images import ROUTER, build_engine_image, engine_cpu_reference, push_local
from vllm_stack_dev.paths import repo_root

from tests.node.containers import (
    assert_hardened,
    client_pod,
    container_id,
    ctr,
    exec_in,
    finished_pod,
    get_from_node,
    oci_spec,
    pod_log,
    text_from_node,
)
from tests.node.traffic import Request, Traffic, TrafficReport, pod_resolv_conf

pytestmark = [pytest.mark.node, pytest.mark.timeout(1800)]  # the engines start and roll in minutes

RELEASE = "cpu"
NAMESPACE = "node-engines"
CHART = repo_root() / "helm"
VALUES = CHART / "examples" / "real-node" / "cpu-node.yaml"
HF_TOKEN = "hf_node_tier_secret_value"
ENGINES_READY_S = 600.0  # the engine image's first pull (3.5 GB, 7 GB unpacked) and two engine starts
ENGINE_UID = ROUTER_UID = 10001
SERVICE = f"{RELEASE}-router-service"
MODEL = "tiny-llama"


def _values(replicas: int) -> dict:
    """The example at ``replicas`` engines, and answers that name their engine (`x-vllm-stack-route`: the
    traffic client counts by it)."""
    values = yaml.safe_load(VALUES.read_text())
    values["servingEngineSpec"]["modelSpec"][0]["replicaCount"] = replicas
    values["routerSpec"].setdefault("extraArgs", []).append("--debug-headers")
    return values


@pytest.fixture(scope="module")
def replicas(request: pytest.FixtureRequest) -> int:
    """The example's two engines in the whole matrix (`make test-node`: -m names node_full); one in `make
    test`'s reduced set, which a 2-core machine starts and rolls in about half the time."""
    return 2 if "node_full" in (request.config.getoption("markexpr") or "") else 1


def prerequisites(model_dir: Path, volume: Path, node: RealNode) -> list[dict[str, object]]:
    """What cpu-node.yaml expects in the namespace: the model's volume, the router's tokenizer, the HF token."""
    target = volume / "models" / MODEL
    shutil.copytree(model_dir, target)
    tokenizer = {name: (model_dir / name).read_text() for name in ("tokenizer.json", "tokenizer_config.json")}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {
                "name": f"{NAMESPACE}-tiny-model",
                "labels": {"vllm-stack.dev/volume": "tiny-model"},
            },
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteOnce"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                # `local`, not hostPath: the kubelet applies the Pod's fsGroup to a local volume's files
                "local": {"path": str(volume)},
                "nodeAffinity": {
                    "required": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "kubernetes.io/hostname", "operator": "In", "values": [node.name]}
                                ]
                            }
                        ]
                    }
                },  # fmt: skip
            },
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{MODEL}-tokenizer", "namespace": NAMESPACE},
            "data": tokenizer,
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hf-token", "namespace": NAMESPACE},
            "stringData": {"token": HF_TOKEN},
        },
    ]


@pytest.fixture(scope="module")
def release(
    node_cluster: tuple[Cluster, RealNode],
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    replicas: int,
) -> Iterator[tuple[Cluster, RealNode, float]]:
    """The release, every workload ready; yields the seconds the install took to be ready."""
    cluster, node = node_cluster
    print(build_engine_image(), push_local((engine_cpu_reference(),)))
    volume = tmp_path_factory.mktemp("tiny-model-volume")
    cluster.apply(prerequisites(tiny_model_dir, volume, node))
    start = time.monotonic()
    values = tmp_path_factory.mktemp("values") / "values.yaml"
    values.write_text(yaml.safe_dump(_values(replicas)))
    Helm(cluster, 4).install(RELEASE, CHART, NAMESPACE, values)
    wait_workloads_ready(cluster, NAMESPACE, timeout=ENGINES_READY_S)
    yield cluster, node, time.monotonic() - start


def pods(cluster: Cluster, component: str) -> list[dict]:
    found = cluster.get("pods", "-n", NAMESPACE, "-l", f"app.kubernetes.io/component={component}")["items"]
    return [p for p in found if p["metadata"].get("deletionTimestamp") is None]  # type: ignore[union-attr]


def test_every_pod_ready_by_the_kubelets_probes_and_hardened(
    release: tuple[Cluster, RealNode, float], replicas: int
) -> None:
    cluster, node, seconds = release
    print(f"install to ready: {seconds:.0f} s")
    engines, routers = pods(cluster, "serving-engine"), pods(cluster, "router")
    assert len(engines) == replicas
    assert len(routers) == 1
    for pod in engines + routers:
        name = pod["metadata"]["name"]
        assert pod["spec"]["nodeName"] == node.name, name
        assert pod_ready(pod), (name, pod["status"])
        (status,) = pod["status"]["containerStatuses"]
        assert status["ready"] and status["restartCount"] == 0, status
        assert status["imageID"].startswith("ghcr.io/vllm-stack/"), status["imageID"]
        spec = oci_spec(node, container_id(pod, status["name"]))
        assert_hardened(spec, ENGINE_UID if pod in engines else ROUTER_UID)
    for pod in engines:  # the probes the kubelet ran are the chart's, on the engine's /health
        (container,) = pod["spec"]["containers"]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["path"] == "/health", (probe, container[probe])


def test_router_finds_the_engines_in_cluster_and_follows_their_kv_events(
    release: tuple[Cluster, RealNode, float],
) -> None:
    cluster, node, _ = release
    (router,) = pods(cluster, "router")
    volumes = {v["name"]: v for v in router["spec"]["volumes"]}
    assert any("projected" in v and name.startswith("kube-api-access-") for name, v in volumes.items())
    base = f"http://{router['status']['podIP']}:8000"
    engine_ips = {p["status"]["podIP"] for p in pods(cluster, "serving-engine")}
    listed = get_from_node(node, f"{base}/engines")
    assert listed["discovery"]["source"] == "k8s" and listed["discovery"]["healthy"], listed["discovery"]
    urls = {e["url"] for e in listed["engines"] if e["healthy"]}
    assert urls == {f"http://{ip}:8000" for ip in engine_ips}, urls

    # A prompt of several KV blocks (128 tokens each on CPUs): the engine that served it publishes
    # BlockStored events over ZMQ from its Pod, and the router's index learns the blocks from them.
    prompt = " ".join(f"word{i}" for i in range(400))
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2})
    code = (
        "import urllib.request,sys; r=urllib.request.Request(sys.argv[1], data=sys.argv[2].encode(),"
        " headers={'Content-Type': 'application/json'}); sys.stdout.write(urllib.request.urlopen(r, timeout=60).read().decode())"
    )
    answer = json.loads(node.run_in_node([sys.executable, "-c", code, f"{base}/v1/chat/completions", body]))
    assert answer["usage"]["prompt_tokens"] > 256, answer["usage"]
    deadline = time.monotonic() + 30
    while True:
        state = get_from_node(node, f"{base}/engines")["scheduling"]["state"]
        streams = state["kv_event_streams"]
        picker = state["prefix-cache-picker"]
        if picker["index"] == "kv_events" and picker["indexed_blocks"] >= 2:
            break
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no KV-event batch reached the router's index within 30 s: {streams}, {picker}"
            )
        time.sleep(0.5)
    assert sum(s["batches"] for pod_streams in streams.values() for s in pod_streams) >= 1, streams
    endpoints = {s["endpoint"] for pod_streams in streams.values() for s in pod_streams}
    assert endpoints == {f"tcp://{ip}:5557" for ip in engine_ips}, endpoints


CLIENT = """
import json, socket, sys, urllib.request
name, model = sys.argv[1], sys.argv[2]
result = {"resolved": socket.gethostbyname(name)}
def chat(base, stream):
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": stream}
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = response.read().decode()
    if stream:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        return [response.status, len(events) - 1, events[-1]]
    return [response.status, json.loads(text)["usage"]["completion_tokens"], json.loads(text)["model"]]
for key, base in (("by_name", "http://" + name), ("by_ip", "http://" + result["resolved"])):
    result[key] = {"plain": chat(base, False), "stream": chat(base, True)}
with open("/dev/termination-log", "w") as out:
    json.dump(result, out)
"""


def test_chat_completions_through_the_service_by_dns_name_and_cluster_ip(
    release: tuple[Cluster, RealNode, float],
) -> None:
    cluster, _, _ = release
    command = ["python3", "-c", CLIENT, f"{SERVICE}.{NAMESPACE}.svc.cluster.local", MODEL]
    cluster.apply([client_pod("chat-client", NAMESPACE, ROUTER.reference(), command)])
    try:
        pod = finished_pod(cluster, "chat-client", NAMESPACE, timeout=120)
    finally:  # a finished Pod is never Ready: the rollouts below wait for every Pod of the namespace
        cluster.kubectl("delete", "pod", "chat-client", "-n", NAMESPACE, "--wait=true", "--timeout=60s")
    terminated = pod["status"]["containerStatuses"][0]["state"].get("terminated", {})
    assert pod["status"]["phase"] == "Succeeded", terminated or pod["status"]
    found = json.loads(terminated["message"])
    service = cluster.get("service", SERVICE, "-n", NAMESPACE)
    assert found["resolved"] == service["spec"]["clusterIP"], found  # type: ignore[index]
    for way in ("by_name", "by_ip"):
        assert found[way]["plain"][:1] == [200] and found[way]["plain"][1] > 0, found
        assert found[way]["plain"][2] == MODEL, found
        status, chunks, last = found[way]["stream"]
        assert status == 200 and chunks >= 2 and last == "[DONE]", found


def test_model_claim_written_by_the_engine_user_and_hf_token_from_the_secret(
    release: tuple[Cluster, RealNode, float],
) -> None:
    cluster, node, _ = release
    claim = f"{RELEASE}-{MODEL}-storage-claim"
    bound = cluster.get("pvc", claim, "-n", NAMESPACE)
    assert bound["status"]["phase"] == "Bound", bound["status"]  # type: ignore[index]
    volume = Path(cluster.get("pv", bound["spec"]["volumeName"])["spec"]["local"]["path"])  # type: ignore[index]
    for pod in pods(cluster, "serving-engine"):
        name = pod["metadata"]["name"]
        mounts = {m["mountPath"]: m["name"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
        claims = {
            v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in pod["spec"]["volumes"]
        }
        assert claims[mounts["/data"]] == claim, (mounts, claims)
        cid = container_id(pod, "vllm")
        marker = f"written-by-{name}"
        done = exec_in(
            node,
            cid,
            f"write-{name[-5:]}",
            f"id -u; touch /data/{marker}; printenv HF_TOKEN; printenv HF_HOME",
        )
        assert done.returncode == 0, (done.stdout, done.stderr)
        uid, token, hf_home = done.stdout.split()
        assert (uid, token, hf_home) == (str(ENGINE_UID), HF_TOKEN, "/data")
        written = (volume / marker).stat()
        assert (written.st_uid, written.st_gid) == (ENGINE_UID, ENGINE_UID), written
        # the model the engine serves came from the claim
        assert pod["spec"]["containers"][0]["args"][0] == f"/data/models/{MODEL}", pod["spec"]["containers"][
            0
        ]["args"]
    assert HF_TOKEN not in json.dumps(
        cluster.get("deployments", "-n", NAMESPACE)
    )  # a secretKeyRef, not a value


def test_helm_test_passes(release: tuple[Cluster, RealNode, float]) -> None:
    cluster, node, _ = release
    result = Helm(cluster, 4).run("test", RELEASE, "-n", NAMESPACE, "--timeout", "180s", check=False)
    if result.returncode != 0:
        tests = cluster.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=test")["items"]
        logs = [pod_log(node, p, "models")[-2000:] for p in tests]  # type: ignore[union-attr]
        raise AssertionError(f"helm test failed: {result.stdout}\n{result.stderr}\n{logs}")
    assert "Phase:          Succeeded" in result.stdout or "Succeeded" in result.stdout, result.stdout


# ---- the engines under steady traffic: a killed container, a rolled Deployment, a scale down and up -----------

CONCURRENCY = 4
ROLLOUT_S = (
    600.0  # new engine Pods started and Ready (two vLLM starts beside two running engines), old ones gone
)


def engine_ident(pod: dict) -> tuple[str, str]:
    """What the router's `x-vllm-stack-route` header may name the engine of ``pod`` by."""
    return pod["metadata"]["name"], pod["status"]["podIP"]


def served_by(request: Request, pod: dict) -> bool:
    return request.engine is not None and any(i and i in request.engine for i in engine_ident(pod))


def traffic(node: RealNode, folder: Path) -> Traffic:
    return Traffic(node, folder, f"http://{SERVICE}", MODEL, concurrency=CONCURRENCY,
                   resolv_conf=pod_resolv_conf(NAMESPACE))  # fmt: skip


def wait_served(client: Traffic, pod: dict, timeout: float, what: str) -> None:
    """Until a request started in the current step ended complete, answered by ``pod``."""
    since = client.marks[-1][1]
    deadline = time.monotonic() + timeout
    while not any(r.ok and r.start >= since and served_by(r, pod) for r in client.records()):
        if time.monotonic() > deadline:
            engines = sorted({str(r.engine) for r in client.records() if r.start >= since})
            raise AssertionError(f"{what}: none within {timeout:.0f} s (answered by {engines})")
        time.sleep(0.2)


def _pod(cluster: Cluster, name: str) -> dict:
    return cluster.get("pod", name, "-n", NAMESPACE)  # type: ignore[return-value]


def routed_engines(node: RealNode, router: dict) -> dict[str, bool]:
    """Engine URL -> healthy, as the router sees them now."""
    listed = get_from_node(node, f"http://{router['status']['podIP']}:8000/engines")
    return {e["url"]: bool(e["healthy"] and e["ready"]) for e in listed["engines"]}


def _upgrade(cluster: Cluster, values: dict, folder: Path, step: str) -> None:
    path = folder / f"{step.replace(' ', '-').replace('>', '')}.yaml"
    path.write_text(yaml.safe_dump(values))
    Helm(cluster, 4).upgrade(RELEASE, CHART, NAMESPACE, path)


def _engines_after(cluster: Cluster, before: set[str], replicas: int, what: str) -> set[str]:
    """Once the engine Deployment is rolled out at ``replicas`` and no other engine Pod is left: their names."""
    wait_workloads_ready(cluster, NAMESPACE, timeout=ROLLOUT_S)
    deadline = time.monotonic() + ROLLOUT_S
    while True:
        every = cluster.get("pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=serving-engine")[
            "items"
        ]
        names = {p["metadata"]["name"] for p in every}  # type: ignore[union-attr]
        if len(names) == replicas and all(pod_ready(p) for p in every):  # type: ignore[union-attr]
            return names
        if time.monotonic() > deadline:
            raise AssertionError(
                f"{what}: engine Pods {sorted(names)} (was {sorted(before)}) not {replicas} Ready"
            )
        time.sleep(0.5)


def _run_steps(
    node: RealNode,
    folder: Path,
    steps: list[tuple[str, Callable[[], None]]],
    settled: Callable[[Traffic], None],
) -> TrafficReport:
    """Steady traffic, then each step (its requests counted apart), then a settle step until ``settled``
    returns; the report."""
    with traffic(node, folder / "traffic") as client:
        client.start("steady", first=2 * CONCURRENCY, timeout=120)
        client.wait_for(4 * CONCURRENCY, 120, "steady answers before the upgrades")
        for name, act in steps:
            client.step(name)
            act()
        client.step("settle")
        settled(client)
        report = client.stop()
    table = report.table()
    (folder / "table.md").write_text(table + "\n")
    print(f"\n{table}")
    assert not report.failures, report.explain()
    for step in report.steps:
        assert step.requests and step.streamed, table
    return report


def _engine_names(cluster: Cluster) -> set[str]:
    return {p["metadata"]["name"] for p in pods(cluster, "serving-engine")}


def test_engine_rollouts_under_load_lose_no_request(
    release: tuple[Cluster, RealNode, float], replicas: int, tmp_path: Path
) -> None:
    """`helm upgrade` that (b) rolls the engine Deployment (a changed engine argument) and (c) scales the
    engines (reduced set, one engine: 1 -> 2; whole matrix, two: 2 -> 1 -> 2), with steady plain and
    streamed traffic through the router Service: not one request fails. The router drops a terminating
    engine Pod at once (its deletionTimestamp), the engine serves on through its preStop wait
    (servingEngineSpec.preStopSleepSeconds) while the answers under way finish, and a new engine joins once
    Ready and answers."""
    cluster, node, _ = release
    values = _values(replicas)
    model = values["servingEngineSpec"]["modelSpec"][0]
    names = {"first": _engine_names(cluster)}

    def upgrade(step: str, count: int) -> None:
        before = names["now"] if "now" in names else names["first"]
        model["replicaCount"] = count
        _upgrade(cluster, values, tmp_path, step)
        names["now"] = _engines_after(cluster, before, count, step)
        names[step] = names["now"]

    def roll() -> None:
        model["vllmConfig"]["maxNumSeqs"] = 32
        upgrade("roll", replicas)
        assert not names["roll"] & names["first"], names

    steps: list[tuple[str, Callable[[], None]]] = [(f"roll engines at {replicas} (a changed argument)", roll)]
    if replicas == 2:
        steps.append(("scale engines 2 -> 1", lambda: upgrade("scale-down", 1)))
    steps.append(("scale engines 1 -> 2", lambda: upgrade("scale-up", 2)))

    def new_engine_answers(client: Traffic) -> None:
        before_up = names["scale-down"] if replicas == 2 else names["roll"]
        assert before_up < names["scale-up"], names
        (new,) = names["scale-up"] - before_up
        wait_served(client, _pod(cluster, new), 120, f"a complete answer from {new}, the scale-up's engine")

    _run_steps(node, tmp_path, steps, new_engine_answers)
    if replicas == 2:
        assert names["scale-down"] < names["roll"], names


@pytest.mark.node_full
def test_a_killed_engine_container_is_restarted_ejected_and_readmitted(
    release: tuple[Cluster, RealNode, float], tmp_path: Path
) -> None:
    """SIGKILL to one engine's vLLM (its container's init process): the kubelet restarts the container, the
    router stops routing to the engine and takes it back once it is Ready again, and no request fails: those
    in flight on it before their first byte are retried, the streams it was answering are continued on the
    other engine (the router's stream continuation, on by default; docs/hardening.md), each a whole answer
    with its usage and [DONE]."""
    cluster, node, _ = release
    (router,) = pods(cluster, "router")
    victim = pods(cluster, "serving-engine")[0]
    url = f"http://{victim['status']['podIP']}:8000"
    with traffic(node, tmp_path / "traffic") as client:
        client.start("steady", first=2 * CONCURRENCY, timeout=120)
        wait_served(
            client, victim, 120, f"a complete answer from {victim['metadata']['name']} before the kill"
        )
        client.step("engine killed")
        ctr(node, "tasks", "kill", "-s", "SIGKILL", container_id(victim, "vllm"))  # fails unless it exits 0
        seen_out = False
        deadline = time.monotonic() + ROLLOUT_S
        while True:
            pod = cluster.get("pod", victim["metadata"]["name"], "-n", NAMESPACE)
            (status,) = pod["status"]["containerStatuses"]  # type: ignore[index]
            state = routed_engines(node, router)
            seen_out = seen_out or not state.get(url, False)
            if status["restartCount"] >= 1 and status["ready"] and seen_out and state.get(url):
                break
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{victim['metadata']['name']} not restarted, ejected and readmitted within {ROLLOUT_S:.0f} s: "
                    f"restarts {status['restartCount']}, ready {status['ready']}, router saw it out {seen_out}, "
                    f"now {state}"
                )
            time.sleep(0.5)
        client.step("readmitted")
        wait_served(client, victim, 120, "a complete answer from the restarted engine")
        report = client.stop()
    print(f"\n{report.table()}")
    (tmp_path / "table.md").write_text(report.table() + "\n")
    assert not report.failures, report.explain()


# Streams of tens of seconds on these engines while two new ones start beside them (about 10 tokens/s
# each), so that the old engines' SIGTERM finds some under way
CUT_STREAM_TOKENS = 300


def continuations(node: RealNode, router: dict) -> dict[str, float]:
    """The router's `stream_continuations_total`, outcome -> count (summed over models)."""
    text = text_from_node(node, f"http://{router['status']['podIP']}:8000/metrics")
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm_stack_router_stream_continuations_total":
                outcome = sample.labels["outcome"]
                counts[outcome] = counts.get(outcome, 0.0) + sample.value
    return counts


@pytest.mark.node_full
def test_an_engine_roll_without_a_prestop_wait_continues_the_streams_it_cut(
    release: tuple[Cluster, RealNode, float], replicas: int, tmp_path: Path
) -> None:
    """The engines rolled with no preStop wait (servingEngineSpec.preStopSleepSeconds 0), under streams
    long enough to be under way at the old engines' SIGTERM: vLLM's engine core dies there and its open
    streams end with an error event (measured here: "EngineCore encountered an issue", code 500), and the
    router continues each on a new engine (stream continuation, on by default) instead of forwarding it:
    not one request fails, each stream a whole answer with its usage and [DONE], and the router counts
    the continuations."""
    cluster, node, _ = release
    values = _values(replicas)
    values["servingEngineSpec"]["preStopSleepSeconds"] = 0
    model = values["servingEngineSpec"]["modelSpec"][0]
    model["vllmConfig"]["maxNumSeqs"] = 24
    # the Pods this rolls in have no preStop wait; the ones it replaces still wait theirs
    _upgrade(cluster, values, tmp_path, "no prestop wait")
    before = _engines_after(cluster, _engine_names(cluster), replicas, "no prestop wait")
    (router,) = pods(cluster, "router")
    counted = continuations(node, router)
    with Traffic(node, tmp_path / "traffic", f"http://{SERVICE}", MODEL, concurrency=CONCURRENCY,
                 stream_tokens=CUT_STREAM_TOKENS, request_timeout=300, resolv_conf=pod_resolv_conf(NAMESPACE)
                 ) as client:  # fmt: skip
        client.start("steady", first=CONCURRENCY, timeout=240)
        client.step("roll, no preStop wait")
        model["vllmConfig"]["maxNumSeqs"] = 16
        _upgrade(cluster, values, tmp_path, "roll without prestop")
        after = _engines_after(cluster, before, replicas, "roll without prestop")
        assert not after & before, (before, after)
        client.step("settle")
        wait_served(client, _pod(cluster, sorted(after)[0]), 240, "a complete answer from a new engine")
        report = client.stop()
    now = continuations(node, router)
    table = report.table()
    (tmp_path / "table.md").write_text(table + "\n")
    print(f"\n{table}\ncontinuations before {counted}, after {now}")
    assert not report.failures, report.explain()
    continued = now.get("continued", 0) - counted.get("continued", 0)
    assert continued > 0, (counted, now)
    # each continued stream completed; one may have been continued twice (onto an old engine that was
    # stopped in turn: the roll stops every old engine at once)
    assert 0 < now.get("completed", 0) - counted.get("completed", 0) <= continued, (counted, now)
