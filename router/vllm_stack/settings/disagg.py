"""Disaggregated prefill (vllm_stack.director.disagg): models with prefill-role engines send each
request's prefill there first."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_stack.settings.declare import ConfigError, setting

DISAGG_PROTOCOLS = ("vllm", "lmcache")  # vllm_stack.director.disagg
NOTIFY_SOCKET = "LMCache's notification socket is bound at start"


@dataclass(frozen=True)
class DisaggGroup:
    """On with routing_logic disaggregated_prefill or prefill roles too (``RouterConfig.disaggregated``).
    lmcache protocol: where decode engines' LMCache receivers listen (engine host, these ports), where
    the router takes the prefill engines' "KV sent" notifications (ZMQ PULL), and how long it waits."""

    __slots__ = ()

    disaggregation: bool = setting(
        False,
        doc="serve models that have prefill-role engines disaggregated (default: on with such roles)",
        negatable=True,
        chart="routerSpec.enablePD",
    )
    disagg_protocol: str = setting(
        "vllm",
        doc="KV hand-over protocol (default vllm): vLLM's kv_transfer_params, or LMCache's disagg_spec",
        choices=DISAGG_PROTOCOLS,
        restart=NOTIFY_SOCKET + " (or not)",
    )
    disagg_min_uncached_tokens: int = setting(
        256, doc="uncached prompt tokens below which a request skips the prefill engine (default 256)"
    )
    disagg_receiver_init_port: int = setting(
        7300, doc="lmcache protocol: decode engines' pd_peer_init_port (7300)"
    )
    disagg_receiver_alloc_port: int = setting(
        7400, doc="lmcache protocol: decode engines' pd_peer_alloc_port (7400)"
    )
    disagg_notify_port: int = setting(
        7500,
        doc="lmcache protocol: where the router takes prefill engines' notifications (their pd_proxy_port, 7500)",
        restart=NOTIFY_SOCKET,
    )
    disagg_notify_timeout: float = setting(
        10.0,
        doc="lmcache protocol: seconds to wait for a prefill engine's notification before decoding anyway (10)",
    )

    def check(self) -> None:
        """Raise :class:`ConfigError` on disaggregation settings that cannot work."""
        if self.disagg_protocol not in DISAGG_PROTOCOLS:
            raise ConfigError(f"disagg_protocol must be one of {DISAGG_PROTOCOLS}")
        if self.disagg_min_uncached_tokens < 0:
            raise ConfigError("disagg_min_uncached_tokens must be >= 0")
        ports = (self.disagg_receiver_init_port, self.disagg_receiver_alloc_port, self.disagg_notify_port)
        if not all(0 < port < 65536 for port in ports) or self.disagg_notify_timeout <= 0:
            raise ConfigError("the disagg_* ports must be in 1..65535 and disagg_notify_timeout > 0")
