"""``vllm-stack router``: command line (production-stack's flag names) -> the router's own server on uvloop."""

from __future__ import annotations

import argparse
import gc
import logging
import sys

from vllm_stack.config import TRACE_PROTOCOLS, ConfigError
from vllm_stack.scheduling.profiles import ROUTING_LOGICS


def build_parser(prog: str = "vllm-stack router") -> argparse.ArgumentParser:
    """Flags of docs/contracts.md (plus a few extras). Defaults are None so the YAML file can set them."""
    p = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible router for vLLM engines.")
    p.add_argument("--host", help="listen address (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--config", dest="config_file", help="YAML configuration file; reloaded on change")
    p.add_argument("--service-discovery", choices=("static", "k8s"))
    p.add_argument("--static-backends", help="comma-separated engine URLs")
    p.add_argument("--static-models", help="comma-separated model names, one per static backend (optional)")
    p.add_argument(
        "--static-roles",
        help="comma-separated roles (prefill, decode, both), one per static backend (optional)",
    )
    p.add_argument(
        "--disaggregation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve models that have prefill-role engines disaggregated (default: on with such roles)",
    )
    p.add_argument(
        "--prefill-model-labels",
        help="production-stack's: comma-separated values of the pods' 'model' label that mark prefill engines",
    )
    p.add_argument(
        "--decode-model-labels",
        help="production-stack's: comma-separated values of the pods' 'model' label that mark decode engines",
    )
    p.add_argument(
        "--disagg-protocol", choices=("vllm", "lmcache"), help="KV hand-over protocol (default vllm)"
    )
    p.add_argument(
        "--disagg-receiver-init-port",
        type=int,
        help="lmcache protocol: decode engines' pd_peer_init_port (7300)",
    )
    p.add_argument(
        "--disagg-receiver-alloc-port",
        type=int,
        help="lmcache protocol: decode engines' pd_peer_alloc_port (7400)",
    )
    p.add_argument(
        "--disagg-notify-port",
        type=int,
        help="lmcache protocol: where the router takes prefill engines' notifications (their pd_proxy_port, 7500)",
    )
    p.add_argument(
        "--disagg-notify-timeout",
        type=float,
        help="lmcache protocol: seconds to wait for a prefill engine's notification before decoding anyway (10)",
    )
    p.add_argument(
        "--disagg-min-uncached-tokens",
        type=int,
        help="uncached prompt tokens below which a request skips the prefill engine (default 256)",
    )
    p.add_argument("--k8s-namespace")
    p.add_argument("--k8s-label-selector")
    p.add_argument("--k8s-port", type=int)
    p.add_argument("--routing-logic", choices=ROUTING_LOGICS)
    p.add_argument(
        "--tokenizers",
        help="prefixaware in token mode: model=DIR or model=hf:ORG/NAME[@REV], comma-separated (DIR holds tokenizer.json, tokenizer_config.json; hf: fetches them from $HF_ENDPOINT)",
    )
    p.add_argument(
        "--kv-events",
        choices=("auto", "on", "off"),
        help="prefixaware: follow the engines' KV events (auto, the default: for models with a tokenizer)",
    )
    p.add_argument(
        "--lmcache-controller-url",
        help="kvaware: the HTTP API of LMCache's controller (lmcache_controller --port), e.g. http://HOST:9010",
    )
    p.add_argument(
        "--kv-aware-threshold",
        type=int,
        help="kvaware: the most prompt tokens the LMCache holder may lack and still get the request (2000)",
    )
    p.add_argument(
        "--lmcache-lookup-timeout",
        type=float,
        help="kvaware: seconds one controller lookup may take before the cache-aware fallback decides (0.2)",
    )
    p.add_argument(
        "--debug-headers",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="answers carry x-vllm-stack-route: profile, reason, engine (default off)",
    )
    p.add_argument("--session-key", help="header holding the session id (falls back to the body's 'user')")
    p.add_argument(
        "--engine-scrape-interval", type=float, help="seconds between /metrics scrapes (default 1)"
    )
    p.add_argument("--health-check-interval", type=float, help="seconds between health checks (default 5)")
    p.add_argument("--request-timeout", type=float, help="seconds an engine may stay silent (default 600)")
    p.add_argument(
        "--request-head-timeout",
        type=float,
        help="seconds a request head may take to arrive; then 408 and close (default 30)",
    )
    p.add_argument(
        "--request-body-timeout",
        type=float,
        help="seconds a request body may send no byte; then 408 and close (default 60)",
    )
    p.add_argument("--max-body-bytes", type=int, help="largest accepted request body (default 32 MiB)")
    p.add_argument(
        "--max-buffered-body-bytes",
        type=int,
        help="request bodies all connections together may hold; past it 503 + Retry-After (default 256 MiB)",
    )
    p.add_argument(
        "--max-body-share-per-key",
        type=float,
        help="with client keys: the part of --max-buffered-body-bytes one key's bodies may hold; "
        "past it 429 + Retry-After (default 0.25)",
    )
    p.add_argument("--engine-ca-file", help="CA bundle for https engines (default: the system's)")
    p.add_argument("--api-keys-file", help="client API keys, one per line (or env VLLM_STACK_API_KEYS)")
    p.add_argument(
        "--admin-api-keys-file",
        help="keys that may load/unload LoRA adapters through the router, one per line (or env VLLM_STACK_ADMIN_API_KEYS)",
    )
    p.add_argument(
        "--lora-load-timeout", type=float, help="seconds one LoRA adapter load may take (default 120)"
    )
    p.add_argument(
        "--priority-api-keys-file",
        help="keys that may raise a request's priority above its model's, one per line "
        "(or env VLLM_STACK_PRIORITY_API_KEYS)",
    )
    p.add_argument(
        "--queue-timeout", type=float, help="seconds a request may wait in the router's queue (default 120)"
    )
    p.add_argument(
        "--queue-max-per-model",
        type=int,
        help="requests the router's queue holds per model (default 1000; 0: off)",
    )
    p.add_argument("--log-level", choices=("critical", "error", "warning", "info", "debug"))
    # Extras.
    p.add_argument("--retries", type=int, help="extra attempts on another engine (default 2)")
    p.add_argument(
        "--shutdown-grace", type=float, help="seconds answers under way may take after SIGTERM (default 30)"
    )
    p.add_argument("--json-parser", choices=("msgspec", "orjson"))
    p.add_argument("--session-balance-epsilon", type=float, help="bounded-load factor e of session affinity")
    p.add_argument("--access-log", action="store_const", const=True, help="log every request")
    # Tracing: vLLM's flag name, and production-stack's (its chart renders --otel-endpoint host:4317)
    p.add_argument(
        "--otlp-traces-endpoint",
        "--otel-endpoint",
        dest="otlp_traces_endpoint",
        help="send OpenTelemetry traces here (OTLP: host:port for grpc, a URL for http/protobuf); off when unset",
    )
    p.add_argument("--otlp-traces-protocol", choices=TRACE_PROTOCOLS, help="OTLP transport (default grpc)")
    p.add_argument(
        "--otel-service-name", help="service.name of the router's spans (default vllm-stack-router)"
    )
    p.add_argument("--otel-secure", action="store_const", const=True, help="OTLP over gRPC with TLS")
    p.add_argument(
        "--trace-sample-ratio",
        type=float,
        help="share of new traces kept, 0..1 (default 1; a client's traceparent decides)",
    )
    # The Gateway API Inference Extension (docs/inference-extension.md)
    p.add_argument(
        "--ext-proc-port",
        type=int,
        help="serve this router's scheduling as an endpoint picker (ext_proc v3 gRPC) on this port",
    )
    p.add_argument(
        "--ext-proc-idle-timeout",
        type=float,
        help="seconds a picker stream waiting for its request, or an idle gateway connection, may send "
        "nothing; then 408 or closed (default 30)",
    )
    p.add_argument(
        "--ext-proc-answer-timeout",
        type=float,
        help="seconds a picked request's answer may send nothing; then its engine booking is released "
        "(default 600)",
    )
    p.add_argument(
        "--ext-proc-max-connections",
        type=int,
        help="gateway connections the endpoint picker holds at once; more are closed (default 256)",
    )
    p.add_argument(
        "--inference-pool",
        help="engines: the pods of this InferencePool (its selector and target port; with k8s discovery)",
    )
    p.add_argument(
        "--endpoint-picker",
        help="gateway mode: ask this endpoint picker (grpc://HOST:PORT) for each request's engine",
    )
    p.add_argument(
        "--endpoint-picker-timeout", type=float, help="seconds the endpoint picker may take (default 1)"
    )
    p.add_argument(
        "--endpoint-picker-fail-open",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="when the endpoint picker is down or slow, schedule here (default) or answer 503",
    )
    # The Batch API (docs/batch.md); its PostgreSQL URL only from VLLM_STACK_BATCH_DATABASE_URL (a password)
    p.add_argument(
        "--batch-api",
        action="store_const",
        const=True,
        help="serve /v1/files and /v1/batches and run batches at sheddable priority",
    )
    p.add_argument("--batch-dir", help="file contents and the SQLite database (default ./vllm-stack-batch)")
    p.add_argument(
        "--batch-completion-window",
        type=float,
        help="seconds a batch's '24h' window lasts (default 86400); unfinished lines then expire",
    )
    p.add_argument("--batch-max-file-bytes", type=int, help="largest upload (default 209715200)")
    p.add_argument("--batch-concurrency", type=int, help="batch lines in flight from this router (default 8)")
    p.add_argument(
        "--batch-reserve-slots",
        type=int,
        help="running slots per engine batch lines leave free for interactive requests (default 2)",
    )
    p.add_argument(
        "--batch-lease-seconds",
        type=float,
        help="a dead router's batch lines are taken again after this (default 30)",
    )
    # production-stack's router hosts an LMCache controller itself for kvaware; this one asks a
    # separate lmcache_controller. Its flags are taken only to say so (see main).
    for flag in HOSTED_CONTROLLER_FLAGS:
        p.add_argument(flag, dest="hosted_" + flag[2:].replace("-", "_"), help=argparse.SUPPRESS)
    return p


