"""The Gateway API Inference Extension (docs/inference-extension.md): this router as an endpoint
picker for a gateway, or a router that asks an endpoint picker."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_stack.settings.declare import ConfigError, setting

PICKER_SERVER = "the endpoint picker's gRPC server takes it at start"
PICKER_CLIENT = "the endpoint picker's client is built at start"


@dataclass(frozen=True)
class GatewayGroup:
    """The endpoint picker's bounds on what a gateway holds (docs/inference-extension.md "Bounds"): a
    gateway's request arrives in milliseconds, as a router's head does (the same 30 s as
    request_head_timeout); an answer's silence as the router's request_timeout; each gateway connection
    holds a file descriptor of the process the router's own port shares."""

    __slots__ = ()

    ext_proc_port: int = setting(
        0,
        doc="serve this router's scheduling as an endpoint picker (ext_proc v3 gRPC) on this port",
        restart="the endpoint picker's gRPC server is bound at start",
        chart="inferenceExtension.epp.grpcPort",
    )
    ext_proc_idle_timeout: float = setting(
        30.0,
        doc="seconds a picker stream waiting for its request, or an idle gateway connection, may send "
        "nothing; then 408 or closed (default 30)",
        restart=PICKER_SERVER,
    )
    ext_proc_answer_timeout: float = setting(
        600.0,
        doc="seconds a picked request's answer may send nothing; then its engine booking is released "
        "(default 600)",
        restart=PICKER_SERVER,
    )
    ext_proc_max_connections: int = setting(
        256,
        doc="gateway connections the endpoint picker holds at once; more are closed (default 256)",
        restart=PICKER_SERVER,
    )
    endpoint_picker: str = setting(
        "",
        doc="gateway mode: ask this endpoint picker (grpc://HOST:PORT) for each request's engine",
        restart="the endpoint picker's channel is opened at start",
    )
    endpoint_picker_timeout: float = setting(
        1.0, doc="seconds the endpoint picker may take (default 1)", restart=PICKER_CLIENT
    )
    endpoint_picker_fail_open: bool = setting(
        True,
        doc="when the endpoint picker is down or slow, schedule here (default) or answer 503",
        negatable=True,
        restart=PICKER_CLIENT,
    )

    def check(self) -> None:
        """Raise :class:`ConfigError` on endpoint-picker settings that cannot work."""
        if not 0 <= self.ext_proc_port <= 65535:
            raise ConfigError("ext_proc_port must be a port number (0: no endpoint picker)")
        if self.ext_proc_idle_timeout <= 0 or self.ext_proc_answer_timeout <= 0:
            raise ConfigError("ext_proc_idle_timeout and ext_proc_answer_timeout must be > 0")
        if self.ext_proc_max_connections <= 0:
            raise ConfigError("ext_proc_max_connections must be > 0")
        if self.endpoint_picker:
            if not self.endpoint_picker.startswith("grpc://") or ":" not in self.endpoint_picker[7:]:
                raise ConfigError("endpoint_picker must be grpc://HOST:PORT")
            if self.ext_proc_port:
                raise ConfigError(
                    "endpoint_picker (gateway mode) and ext_proc_port (endpoint picker) exclude each other"
                )
        if self.endpoint_picker_timeout <= 0:
            raise ConfigError("endpoint_picker_timeout must be > 0")
