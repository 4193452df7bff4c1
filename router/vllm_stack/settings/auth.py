"""Client and admin API keys: files named here, keys read from them and from the environment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_stack.settings.declare import setting


def key_set(keys_file: str, env: str) -> Any:  # noqa: ANN401 - a dataclass field stands for its value
    """A set of keys read as a configuration is loaded: ``keys_file``'s lines and the comma list in
    ``env``; never a flag or a file setting (keys are secrets)."""
    return setting(
        factory=frozenset,
        repr=False,
        doc=f"the keys: {keys_file}'s lines and the comma list in the environment",
        flag="",
        in_file=False,
        env=env,
    )


@dataclass(frozen=True)
class AuthGroup:
    """Who may call the router. The key sets are read from the files (and the environment) as a
    configuration is loaded, so a reload that changes the file's keys applies them."""

    __slots__ = ()

    api_keys_file: str | None = setting(
        None,
        doc="client API keys, one per line, ``NAME: KEY`` to name its tenant (or env VLLM_STACK_API_KEYS)",
        chart="routerSpec.apiKeysSecret",
    )
    api_keys: frozenset[str] = key_set("api_keys_file", "VLLM_STACK_API_KEYS")
    # The tenant each named client key stands for (vllm_stack.tenants.identity), read with the keys
    api_key_names: Mapping[str, str] = setting(
        factory=dict,
        repr=False,
        doc="the tenant names of client keys: the ``NAME: KEY`` lines of api_keys_file",
        flag="",
        in_file=False,
    )
    # Keys that may load and unload adapters through the router (none: those endpoints are refused)
    admin_api_keys_file: str | None = setting(
        None,
        doc="keys that may load/unload LoRA adapters through the router, one per line "
        "(or env VLLM_STACK_ADMIN_API_KEYS)",
        chart="routerSpec.adminApiKeysSecret",
    )
    admin_api_keys: frozenset[str] = key_set("admin_api_keys_file", "VLLM_STACK_ADMIN_API_KEYS")

    def check(self) -> None:
        """Nothing to check: an unreadable key file fails as it is read."""
