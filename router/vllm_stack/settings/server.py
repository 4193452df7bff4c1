"""The router's own HTTP server: where it listens, how long a client may take, what bodies it holds."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_stack.settings.declare import ConfigError, setting

JSON_PARSERS = ("msgspec", "orjson")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
LOG_FORMATS = ("text", "json")
BOUND_AT_START = "the listening socket is bound at start"


@dataclass(frozen=True)
class ServerGroup:
    """Listening, client time limits, body limits, logging."""

    __slots__ = ()

    host: str = setting("0.0.0.0", doc="listen address (default 0.0.0.0)", restart=BOUND_AT_START)
    port: int = setting(
        8000, doc="listen port (default 8000)", restart=BOUND_AT_START, chart="routerSpec.containerPort"
    )
    # production-stack's --root-path (its FastAPI root path, which it expects an ingress to strip): here
    # every path is served under it and without it (vllm_stack.server.http1.strip_root)
    root_path: str = setting(
        "",
        doc="a path prefix (e.g. /vllm) every route is served under as well as at /: behind an ingress "
        "that keeps the prefix or strips it",
        restart="the server takes it at start",
        chart="routerSpec.rootPath",
    )
    config_file: str | None = setting(
        None,
        doc="YAML configuration file; reloaded on change",
        flag="--config",
        in_file=False,
        restart="the file watched is the one given at start",
        chart="routerSpec.config",
    )
    config_watch_interval: float = setting(
        1.0,
        doc="seconds between checks of the --config file for a change (default 1)",
        restart="the file's watcher takes it at start",
    )
    # seconds a client's request head may take to arrive whole (slowloris); then 408 and close.
    # Well-kept proxies close within 60 s (nginx's client_header_timeout); a real client's head
    # takes milliseconds.
    request_head_timeout: float = setting(
        30.0, doc="seconds a request head may take to arrive; then 408 and close (default 30)"
    )
    # a request body (buffered, or an upload streamed to disk) that sends no byte this long is closed, so
    # a silent client gives back what its body holds of max_buffered_body_bytes. nginx's
    # client_body_timeout, with its default
    request_body_timeout: float = setting(
        60.0, doc="seconds a request body may send no byte; then 408 and close (default 60)"
    )
    max_body_bytes: int = setting(
        32 * 1024 * 1024,
        doc="largest accepted request body (default 32 MiB)",
        chart="routerSpec.maxBodyBytes",
    )
    # counted as body bytes arrive, over arriving, queued and answered requests (server/http1.py)
    max_buffered_body_bytes: int = setting(
        256 * 1024 * 1024,
        doc="request bodies all connections together may hold; past it 503 + Retry-After (default 256 MiB)",
    )
    # at least one max_body_bytes body per key (server/budget.py)
    max_body_share_per_key: float = setting(
        0.25,
        doc="with client keys: the part of --max-buffered-body-bytes one key's bodies may hold; "
        "past it 429 + Retry-After (default 0.25)",
    )
    max_connections: int = setting(
        10_000, doc="client connections held at once; more are answered 503 and closed", flag=""
    )
    shutdown_grace: float = setting(
        30.0,
        doc="seconds answers under way may take after SIGTERM (default 30)",
        restart="the server takes it at start",
        chart="routerSpec.terminationGracePeriodSeconds",
    )
    json_parser: str = setting(
        "msgspec", doc="the JSON parser of request bodies (default msgspec)", choices=JSON_PARSERS
    )
    log_level: str = setting(
        "info", doc="log level (default info)", choices=LOG_LEVELS, chart="routerSpec.logLevel"
    )
    # production-stack's flag and values; the formatter is vllm_stack.log_format's (settings reads only
    # priority, so the names are repeated there and checked equal by tests/router/test_production_stack_flags.py)
    log_format: str = setting(
        "text",
        doc="log lines as text (default) or json: one object per line, with request_id and trace_id "
        "on request lines",
        choices=LOG_FORMATS,
        restart="the process's log handler is set up at start",
    )
    access_log: bool = setting(False, doc="log every request")
    debug_headers: bool = setting(
        False,
        doc="answers carry x-vllm-stack-route: profile, reason, engine (default off)",
        negatable=True,
    )

    def check(self) -> None:
        """Raise :class:`ConfigError` on server settings that cannot work."""
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {LOG_FORMATS}")
        root = self.root_path
        # a trailing "/" is taken away where the server takes the root (app._root_path): "/vllm/" is "/vllm"
        if root and (not root.startswith("/") or any(c in root for c in "?#% \t\r\n")):
            raise ConfigError("root_path must be empty or a path like /vllm (starting with /)")
        if self.json_parser not in JSON_PARSERS:
            raise ConfigError(f"json_parser must be one of {JSON_PARSERS}")
        if self.config_watch_interval <= 0:
            raise ConfigError("config_watch_interval must be > 0")
        if self.request_head_timeout <= 0 or self.request_body_timeout <= 0:
            raise ConfigError("request_head_timeout and request_body_timeout must be > 0")
        if self.max_body_bytes <= 0:
            raise ConfigError("retries must be >= 0; max_body_bytes and request_timeout > 0")
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ConfigError("max_buffered_body_bytes must be >= max_body_bytes (one largest body must fit)")
        if not 0 < self.max_body_share_per_key <= 1:
            raise ConfigError("max_body_share_per_key must be in (0, 1]")
        if self.max_connections <= 0:
            raise ConfigError("max_connections must be > 0")
