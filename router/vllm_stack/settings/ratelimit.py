"""The rate limits' shared store (vllm_stack.tenants.limiter, docs/tenants.md): the tenants' limits
themselves are declared with the tenants; this is where the buckets live."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_stack.settings.declare import ConfigError, setting


@dataclass(frozen=True)
class RateLimitGroup:
    """Without a store each router replica keeps its own buckets (a limit then holds per replica); with
    a Redis address (the environment's VLLM_STACK_RATE_LIMIT_REDIS_URL: it may hold a password, so the
    chart passes it from a Secret, never as a flag) every replica decides in the same Redis."""

    __slots__ = ()

    rate_limit_redis_url: str | None = setting(
        None,
        repr=False,
        doc="Redis (redis://[:password@]host:port/db, rediss:// for TLS) shared by the replicas for the "
        "tenants' rate limits (default: each replica its own)",
        flag="",
        in_file=False,
        env="VLLM_STACK_RATE_LIMIT_REDIS_URL",
        restart="the rate limits' store is connected at start",
        chart="routerSpec.rateLimitStore",
    )

    rate_limit_store_timeout: float = setting(
        0.5,
        doc="seconds a rate-limit decision may wait for Redis before this replica decides alone (default 0.5)",
        restart="the rate limits' store is connected at start",
    )

    def check(self) -> None:
        """Raise :class:`ConfigError` on a store address Redis's client cannot take."""
        if self.rate_limit_store_timeout <= 0:
            raise ConfigError("rate_limit_store_timeout must be > 0")
        url = self.rate_limit_redis_url
        if url and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("the rate-limit store must be a redis://, rediss:// or unix:// URL")
