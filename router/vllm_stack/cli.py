"""The `vllm-stack` command. ``vllm-stack router`` (the container's entry point) runs the router and
loads nothing else; every other subcommand is development tooling from :mod:`vllm_stack_dev.cli`,
imported only when one of them is asked for, so the router's runtime import graph stays free of it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The router owns its whole flag set (production-stack compatible); hand it everything after "router".
    if argv and argv[0] == "router":
        from vllm_stack.router_cli import main as router_main

        return router_main(argv[1:])
    if argv and argv[0] == "epp":  # the router's scheduling served to a gateway (ext_proc on 9002)
        from vllm_stack.router_cli import main as router_main

        return router_main(["--ext-proc-port", "9002", *argv[1:]], prog="vllm-stack epp")
    from vllm_stack_dev.cli import main as dev_main  # development commands: models, engines, run

    return dev_main(argv)


if __name__ == "__main__":
    sys.exit(main())