#: production-stack's flags of the LMCache controller its router hosts (kvaware)
HOSTED_CONTROLLER_FLAGS = (
    "--lmcache-controller-port",
    "--lmcache-controller-reply-port",
    "--lmcache-controller-heartbeat-port",
    "--lmcache-health-check-interval",
    "--lmcache-worker-timeout",
)


def main(argv: list[str] | None = None, prog: str = "vllm-stack router") -> int:
    parser = build_parser(prog)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    hosted = [f for f in HOSTED_CONTROLLER_FLAGS if getattr(args, "hosted_" + f[2:].replace("-", "_"))]
    if hosted:
        parser.error(
            f"{', '.join(hosted)}: production-stack's router hosts an LMCache controller for kvaware; this "
            "router asks a separate one (lmcache_controller, which the chart deploys): give "
            "--lmcache-controller-url http://HOST:PORT, its HTTP API"
        )
    cli = {
        k: v
        for k, v in vars(args).items()
        if k != "config_file" and not k.startswith("hosted_") and v is not None
    }

    import uvloop

    from vllm_stack.app import build_router
    from vllm_stack.server import RouterServer, serve_forever
    from vllm_stack.server.memory import Allocator

    try:
        router = build_router(cli, args.config_file)
    except ConfigError as exc:
        print(f"vllm-stack router: {exc}", file=sys.stderr)
        return 2
    config = router.config
    # The hot path allocates a few dozen short-lived containers per request; with CPython's default
    # gen-0 threshold (700) the collector runs every ~10 requests and costs about a fifth of the
    # router's own CPU (benchmarks/results/router.md). A larger gen-0 and freezing the start-up heap
    # keep collections rare and cheap. Process-wide, so set here and not in the Router object.
    gc.freeze()
    gc.set_threshold(20_000, 20, 100)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    allocator = Allocator()  # process-wide too: memory freed after a burst goes back to the system
    allocator.configure()
    server = RouterServer(
        router, config.host, config.port, shutdown_grace=config.shutdown_grace, allocator=allocator
    )
    uvloop.run(serve_forever(server))
    return 0


if __name__ == "__main__":
    sys.exit(main())
