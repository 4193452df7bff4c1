"""Development subcommands of `vllm-stack`: model builders, engine launcher and `up` (the local stack).

Subcommands stay thin: each parses its flags and calls one function of the module that does the work,
so the same code paths serve the tests, the benchmarks and `make run`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from vllm_stack_dev.testbed.models import SIZES


def _cmd_model_build(args: argparse.Namespace) -> int:
    from vllm_stack_dev.testbed.models import build_model

    out = build_model(args.size, args.out, force=args.force)
    print(out)
    return 0


def _cmd_model_lora(args: argparse.Namespace) -> int:
    from vllm_stack_dev.testbed.models import build_lora

    out = build_lora(args.base, args.out, rank=args.rank, seed=args.seed, force=args.force)
    print(out)
    return 0


def _wait_for_signal() -> None:
    """Block the main thread until SIGINT or SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def _cmd_engines(args: argparse.Namespace) -> int:
    from vllm_stack_dev.paths import cache_dir
    from vllm_stack_dev.testbed.engines import EngineStartError, default_kv_cache_mib, start_engines
    from vllm_stack_dev.testbed.models import build_model

    model_dir = Path(args.model) if args.model else build_model(args.size, cache_dir() / "models" / args.size)
    try:
        group = start_engines(
            args.count,
            model_dir,
            args.served_model_name,
            kv_cache_mib=args.kv_cache_mib or default_kv_cache_mib(),
            log_dir=args.log_dir,
            ready_timeout=args.ready_timeout,
            extra_args=args.extra_args or [],
        )
    except EngineStartError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    with group:
        for engine in group:
            events = f", KV events tcp://127.0.0.1:{engine.kv_events_port}" if engine.kv_events_port else ""
            print(
                f"{engine.name}: {engine.url} (model {engine.served_model_name}{events}, log {engine.log_path})"
            )
        print("engines ready; Ctrl-C stops them", flush=True)
        _wait_for_signal()
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from vllm_stack_dev.up.run import UpOptions, up

    return up(
        UpOptions(
            values=args.values,
            sets=args.set,
            port=args.port,
            namespace=args.namespace,
            prometheus=args.prometheus,
            prometheus_port=args.prometheus_port,
            max_engines=args.max_engines,
            log_dir=args.log_dir,
            ready_timeout=args.ready_timeout,
            dry_run=args.dry_run,
        )
    )


def _cmd_cluster_up(args: argparse.Namespace) -> int:
    from vllm_stack_dev.cluster.cli import cluster_up

    return cluster_up(args.dir, args.nodes, args.real_nodes)


def _cmd_check(args: argparse.Namespace) -> int:
    from vllm_stack_dev.up.check import check

    return check(
        args.values,
        args.set,
        strict=args.strict,
        fail_on=args.fail_on,
        verbose=args.verbose,
        release=args.release,
        namespace=args.namespace,
    )


def _cmd_router(argv: Sequence[str]) -> int:
    from vllm_stack.router_cli import main as router_main

    return router_main(list(argv))


