"""A rolling upgrade of the endpoint picker on a real node while a gateway sends traffic (issue 47, item 4).

One release, installed with Helm 4 (tests/node/picker_bed.py): the Inference Extension and our picker on
(``inferenceExtension.epp``: Deployment and Service ``gw-stub-epp``), and the chart's router Deployment as
the gateway, our router in gateway mode (``routerSpec.extraArgs: --endpoint-picker grpc://gw-stub-epp:9002``:
the Service's short name, resolved by CoreDNS, connected through kube-proxy), the stand-in for an Envoy
inference gateway, which cannot run here. It asks the picker for every request's engine over ext_proc and
schedules the request itself when the picker cannot answer (fail-open, its default). The engines are two
stub Pods (tests/node/stub_engine.py) labelled as the model's InferencePool selects them; the chart's own
engine Deployment is at 0 replicas.

The node tier's client (tests/node/traffic.py) sends plain and streamed chat completions to the router
Service by name, back to back, while ``helm upgrade`` rolls the picker's Deployment (a changed pod
annotation); as the roll begins one more client starts a 30 s stream, under way on the old picker when
it stops. With one picker replica in ``make test``, with two in ``make test-node`` (``node_full``).
Counted per step (before, the roll, after): the client's requests and failures; the gateway's questions
to the picker by outcome (``endpoint_picker_requests_total``: ``picked``, or ``error``/``timeout``/
``unknown_endpoint``, which it scheduled itself); and the answers' ends it told the picker (``told``) or
found the picker's stream cut before (``cut``: what an Envoy that passes answers through its picker would
have failed). What must hold: no request fails, no picker stream is cut, the roll replaced every picker
Pod (new names), the gateway had picks before and after it, and the new Pods picked (their own
``ext_proc_streams_total``): fail-open did not carry the traffic.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm_stack_dev.cluster.control_plane import Cluster, default_crds_dir
from vllm_stack_dev.cluster.node import RealNode
from vllm_stack_dev.cluster.releases import wait_workloads_ready
from vllm_stack_dev.images import ROUTER

from tests.cluster.serving import wait_for
from tests.node.picker_bed import CRDS, GATEWAY_LABELS, NAMESPACE, PICKER_LABELS, RELEASE, LongStream, Release
from tests.node.stub_engine import MODEL, stub_engine_objects
from tests.node.traffic import Traffic, pod_resolv_conf

pytestmark = pytest.mark.node

WORKERS = 4  # the steady traffic's, half of their requests streamed
CHUNK_INTERVAL = 0.15  # seconds between a stub engine's chunks
STREAM_TOKENS = 10  # a streamed request of the steady traffic: 1.5 s
# The long stream: 30 s, longer than the old picker's preStop wait (5 s) and the 5 s its gRPC server gave
# the streams under way after SIGTERM before 6a4d00c (they were cut), within its grace period (50 s).
LONG_TOKENS = 200
STEP_ANSWERS = 2 * WORKERS  # complete answers a quiet step lasts at least
OUTCOMES = ("picked", "immediate", "error", "timeout", "unknown_endpoint")  # the gateway's questions
ENDS = ("told", "cut")  # the answers' ends the gateway told the picker, or found its stream cut before


@pytest.fixture(params=[1, pytest.param(2, marks=pytest.mark.node_full)], ids=["1-picker", "2-pickers"])
def release(
    request: pytest.FixtureRequest, node_cluster: tuple[Cluster, RealNode], tmp_path: Path
) -> Iterator[Release]:
    """The release with ``request.param`` picker replicas, and two stub engines in its pool; all of it
    deleted at the end, also when the test fails, so that later tests of the package find the node's CPU
    free."""
    cluster, node = node_cluster
    for name in CRDS:
        cluster.kubectl("apply", "--server-side", "-f", str(default_crds_dir() / name))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd",
                    "inferencepools.inference.networking.k8s.io",
                    "inferenceobjectives.inference.networking.x-k8s.io")  # fmt: skip
    found = Release(cluster, node, tmp_path, request.param)
    try:
        found.apply_values(roll=0, install=True)
        pool = cluster.get("inferencepools.inference.networking.k8s.io", "-n", NAMESPACE)["items"][0]  # type: ignore[index]
        cluster.apply(stub_engine_objects(ROUTER.reference(), NAMESPACE, RELEASE, replicas=2,
                                          chunk_interval=CHUNK_INTERVAL, labels=pool["spec"]["selector"]["matchLabels"]))  # fmt: skip
        wait_workloads_ready(cluster, NAMESPACE, timeout=180)
        yield found
    finally:
        found.helm.run("uninstall", RELEASE, "-n", NAMESPACE, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--timeout=120s", check=False)


def test_rolling_the_picker_under_a_gateways_traffic_fails_no_request(
    release: Release, tmp_path: Path
) -> None:
    began = time.monotonic()
    ((gateway, gateway_ip),) = release.ready_pods(GATEWAY_LABELS).items()
    pickers = release.ready_pods(PICKER_LABELS)
    for ip, who in [(gateway_ip, "the gateway"), *((ip, f"picker {name}") for name, ip in pickers.items())]:
        wait_for(lambda ip=ip: release.knows_engines(ip, 2), 60, f"{who} knowing both engines", interval=0.5)
    url = f"http://{RELEASE}-router-service"  # a Pod's short name: the search domains, CoreDNS, kube-proxy
    counts: list[dict[str, float]] = []  # the gateway's counters at the start of each step, and at the end

    def gateway_counts() -> dict[str, float]:
        ends = release.counters(gateway_ip, "endpoint_picker_answer_ends_total")
        asked = release.counters(gateway_ip, "endpoint_picker_requests_total")
        return asked | {f"ends_{k}": v for k, v in ends.items()}

    def quiet_step(name: str) -> None:
        """Step ``name`` lasts STEP_ANSWERS complete answers and until the gateway has had a pick in it."""
        traffic.step(name)
        counts.append(gateway_counts())
        traffic.wait_for(STEP_ANSWERS, 60, f"complete answers in step {name!r}")
        wait_for(lambda: gateway_counts().get("picked", 0) > counts[-1].get("picked", 0), 60,
                 f"a request of step {name!r} picked", interval=0.5)  # fmt: skip

    with Traffic(release.node, tmp_path / "traffic", url, MODEL, concurrency=WORKERS, stream_tokens=STREAM_TOKENS,
                 resolv_conf=pod_resolv_conf(NAMESPACE)) as traffic:  # fmt: skip
        try:
            traffic.start("before", first=STEP_ANSWERS)
            counts.append({})  # "before" counts from the gateway's start: it had no other requests
            old = set(pickers)
            traffic.step("helm upgrade rolls the picker")
            counts.append(gateway_counts())
            long = LongStream(release.node, url.replace(f"{RELEASE}-router-service", _cluster_ip(release)),
                              LONG_TOKENS, tmp_path / "long-stream.log")  # fmt: skip
            long.send()
            release.apply_values(roll=1)
            new, terminating = release.wait_rolled(old)
            quiet_step("after the roll")
            ips = release.ready_pods(PICKER_LABELS)
            picks = {
                name: release.counters(ips[name], "ext_proc_streams_total").get("picked", 0) for name in new
            }
            report = traffic.stop()
            streamed = long.result()
        except BaseException:
            print(f"gateway counters: {gateway_counts()}")
            print(release.logs(GATEWAY_LABELS), release.logs(PICKER_LABELS), sep="\n")
            raise
    counts.append(gateway_counts())

    rows = []
    for i, step in enumerate(report.steps):
        row: dict[str, object] = {"step": step.name, "requests": len(step.requests), "streamed": step.streamed,
                                  "failed": len(step.failures), "seconds": round(step.end - step.start, 1)}  # fmt: skip
        row |= {o: int(counts[i + 1].get(o, 0) - counts[i].get(o, 0)) for o in OUTCOMES}
        row |= {o: int(counts[i + 1].get(f"ends_{o}", 0) - counts[i].get(f"ends_{o}", 0)) for o in ENDS}
        rows.append(row)
    table = "\n".join(json.dumps(row) for row in rows)
    print(f"\n{release.replicas} picker(s) rolled ({time.monotonic() - began:.0f} s):\n{table}\n"
          f"long stream: {streamed}\nnew Pods' picks: {picks}\n"
          + "\n".join(line for line in release.logs(GATEWAY_LABELS, lines=400).splitlines() if "endpoint picker" in line))  # fmt: skip
    assert not report.failures, report.explain()
    assert streamed["ok"], streamed  # the 30 s stream, whole
    # ... and it was under way on the old picker when that stopped (after its preStop wait): what the old
    # picker's 5 s drain cut
    assert streamed["first_byte"] < terminating and streamed["end"] > terminating + 10, (
        streamed,
        terminating,
    )
    assert sum(row["cut"] for row in rows) == 0, table  # type: ignore[misc]  # no picker stream cut under an answer
    assert not new & old and len(new) == release.replicas, (new, old)
    assert release.ready_pods(GATEWAY_LABELS).keys() == {gateway}, "the gateway was rolled too"
    assert rows[0]["picked"] and rows[2]["picked"], table  # the picker, not fail-open, before and after
    assert sum(picks.values()) > 0, picks  # ... and after, the new Pods


def _cluster_ip(release: Release) -> str:
    service = release.cluster.get("service", f"{RELEASE}-router-service", "-n", NAMESPACE)
    return str(service["spec"]["clusterIP"])  # type: ignore[index]
