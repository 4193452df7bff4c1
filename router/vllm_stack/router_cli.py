"""``vllm-stack router``: command line (production-stack's flag names) -> the router's own server on uvloop."""

from __future__ import annotations

import argparse
import gc
import sys

from vllm_stack import log_format
from vllm_stack.config import DECLARED, ConfigError
from vllm_stack.settings import Declared

_TYPES = {"int": int, "float": float}


def _add_flag(p: argparse.ArgumentParser, item: Declared) -> None:
    """One setting's flag as its declaration says: a value of the field's type, or for a boolean a
    switch that turns it on (``--x / --no-x`` where it is ``negatable``)."""
    decl = item.setting
    names = (item.flag, *decl.aliases)
    if item.type == "bool":
        if decl.negatable:
            p.add_argument(
                *names, dest=item.name, action=argparse.BooleanOptionalAction, default=None, help=decl.doc
            )
        else:
            p.add_argument(*names, dest=item.name, action="store_const", const=True, help=decl.doc)
        return
    p.add_argument(*names, dest=item.name, type=_TYPES.get(item.type), choices=decl.choices, help=decl.doc)


def build_parser(prog: str = "vllm-stack router") -> argparse.ArgumentParser:
    """Every setting that has a flag (vllm_stack.settings declares them), in the order of their groups.
    Defaults are None so the YAML file can set them; docs/settings.md lists them."""
    p = argparse.ArgumentParser(prog=prog, description="OpenAI-compatible router for vLLM engines.")
    for item in DECLARED.values():
        if item.flag is not None:
            _add_flag(p, item)
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
    log_format.configure(config.log_level, config.log_format)
    allocator = Allocator()  # process-wide too: memory freed after a burst goes back to the system
    allocator.configure()
    server = RouterServer(
        router, config.host, config.port, shutdown_grace=config.shutdown_grace, allocator=allocator
    )
    uvloop.run(serve_forever(server))
    return 0


if __name__ == "__main__":
    sys.exit(main())
