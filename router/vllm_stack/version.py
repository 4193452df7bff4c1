"""The router's version, read from the installed distribution so that it is defined in one place."""

from __future__ import annotations

from importlib import metadata


def router_version() -> str:
    """Version of the installed ``vllm-stack`` distribution (``0.0.0+unknown`` when not installed)."""
    try:
        return metadata.version("vllm-stack")
    except metadata.PackageNotFoundError:  # running from a bare checkout
        return "0.0.0+unknown"
