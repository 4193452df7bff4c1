"""The Batch API (vllm_stack.batch, docs/batch.md): /v1/files and /v1/batches, lines run at sheddable
priority."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_stack.settings.declare import ConfigError, setting

BUILT_AT_START = "the Batch API's store and runner are built at start"


@dataclass(frozen=True)
class BatchGroup:
    """Files (and the SQLite database) in batch_dir; with a PostgreSQL URL (the environment's
    VLLM_STACK_BATCH_DATABASE_URL: it holds a password) replicas share the batches, and batch_dir must
    be one volume they all mount (ReadWriteMany). The chart passes these from routerSpec.batch and
    refuses them in routerSpec.extraArgs."""

    __slots__ = ()

    batch_api: bool = setting(
        False,
        doc="serve /v1/files and /v1/batches and run batches at sheddable priority",
        restart=BUILT_AT_START,
        chart="routerSpec.batch.enabled",
    )
    batch_dir: str = setting(
        "vllm-stack-batch",
        doc="file contents and the SQLite database (default ./vllm-stack-batch)",
        restart=BUILT_AT_START,
        chart="routerSpec.batch.storage",
    )
    batch_database_url: str | None = setting(
        None,
        repr=False,
        doc="PostgreSQL (postgresql://...) for the batches, shared by the replicas (default: SQLite)",
        flag="",
        in_file=False,
        env="VLLM_STACK_BATCH_DATABASE_URL",
        restart=BUILT_AT_START,
        chart="routerSpec.batch.database",
    )
    batch_completion_window: float = setting(
        86400.0,
        doc="seconds a batch's '24h' window lasts (default 86400); unfinished lines then expire",
        restart=BUILT_AT_START,
        chart="routerSpec.batch.completionWindowSeconds",
    )
    batch_max_file_bytes: int = setting(
        200 * 1024 * 1024,
        doc="largest upload (default 209715200)",
        restart=BUILT_AT_START,
        chart="routerSpec.batch.maxFileBytes",
    )
    batch_concurrency: int = setting(
        8,
        doc="batch lines in flight from this router (default 8)",
        restart=BUILT_AT_START,
        chart="routerSpec.batch.concurrency",
    )
    # vLLM does not preempt a running request for a more urgent one (vllm_stack.engines.load.background_room)
    batch_reserve_slots: int = setting(
        2,
        doc="running slots per engine batch lines leave free for interactive requests (default 2)",
        restart=BUILT_AT_START,
        chart="routerSpec.batch.reserveSlots",
    )
    batch_lease_seconds: float = setting(
        30.0,
        doc="a dead router's batch lines are taken again after this (default 30)",
        restart=BUILT_AT_START,
        chart="routerSpec.batch.leaseSeconds",
    )

    def check(self) -> None:
        """Raise :class:`ConfigError` on Batch API settings that cannot work."""
        if self.batch_completion_window <= 0 or self.batch_lease_seconds <= 0:
            raise ConfigError("batch_completion_window and batch_lease_seconds must be > 0")
        if self.batch_reserve_slots < 0:
            raise ConfigError("batch_reserve_slots must be >= 0")
        if self.batch_max_file_bytes <= 0 or self.batch_concurrency <= 0:
            raise ConfigError("batch_max_file_bytes and batch_concurrency must be > 0")
        if self.batch_database_url and not self.batch_database_url.startswith(
            ("postgresql://", "postgres://")
        ):
            raise ConfigError("the batch database URL must be a postgresql:// URL")
