"""One routing-quality contender made of two processes: an endpoint picker and our router in gateway mode
asking it (fail-closed, so every request is the picker's decision), started in that order.

    picker_pair.py --picker upstream|llmd|llmd-precise|ours --port PORT --backends URL,URL
                   [--kubeconfig K --namespace NS --pool P] [--model M --model-dir D --kv-events-port N
                   --block-size B] [--replicas N] -- PICKER FLAGS...

``upstream``: the Inference Extension's EPP v1.5.0 (vllm_stack_dev.testbed.upstream_epp) reading the
InferencePool from the API server, waited for until it has fresh metrics for every backend; ``llmd``:
llm-d's router (``LlmdRouterEpp``, its default profile) the same way; ``llmd-precise``: llm-d's router
with its precise prefix-cache profile (``LlmdPreciseEpp``: a ``vllm launch render`` sidecar of model M
from D, the engines' KV events at each Pod IP's port N, blocks of B tokens); ``ours``:
``vllm-stack epp`` with the flags after ``--`` over the same backends. The gateway gets the backends as
static engines. ``--replicas N`` (picker replicas, the Inference Extension's most asked-for set-up): N
pickers, each behind a gateway of its own, and in front of the gateways our router with round-robin
(every request to the next gateway, so each picker decides every Nth request and learns of the others
only through what it reads: the engines' KV events for ours and llm-d's precise profile, its own
approximate index for llm-d's default one; each precise replica has a render sidecar of its own). SIGTERM (the benchmark stops a contender's process group) stops the gateway and the
picker (the upstream EPP runs in a process group of its own, so it is stopped here by its PID).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_stack_dev.testbed.engines import port_for_later
from vllm_stack_dev.testbed.upstream_epp import LlmdPreciseEpp, LlmdRouterEpp, UpstreamEpp

OURS = Path(sys.executable).parent / "vllm-stack"


def _wait_ready(port: int, process: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the picker exited ({process.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError("the picker was not ready in time")


def _start_picker(args: argparse.Namespace, upstreams: list[UpstreamEpp], processes: list) -> str:
    """One picker of kind ``args.picker`` started and ready; its ext_proc target (``host:port``)."""
    if args.picker in ("upstream", "llmd", "llmd-precise"):
        work = Path(tempfile.mkdtemp(prefix=f"{args.picker}-epp-"))
        where = (Path(args.kubeconfig), args.namespace, args.pool, work)
        if args.picker == "llmd-precise":
            upstream: UpstreamEpp = LlmdPreciseEpp(
                *where, model=args.model, model_dir=Path(args.model_dir), kv_port=args.kv_events_port,
                block_size=args.block_size,
            )  # fmt: skip
        else:
            upstream = (UpstreamEpp if args.picker == "upstream" else LlmdRouterEpp)(*where)
        upstreams.append(upstream)
        upstream.start(timeout=120, ready_endpoints=len(args.backends.split(",")))
        return f"127.0.0.1:{upstream.grpc_port}"
    http_port, grpc_port = port_for_later(), port_for_later()
    command = [str(OURS), "epp", "--host", "127.0.0.1", "--port", str(http_port),
               "--ext-proc-port", str(grpc_port), "--static-backends", args.backends,
               *args.picker_flags]  # fmt: skip
    picker = subprocess.Popen(command)
    processes.append(picker)
    _wait_ready(http_port, picker)
    return f"127.0.0.1:{grpc_port}"


def _router(port: int, backends: str, *flags: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [str(OURS), "router", "--host", "127.0.0.1", "--port", str(port), "--static-backends", backends,
         "--log-level", "warning", *flags]
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--picker", choices=("upstream", "llmd", "llmd-precise", "ours"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backends", required=True)
    parser.add_argument("--kubeconfig")
    parser.add_argument("--namespace")
    parser.add_argument("--pool")
    parser.add_argument("--model", help="llmd-precise: the engines' served model name")
    parser.add_argument("--model-dir", help="llmd-precise: its local directory (the render sidecar's)")
    parser.add_argument("--kv-events-port", type=int, help="llmd-precise: the engines' KV-event port")
    parser.add_argument("--block-size", type=int, default=128, help="llmd-precise: the engines' block size")
    parser.add_argument("--replicas", type=int, default=1, help="pickers, each behind a gateway of its own")
    parser.add_argument("picker_flags", nargs="*")
    args = parser.parse_args()
    stopping = False

    def stop(_signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    upstreams: list[UpstreamEpp] = []
    processes: list[subprocess.Popen[bytes]] = []
    try:
        gateway_ports = (
            [args.port] if args.replicas == 1 else [port_for_later() for _ in range(args.replicas)]
        )
        for port in gateway_ports:
            target = _start_picker(args, upstreams, processes)
            processes.append(_router(port, args.backends, "--endpoint-picker", f"grpc://{target}",
                                     "--no-endpoint-picker-fail-open", "--endpoint-picker-timeout", "10"))  # fmt: skip
            if args.replicas > 1:  # every gateway ready before the front's first probe of it: a gateway
                _wait_ready(port, processes[-1])  # the front found down would get no requests for a while
        if (
            args.replicas > 1
        ):  # the front: requests in turn to each gateway, so each picker sees every other one
            gateways = ",".join(f"http://127.0.0.1:{port}" for port in gateway_ports)
            processes.append(_router(args.port, gateways, "--routing-logic", "roundrobin"))
        while not stopping and all(process.poll() is None for process in processes):
            time.sleep(0.2)
        return 0 if stopping else 1
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
        for upstream in upstreams:
            if isinstance(upstream, LlmdPreciseEpp):  # proof that it scored from the engines' events
                print(
                    f"llmd-precise {upstream.target}: {upstream.event_counts()}", file=sys.stderr, flush=True
                )
            upstream.stop()  # its own process group, by its PID


if __name__ == "__main__":
    sys.exit(main())