def _values_flags(parser: argparse.ArgumentParser) -> None:
    """-f and --set, as helm takes them, for the commands that render the chart."""
    parser.add_argument(
        "-f", "--values", action="append", type=Path, required=True, help="values file (repeatable)"
    )
    parser.add_argument("--set", action="append", default=[], help="as helm's --set (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-stack", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("router", help="run the router (flags: vllm-stack router --help)", add_help=False)

    model = sub.add_parser("model", help="build local model directories for tests and benchmarks")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    build = model_sub.add_parser(
        "build", help="write a Llama model directory (config + tokenizer, no weights)"
    )
    build.add_argument("--size", choices=sorted(SIZES), default="tiny")
    build.add_argument("--out", required=True, type=Path)
    build.add_argument("--force", action="store_true", help="rebuild even when the directory is complete")
    build.set_defaults(func=_cmd_model_build)
    lora = model_sub.add_parser("lora", help="write a PEFT LoRA adapter for a built model")
    lora.add_argument("--base", required=True, type=Path)
    lora.add_argument("--out", required=True, type=Path)
    lora.add_argument("--rank", type=int, default=8)
    lora.add_argument("--seed", type=int, default=0)
    lora.add_argument("--force", action="store_true")
    lora.set_defaults(func=_cmd_model_lora)

    engines = sub.add_parser("engines", help="start N real vLLM engines in the foreground until Ctrl-C")
    engines.add_argument("--count", type=int, default=2)
    engines.add_argument("--model", help="model directory (default: the built tiny model)")
    engines.add_argument(
        "--size", choices=sorted(SIZES), default="tiny", help="model to build when --model is absent"
    )
    engines.add_argument("--served-model-name", default="tiny-llama")
    engines.add_argument("--kv-cache-mib", type=int, help="KV cache per engine (default 1024 MiB)")
    engines.add_argument("--log-dir", type=Path)
    engines.add_argument("--ready-timeout", type=float, default=300)
    engines.add_argument("extra_args", nargs="*", help="extra vLLM arguments (after --)")
    engines.set_defaults(func=_cmd_engines)

    up = sub.add_parser(
        "up",
        help="run what the Helm chart deploys for a values file, as local processes, until Ctrl-C",
        description="Renders the chart with helm template (the chart's own checks), runs each engine replica,"
        " the router, LMCache's cache server and controller as local processes, and prints every"
        " substitution this machine needs (weights, GPUs, cluster DNS, ...).",
    )
    _values_flags(up)
    up.add_argument(
        "--port", type=int, default=int(os.environ.get("VLLM_STACK_PORT", 8080)), help="router port"
    )
    up.add_argument("--namespace", default="default", help="the namespace the chart is rendered for")
    up.add_argument("--prometheus", action="store_true", help="also run Prometheus with the chart's rules")
    up.add_argument("--prometheus-port", type=int, default=9090)
    up.add_argument(
        "--max-engines", type=int, help="most engines to start (default: what the memory fits, ~3 GiB each)"
    )
    up.add_argument("--log-dir", type=Path, help="logs and the pods' local folders (default: a new temp dir)")
    up.add_argument("--ready-timeout", type=float, default=600.0, help="seconds an engine may take to start")
    up.add_argument("--dry-run", action="store_true", help="print the substitutions and command lines only")
    up.set_defaults(func=_cmd_up)

    check = sub.add_parser(
        "check",
        help="print every deviation the chart would make from a values file, ranked error/breaks/differs/info",
        description="Renders the chart as helm install --dry-run=client does (no cluster) and prints each key it"
        " honours differently, substitutes or ignores: what NOTES.txt lists, which helm template (Argo CD, Flux)"
        " never shows, and what the render changes that no key asked for; each line ranked error, breaks (will not"
        " start or not work as meant), differs (not as production-stack's chart) or info. --fail-on picks the"
        " level that exits 1 (default breaks); --strict renders with strict=true: any deviation fails.",
    )
    _values_flags(check)
    check.add_argument(
        "--strict", action="store_true", help="exit 1 on any deviation (the chart's strict: true)"
    )
    check.add_argument(
        "--fail-on",
        choices=["breaks", "differs", "info"],
        default="breaks",
        help="exit 1 on a finding of this severity or above (error > breaks > differs > info; default breaks)",
    )
    check.add_argument("-v", "--verbose", action="store_true", help="print each finding in full")
    check.add_argument("--release", default="vllm-stack", help="release name the chart is rendered for")
    check.add_argument("--namespace", default="default", help="namespace the chart is rendered for")
    check.set_defaults(func=_cmd_check)

    cluster = sub.add_parser(
        "cluster", help="a real Kubernetes control plane on loopback (tests, trying the chart)"
    )
    cluster_sub = cluster.add_subparsers(dest="cluster_command", required=True)
    cluster_up = cluster_sub.add_parser(
        "up",
        help="etcd, kube-apiserver, controller manager, scheduler and kwok nodes until Ctrl-C",
        description="Starts the control plane built by make install (RBAC on, ServiceAccount tokens signed),"
        " kwok nodes advertising CPU, memory and GPUs, storage and the CRDs, writes an admin kubeconfig"
        " and prints how to use it. Ctrl-C stops everything.",
    )
    cluster_up.add_argument("--nodes", type=int, default=3, help="kwok nodes")
    cluster_up.add_argument(
        "--real-nodes", type=int, default=0, choices=(0, 1, 2),
        help="real nodes (a kubelet and containerd in namespaces of their own, linked to each other, kube-proxy;"
        " CoreDNS on the first; make install builds them); kwok nodes are then tainted NoSchedule",
    )  # fmt: skip
    cluster_up.add_argument("--dir", type=Path, help="state, logs and kubeconfig (default: a new temp dir)")
    cluster_up.set_defaults(func=_cmd_cluster_up)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "router":  # reached through vllm_stack.cli normally; kept for -m use
        return _cmd_router(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
